"""Fused ops of the MoE layer. Each op has a PyTorch reference (reference.py: the CPU path and the
ground truth) and a Triton version with the same signature (triton_*.py); backend.py picks one set.
Imports torch only, nothing of ours; triton is imported only when the triton backend is asked for.

The folder is kernels/ in the repository; its import name is fairseq_moe_kernels (installed under that
name by setup.py, and a symlink in a checkout), so that it cannot clash with Hugging Face's `kernels`."""
from . import backend
from .reference import grouped_mlp, moe_mlp, permute, router, unpermute

__all__ = ["backend", "grouped_mlp", "moe_mlp", "permute", "router", "unpermute"]
