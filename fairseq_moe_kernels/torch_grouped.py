"""The expert MLP on PyTorch's own grouped GEMM (torch.nn.functional.grouped_mm): backend "grouped_mm".

Same signatures as reference.grouped_mlp and reference.moe_mlp (router, permute and unpermute are the
reference's). Each of fc1 and fc2 is one grouped GEMM over the expert-sorted rows (offsets: the cumulative
counts); the biases are gathered per row; autograd differentiates through grouped_mm (its backward is grouped
GEMMs too: CUTLASS on Hopper, what torchtitan's MoE trains with). PyTorch tests it on GPUs, so it is the proven
path that `auto` takes where PyTorch runs its own kernel (fast(): bf16 on Hopper and Blackwell); supported()
says where it runs at all (probed once per device and dtype), which an explicit grouped_mm needs.
Activation dropout draws its mask as the reference does (the same generator calls, in the same order).
grouped_mm wants rows of 16 bytes: other widths d and f are padded with zeros for the GEMMs (a copy of the
weights per call: meant for odd test sizes, real models have aligned widths).
"""
from functools import lru_cache

import torch
import torch.nn.functional as F

from .reference import _activate, _sizes, act_width, check_shapes, permute, unpermute


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
    return y if bias is None else y + bias.index_select(0, expert_of_row)


def _pad_last(t, width, to, swiglu):
    """t's last dimension (f, or swiglu's gate and up halves each) padded with zeros from width to `to`."""
    parts = t.split(width, -1) if swiglu else (t,)
    return torch.cat([F.pad(p, (0, to - width)) for p in parts], -1)


def _aligned(n, element_size):
    """n rounded up so that a row of n elements is a multiple of 16 bytes (grouped_mm's stride rule)."""
    per = max(1, 16 // element_size)
    return -(-n // per) * per


def grouped_mlp(x, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """fc2(act(fc1(x))) with one weight set per contiguous block of rows (see reference.grouped_mlp)."""
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [N, d], w1: [E, d, f]"
    assert counts.numel() == w1.shape[0] == w2.shape[0], "one count per expert"
    check_shapes(w1, b1, w2, b2, activation)
    _sizes(counts, x.shape[0])
    if x.shape[0] == 0:  # (no rows: a GEMM of nothing; the weights get zero gradients, and x stays in the graph,
        # so that a rank whose experts got no rows still runs the backward of the all-to-all that brought them)
        return x.new_zeros(0, w2.shape[2]) + 0 * sum(t.sum() for t in (x, w1, b1, w2, b2) if t is not None)
    if x.shape[0] >= 2 ** 31:
        raise ValueError(f"grouped_mm's offsets are int32: {x.shape[0]} rows are too many; use --moe-kernel-backend "
                         f"torch")
    counts = counts.to(x.device)
    offs = counts.cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                            output_size=x.shape[0])
    swiglu = activation == "swiglu"
    d, f = w1.shape[1], act_width(w1, activation)
    dp, fp = _aligned(d, x.element_size()), _aligned(f, x.element_size())
    if (dp, fp) != (d, f):  # zeros to 16-byte rows (they add nothing: act(0) = 0 for relu, gelu, silu and swiglu)
        x, w1 = F.pad(x, (0, dp - d)), _pad_last(F.pad(w1, (0, 0, 0, dp - d)), f, fp, swiglu)
        b1 = None if b1 is None else _pad_last(b1, f, fp, swiglu)
        w2, b2 = F.pad(w2, (0, dp - d, 0, fp - f)), None if b2 is None else F.pad(b2, (0, dp - d))
    h = _grouped(x.contiguous(), w1.contiguous(), offs, b1, expert_of_row)
    if fp != f:  # (the mask is drawn on [N, f], as the reference draws it)
        h = torch.cat([h[:, :f], h[:, fp:fp + f]], 1) if swiglu else h[:, :f]
    a = _activate(h, activation)
    if dropout_p > 0:
        mask = torch.rand_like(a) >= dropout_p
        a = a * mask / (1 - dropout_p)
    if fp != f:
        a = F.pad(a, (0, fp - f))
    y = _grouped(a.contiguous(), w2.contiguous(), offs, b2, expert_of_row)
    return y[:, :d] if dp != d else y


def moe_mlp(x, token_index, weights, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0, rows_per_token=None):
    """sum_n weights[n] * expert(x[token_index[n]]) (see reference.moe_mlp; rows_per_token: none needed here)."""
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [T, d], w1: [E, d, f]"
    assert token_index.shape == weights.shape and counts.numel() == w1.shape[0], "one count per expert"
    rows = grouped_mlp(permute(x, token_index), counts, w1, b1, w2, b2, activation, dropout_p)
    return unpermute(rows, token_index, weights, x.shape[0])


def fast(device, dtype):
    """Whether PyTorch runs its grouped GEMM kernel here (CUTLASS, bf16 on compute capability 9.x/10.x: Hopper,
    Blackwell), where `auto` takes this backend; elsewhere torch's grouped_mm falls back to a loop of mm calls
    (offsets copied to the host), which the reference's hand-written backward beats in memory. On a CPU with
    AVX-512 BF16 the loop of a GEMM per expert also beat it in time, in fp32, in bf16 and under bf16 autocast
    (benchmarks/README.md, "bf16, and the kernel rule": 2026-12-04, bench_layer.py at E = 8, 32, 128)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype != torch.bfloat16 or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10) and supported(device, dtype)


def supported(device, dtype):
    """Whether grouped_mm runs the GEMMs of a forward and a backward for `dtype` on `device`, tried once per device
    (an index-less cuda is the current device) and dtype on a tiny problem."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _supported(device, dtype)


@lru_cache(maxsize=None)
def _supported(device, dtype):
    try:
        return _probe(device, dtype)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError, AssertionError, ValueError):
        return False


def _probe(device, dtype):
    """The three GEMM forms of fc1's forward and backward, called directly: no autograd graph, no saved tensor and
    no random number (it may first run inside a checkpointed forward, whose recompute would not repeat it)."""
    with torch.no_grad():
        offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
        x = torch.linspace(-1, 1, 24 * 8, device=device).view(24, 8).to(dtype)  # [N, d]
        w = torch.linspace(-1, 1, 2 * 8 * 8, device=device).view(2, 8, 8).to(dtype)  # [E, d, f]
        y = F.grouped_mm(x, w, offs=offs)  # forward: [N, f]
        gx = F.grouped_mm(y, w.transpose(1, 2), offs=offs)  # d x: [N, d]
        gw = F.grouped_mm(x.t(), y, offs=offs)  # d w: [E, d, f]
        return bool(torch.isfinite(gx).all() and torch.isfinite(gw).all() and gw.shape == w.shape)
