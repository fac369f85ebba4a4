"""The host's copy of a counts tensor, read once: where a GPU would stall on a read of device memory.

The experts' row counts decide the shapes of what follows (each expert's GEMM on the torch backend, the splits of an
all-to-all, the rows kept under a capacity), so some code needs them as Python ints; on CUDA each such read
(.tolist(), .item(), int(t), a boolean index) waits for every kernel queued before it. sizes(counts) makes that read
once per counts tensor and keeps the list on the tensor; whoever made the counts and already knows them (routing that
read them once, a policy whose counts are a constant, the all-to-all that read its splits together) hands them over
with known(counts, list), and every op after it reads the list, not the device. A counts tensor is never changed in
place once made (a changed one would keep its old list): the layer and the ops make new ones.
A layer with its experts on other ranks must also read what those ranks send it, which it learns by exchanging the
counts (a collective): ahead(fn) lets it make that exchange before routing's read of the kept counts (routed()), so
that both are read in one read.
Where the MoE layer reads the device, and how often: docs/architecture.md ("Host reads").
"""
import contextlib
import threading

import torch

_ahead = threading.local()  # .pending: (fn, done) of the innermost ahead(), or None


def sizes(counts):
    """counts (integer, any shape) -> its values as a flat [int] list, read from the device at most once per tensor."""
    return read(counts)[0]


def read(*counts):
    """The flat [int] lists of each counts tensor; those whose list is not known yet in one read of the device
    together (one wait for the GPU, where one per tensor would be several)."""
    missing = [c for c in counts if _kept(c) is None]
    if missing:
        values = torch.cat([c.reshape(-1) for c in missing]).tolist() if len(missing) > 1 else \
            missing[0].reshape(-1).tolist()
        start = 0
        for c in missing:
            c._host_sizes, start = values[start:start + c.numel()], start + c.numel()
    return tuple(c._host_sizes for c in counts)


def routed(counts):
    """sizes(counts) for a routing policy's kept counts (the rows each expert gets), the one read a routing makes:
    inside ahead(fn), fn(counts) runs first and what it returns is read in the same read."""
    pending = getattr(_ahead, "pending", None)
    if pending is None or pending[1] or _kept(counts) is not None:
        return sizes(counts)
    fn, done = pending
    extra = fn(counts)
    read(counts, *extra)
    done.append(counts)
    return counts._host_sizes


@contextlib.contextmanager
def ahead(fn):
    """with ahead(fn) as done: the first routed(counts) inside runs fn(counts) (device ops, such as exchanging the
    counts with the other ranks: -> the tensors to read) and reads its tensors with counts, in one read; done then
    holds counts. Where no routed() comes (a policy that need not read), done stays empty: the caller runs fn itself."""
    done, outer = [], getattr(_ahead, "pending", None)
    _ahead.pending = (fn, done)
    try:
        yield done
    finally:
        _ahead.pending = outer


def known(counts, values):
    """counts, with the host's copy values (flat [int] list equal to counts: the caller read or made them) kept on
    it; -> counts."""
    values = list(values)
    if len(values) != counts.numel():
        raise ValueError(f"{len(values)} host sizes for {counts.numel()} counts")
    counts._host_sizes = values
    return counts


def full(n, value, device):
    """[n] long counts all equal to value (a policy's constant counts), their list known: never read."""
    return known(torch.full((n,), value, dtype=torch.long, device=device), [value] * n)


def _kept(counts):
    got = getattr(counts, "_host_sizes", None)
    return got if got is not None and len(got) == counts.numel() else None
