"""Fused ops of the MoE layer. Each op has a PyTorch reference (reference.py: the CPU path and the
ground truth) with the signature a Triton version must keep. Imports torch only, nothing of ours."""
from .reference import grouped_mlp, moe_mlp, permute, unpermute

__all__ = ["grouped_mlp", "moe_mlp", "permute", "unpermute"]
