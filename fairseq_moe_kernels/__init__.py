"""Fused ops of the MoE layer. Each op has a PyTorch reference (reference.py: the CPU path and the
ground truth) and a Triton version with the same signature (triton_*.py); backend.py picks one set.
Imports torch only, nothing of ours; triton is imported only when the triton backend is asked for.
Named fairseq_moe_kernels, not kernels, so that it cannot clash with Hugging Face's `kernels` package."""
from . import backend
from .reference import grouped_mlp, moe_mlp, permute, router, unpermute

__all__ = ["backend", "grouped_mlp", "moe_mlp", "permute", "router", "unpermute"]
