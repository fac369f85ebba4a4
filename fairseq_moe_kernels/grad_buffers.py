"""Weight-gradient buffers that a backward takes again once nothing else holds them (the torch backend's, on the CPU).

fairseq's zero_grad and torch's (set_to_none) drop every .grad each step, and the next backward allocates them again:
at E = 128, d = 512, f = 2048 that is 1 GiB of expert weight gradients a step. glibc maps every block over its mmap
threshold (32 MiB at most) anew, so the kernel hands out, and zeroes, fresh pages each step, which took a
tenth or more of the layer's step in the kernel (benchmarks/README.md, bench_layer.py at E = 128; the buffers' own
gain was not measured apart). The dense FFN's gradients are small enough to
come back from malloc's heap.

A gradient is handed out as a fresh view of a kept tensor: autograd's AccumulateGrad keeps a gradient that only it
holds as the weight's .grad without copying it, so .grad is that view. The kept tensor is handed out again only when
its storage is held by this module alone: then no .grad, optimizer, view or copy-on-write alias can see it being
overwritten. (A bare storage object held from Python, `w.grad.untyped_storage()`, does not count as a holder: a
caller that keeps one must copy it.) Buffers are kept per weight (a parameter, whose object autograd saves as is) and die with it; a weight
that is a temporary (autocast's cast, FSDP's flat views) gets a plain new tensor.
"""
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

MIN_BYTES = 32 * 2**20  # glibc's largest mmap threshold: smaller blocks come back from its heap without page faults
SLOTS = 2  # per weight and shape: one held as .grad, one for a backward that adds to it (--update-freq > 1)

_lock = threading.Lock()  # (two threads' backwards through one weight must not get one buffer)
_kept = WeakIdKeyDictionary()  # weight -> {(shape, dtype, device): [(kept tensor, its storage's use count alone)]}


def _users(t):
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def empty(like, shape):
    """An uninitialised tensor of `shape`, like's dtype and device, for a gradient of weight `like`: a kept buffer
    that nothing holds any more where `like` is a large CPU parameter, else a new one."""
    shape = torch.Size(shape)
    if (like.device.type != "cpu" or not like.is_leaf or not like.requires_grad
            or shape.numel() * like.element_size() < MIN_BYTES):
        return like.new_empty(shape)
    with _lock:
        slots = _kept.setdefault(like, {}).setdefault((shape, like.dtype, like.device), [])
        for kept, alone in slots:
            if _users(kept) == alone:
                return kept.view(shape)
        new = like.new_empty(shape)
        if len(slots) >= SLOTS:
            return new
        slots.append((new, _users(new)))
        return new.view(shape)


def release():
    """Drop every kept buffer (their memory goes back to malloc once no .grad holds it)."""
    _kept.clear()
