"""The kernel backend switch behind --moe-kernel-backend {auto,torch,grouped_mm,triton}.

    backend = resolve(cfg.kernel_backend, x.device, x.dtype)   # "torch", "grouped_mm" or "triton", or a ValueError
    k = ops(backend)                                  # k.router, k.permute, k.unpermute, k.grouped_mlp, k.moe_mlp

torch: the references (reference.py: one GEMM per expert). grouped_mm: the expert MLP on PyTorch's own grouped
GEMM (torch_grouped.py), the rest the references'. triton: the fused Triton kernels.
auto takes the proven path: grouped_mm where PyTorch runs its grouped GEMM kernel (CUTLASS: bf16 on compute
capability 9.x and 10.x, Hopper and Blackwell; elsewhere torch's grouped_mm is a loop of mm calls of its own, no
better than the reference), else torch. Never triton: its kernels have run only under Triton's interpreter on a
CPU, not yet on a GPU (benchmarks/gpu_check.sh is the check that would change that); they run when asked for by
name. An explicit
backend that cannot run is an error that says why, never a silent fallback: a user who asked for the fused
kernels should not measure the reference ones. Triton is imported only here, lazily, and the triton_* modules
only by ops("triton"), so `import fairseq_moe_kernels` works without triton.
"""
import importlib
import os
import types
from functools import lru_cache

import torch

from . import reference, torch_grouped

FLAG = "--moe-kernel-backend"
BACKENDS = ("auto", "torch", "grouped_mm", "triton")


def _triton_unavailable(device):
    """None if Triton kernels can run on tensors of `device`, else the reason they cannot."""
    if device.type == "cpu":
        # Triton compiles for GPUs only; its interpreter runs kernels on CPU tensors (slowly). It is
        # chosen when the triton_* modules are imported, from this variable.
        if os.environ.get("TRITON_INTERPRET") != "1":
            return ("tensors on the CPU need Triton's interpreter (set TRITON_INTERPRET=1 before triton is "
                    "imported; slow, meant for tests), or use torch")
    elif device.type != "cuda":
        return f"Triton kernels run on CUDA devices, not on {device.type!r}"
    return _import_error()


@lru_cache(maxsize=None)
def _import_error():
    """Why triton does not import, or None; asked once (resolve() runs in every layer forward)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:  # a broken install raises other ImportErrors than "not found"
        return f"triton cannot be imported ({err}); pip install triton, or use torch"
    return None


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton GEMMs compile for


def resolve(name, device, dtype=None):
    """The backend `name` means for tensors of `dtype` (None: float32) on `device`: "torch", "grouped_mm" or
    "triton"."""
    if name not in BACKENDS:
        raise ValueError(f"{FLAG} must be one of {list(BACKENDS)}, got {name!r}")
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "grouped_mm" if torch_grouped.fast(device, dtype or torch.float32) else "torch"
    if name == "grouped_mm":
        if not torch_grouped.supported(device, dtype or torch.float32):
            raise ValueError(f"{FLAG} grouped_mm: torch {torch.__version__}'s grouped_mm does not run "
                             f"{dtype or torch.float32} on {device}; use torch")
        return "grouped_mm"
    if dtype is not None and dtype not in TRITON_DTYPES:
        raise ValueError(f"{FLAG} triton runs fp16, bf16 and fp32 tensors, not {dtype}; use torch")
    reason = _triton_unavailable(device)
    if reason is not None:
        raise ValueError(f"{FLAG} triton cannot run on {device}: {reason}")
    return "triton"


# The ops of the layer and the Triton module of each; reference.py has them all, with the same signatures.
# Adding a kernel: its reference, its Triton file, one entry here, one case in cases.py.
OPS = {
    "router": "triton_router",
    "permute": "triton_permute",
    "unpermute": "triton_permute",
    "grouped_mlp": "triton_grouped_mlp",
    "moe_mlp": "triton_grouped_mlp",
}


GROUPED_MM_OPS = ("grouped_mlp", "moe_mlp")  # what backend grouped_mm takes from torch_grouped.py


@lru_cache(maxsize=None)
def ops(name):
    """Namespace of the ops (OPS) of a resolved backend, "torch", "grouped_mm" or "triton"."""
    if name not in ("torch", "grouped_mm", "triton"):
        raise ValueError(f"ops() takes a resolved backend, 'torch', 'grouped_mm' or 'triton' (see resolve()), "
                         f"got {name!r}")
    if name == "torch":
        return types.SimpleNamespace(name=name, **{op: getattr(reference, op) for op in OPS})
    if name == "grouped_mm":
        return types.SimpleNamespace(name=name, **{op: getattr(torch_grouped if op in GROUPED_MM_OPS else reference,
                                                                op) for op in OPS})
    modules = {m: importlib.import_module(f"{__package__}.{m}") for m in set(OPS.values())}  # imports triton
    return types.SimpleNamespace(name=name, **{op: getattr(modules[m], op) for op, m in OPS.items()})
