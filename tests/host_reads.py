"""Counting the reads of device memory by the host that code makes: on a GPU each one waits for every kernel queued
before it (a sync), on a CPU the same calls are what would wait. Counted: .tolist() (patched: it is not dispatched),
and the ATen ops that hand a value to the host or size their output by the data (.item(), int(t) and bool(t) as
_local_scalar_dense; nonzero; a boolean index; masked_select; bincount, which reads its largest id; repeat_interleave
without output_size; unique). Not counted: a boolean index_put_, torch.equal, .cpu(), and what only CUDA reads (a
GPU's torch.cuda.set_sync_debug_mode sees those)."""
import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
         "aten.bincount.default", "aten._unique2.default", "aten.unique_consecutive.default",
         "aten.unique_dim.default"}


def _where():
    """file:line of the innermost frame of our packages (fairseq_moe*) that made the read."""
    ours = [f for f in traceback.extract_stack()[:-2] if "/fairseq_moe" in f.filename]
    return f"{ours[-1].filename.rsplit('/', 2)[-2]}/{ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" \
        if ours else "elsewhere"


class _Reads(TorchDispatchMode):
    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in READS or (name == "aten.index.Tensor" and any(
                t is not None and t.dtype == torch.bool for t in args[1])) or (
                name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None):
            self.found[f"{name} at {_where()}"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counted():
    """with counted() as found: ...  -> found: Counter {"what at file:line": times}."""
    found = collections.Counter()
    tolist, own = torch.Tensor.tolist, "tolist" in torch.Tensor.__dict__

    def counting_tolist(self):
        found[f"tolist at {_where()}"] += 1
        return tolist(self)

    torch.Tensor.tolist = counting_tolist
    try:
        with _Reads(found):
            yield found
    finally:
        if own:
            torch.Tensor.tolist = tolist
        else:  # (inherited from torch's C base class: leave no copy behind)
            del torch.Tensor.tolist
