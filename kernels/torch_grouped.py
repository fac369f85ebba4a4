"""The expert MLP on PyTorch's own grouped GEMM (torch.nn.functional.grouped_mm): backend "grouped_mm".

Same signatures as reference.grouped_mlp and reference.moe_mlp (router, permute and unpermute are the
reference's). Each of fc1 and fc2 is one grouped GEMM over the expert-sorted rows (offsets: the cumulative
counts); the biases are gathered per row; autograd differentiates through grouped_mm (its backward is grouped
GEMMs too: CUTLASS on Hopper, what torchtitan's MoE trains with). PyTorch tests it on GPUs, so it is the proven
path that `auto` takes on CUDA where the dtype is supported (supported(), probed once per device and dtype).
Activation dropout draws its mask as the reference does (the same generator calls, in the same order).
grouped_mm wants rows of 16 bytes: other widths d and f are padded with zeros for the GEMMs (a copy of the
weights per call: meant for odd test sizes, real models have aligned widths).
"""
from functools import lru_cache

import torch
import torch.nn.functional as F

from .reference import _activate, _sizes, permute, unpermute


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward refuses the
    expanded gradient of a .sum())."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped(x, w, offs, bias, expert_of_row):
    y = _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offs))
    return y + bias.index_select(0, expert_of_row)


def _aligned(n, dtype):
    """n rounded up so that a row of n elements is a multiple of 16 bytes (grouped_mm's stride rule)."""
    per = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return -(-n // per) * per


def grouped_mlp(x, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """fc2(act(fc1(x))) with one weight set per contiguous block of rows (see reference.grouped_mlp)."""
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [N, d], w1: [E, d, f]"
    assert counts.numel() == w1.shape[0] == w2.shape[0], "one count per expert"
    _sizes(counts, x.shape[0])
    if x.shape[0] == 0:  # (no rows: a GEMM of nothing; the weights still get their zero gradients)
        return x.new_zeros(0, w2.shape[2]) + 0 * (w1.sum() + b1.sum() + w2.sum() + b2.sum())
    counts = counts.to(x.device)
    offs = counts.cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    d, f = w1.shape[1], w1.shape[2]
    dp, fp = _aligned(d, x.dtype), _aligned(f, x.dtype)
    if (dp, fp) != (d, f):  # zeros to 16-byte rows (they add nothing: act(0) = 0 for relu, gelu and silu)
        x, w1, b1 = F.pad(x, (0, dp - d)), F.pad(w1, (0, fp - f, 0, dp - d)), F.pad(b1, (0, fp - f))
        w2, b2 = F.pad(w2, (0, dp - d, 0, fp - f)), F.pad(b2, (0, dp - d))
    h = _grouped(x.contiguous(), w1.contiguous(), offs, b1, expert_of_row)
    if fp != f:
        h = h[:, :f]  # (the mask is drawn on [N, f], as the reference draws it)
    a = _activate(h, activation)
    if dropout_p > 0:
        mask = torch.rand_like(a) >= dropout_p
        a = a * mask / (1 - dropout_p)
    if fp != f:
        a = F.pad(a, (0, fp - f))
    y = _grouped(a.contiguous(), w2.contiguous(), offs, b2, expert_of_row)
    return y[:, :d] if dp != d else y


def moe_mlp(x, token_index, weights, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """sum_n weights[n] * expert(x[token_index[n]]) (see reference.moe_mlp)."""
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [T, d], w1: [E, d, f]"
    assert token_index.shape == weights.shape and counts.numel() == w1.shape[0], "one count per expert"
    rows = grouped_mlp(permute(x, token_index), counts, w1, b1, w2, b2, activation, dropout_p)
    return unpermute(rows, token_index, weights, x.shape[0])


@lru_cache(maxsize=None)
def supported(device, dtype):
    """Whether grouped_mm runs forward and backward for `dtype` on `device` (torch.device), tried once on a tiny
    problem: the CUDA kernels need some dtypes and compute capabilities, the CPU one runs what it runs."""
    try:
        with torch.inference_mode(False), torch.enable_grad():  # (asked first under no_grad: generation, validation)
            return _probe(device, dtype)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError, AssertionError):
        return False


def _probe(device, dtype):
    x = torch.randn(3, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
    y = F.grouped_mm(x, w, offs=torch.tensor([1, 3], device=device, dtype=torch.int32))
    y.backward(torch.ones_like(y))
    return bool(torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all())
