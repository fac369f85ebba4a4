"""Weight-gradient buffers that a backward takes again once nothing else holds them (the torch backend's, on the CPU),
and the same for the [N, f] tensors of an expert layer's step (fc1's output, which backward keeps; fc2's input
gradient).

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
caller that keeps one must copy it.) Buffers are kept per weight (a parameter, whose object autograd saves as is)
and die with it; a weight that is a temporary (FSDP's flat views, any cast but cast()'s) gets a plain new tensor,
and so does anything asked for under torch.inference_mode.

Under autocast the experts' fp32 weights are cast to bf16 each step (experts.py): cast() makes that cast into a
kept buffer of the weight's, whose gradient in bf16 comes from one set of slots for every layer and goes back into
the weight's own fp32 gradient buffer; a buffer asked for the cast (its gradient, fc1's output) is the weight's.

The [N, f] tensors: fc1's output, which a layer's backward keeps, under the layer's w1 (each layer holds its own
from forward to backward, and keeps it between steps, through the optimizer's step and validation too, at the
largest N it was taken for in training or evaluation); fc2's input gradient, which lives within one layer's
backward, in one set of slots for every layer (`_shared`: these outlive the model, until release(); a buffer goes
to one holder at a time by its use count, whoever asks). N changes with the batch's tokens and with drops, and a
kept buffer grows to the largest; at T = 16384, top-2, f = 2048 each is 128 MiB in bf16, whose fresh pages cost
more than its elementwise operations (benchmarks/README.md).
"""
import math
import threading

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

MIN_BYTES = 32 * 2**20  # glibc's largest mmap threshold: smaller blocks come back from its heap without page faults
SLOTS = 2  # per key: a gradient held as .grad and one for a backward that adds to it; rows of two pending graphs

_lock = threading.Lock()  # (two threads' backwards must not get one buffer)
# weight -> {(shape, or ("rows", width), dtype, device): [(kept 1-d tensor, its storage's use count alone)]}
_kept = WeakIdKeyDictionary()
_shared = {}  # the same keys, for every layer's rows (rows(shared=True))
_origin = WeakIdKeyDictionary()  # cast(weight) -> weight, while the cast lives


def _users(t):
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def empty(like, shape):
    """An uninitialised tensor of `shape`, like's dtype and device, for a gradient of weight `like`: a kept buffer
    that nothing holds any more where `like` is a large CPU parameter or cast(parameter), else a new one."""
    weight = _of(like)  # (a cast's gradient lives only until cast's backward copies it: one set for all layers)
    return _take(weight, torch.Size(shape), like.dtype, shape, _shared if weight is not like else None)


def cast(weight, dtype):
    """weight.to(dtype) as autograd sees it (its gradient comes back in weight's dtype), into kept buffers where
    weight is a large CPU parameter: the cast, its gradient in dtype, and the gradient in weight's dtype, none
    allocated anew each step (what autocast's casts of an [E, d, f] weight cost: a fresh cast allocated and
    faulted in each forward, fresh gradients each backward, 4x the kept copies' time at E = 128, d = 512,
    f = 2048). empty() and rows() for the cast take the weight's buffers."""
    if weight.dtype == dtype or type(weight) not in (torch.Tensor, torch.nn.Parameter) or not _keepable(
            weight, weight.numel() * max(dtype.itemsize, weight.dtype.itemsize)):  # (the cast's or its gradient's)
        return weight.to(dtype)
    return _Cast.apply(weight, dtype)


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.weight = weight
        out = _take(weight, ("cast", weight.shape), dtype, weight.shape).copy_(weight)
        with _lock:
            _origin[out] = weight
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        weight = ctx.weight
        return _take(weight, weight.shape, weight.dtype, weight.shape).copy_(grad), None


def _of(like):
    """The parameter whose buffers serve `like`: the parameter cast() made it from, or itself."""
    return _origin.get(like, like)


def _keepable(like, nbytes):
    return (like.device.type == "cpu" and like.is_leaf and like.requires_grad
            and not torch.is_inference_mode_enabled() and nbytes >= MIN_BYTES)


def rows(like, n, width, dtype, shared=False):
    """An uninitialised [n, width] tensor of dtype on like's device for a tensor of weight `like`'s layer step: the
    first n * width elements of a kept buffer (slots per width and dtype, each as large as the largest n it was
    taken for, so that a number of rows that changes every step, with the batch's tokens or a capacity, keeps at
    most SLOTS buffers). shared: the slots are every layer's (a tensor that lives within one layer's backward)."""
    return _take(_of(like), ("rows", width), dtype, (n, width), _shared if shared else None)


def _take(like, key, dtype, shape, pool=None):
    numel = math.prod(shape)
    if not _keepable(like, numel * dtype.itemsize):  # (inference tensors cannot be written outside inference mode)
        return like.new_empty(shape, dtype=dtype)
    with _lock:
        slots = (_kept.setdefault(like, {}) if pool is None else pool).setdefault((key, dtype, like.device), [])
        free = [i for i, (kept, alone) in enumerate(slots) if _users(kept) == alone]
        for i in free:
            if slots[i][0].numel() >= numel:
                return slots[i][0].view(-1)[:numel].view(shape)
        new = like.new_empty(numel, dtype=dtype)
        if free:  # (a free one too small for these rows: the larger one in its place)
            slots[free[0]] = (new, _users(new))
        elif len(slots) < SLOTS:
            slots.append((new, _users(new)))
        return new.view(shape)


def release():
    """Drop every kept buffer (their memory goes back to malloc once no .grad holds it)."""
    _kept.clear()
    _shared.clear()
    _origin.clear()
