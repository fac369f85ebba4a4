"""PyTorch references of the MoE ops: permute, unpermute and the grouped MLP.

Legend: T tokens, N = kept assignments (rows sorted by expert), d model dim, f ffn dim, E experts.
These are also the CPU implementation, so they are written for speed where it is cheap to:
the grouped MLP has a hand-written backward that writes each expert's weight gradient into one
preallocated [E, ...] buffer. (Autograd through per-expert slices of stacked weights would
materialise a full [E, ...] gradient per slice, a cost that grows as E^2.)
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def permute(x, token_index):
    """Rows of x in expert-sorted order. x: [T, d], token_index: [N] -> [N, d]."""
    return x.index_select(0, token_index)


def unpermute(rows, token_index, weights, num_tokens):
    """Weighted sum of each token's expert outputs. rows: [N, d], weights: [N] -> [T, d].

    A token none of whose assignments was kept gets zeros (the residual passes it unchanged).
    """
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, token_index, rows * weights.to(rows.dtype).unsqueeze(1))


def _activate(h, activation):
    if activation == "relu":
        return F.relu(h)
    if activation == "gelu":
        return F.gelu(h)
    if activation == "silu":
        return F.silu(h)
    raise ValueError(f"unknown activation {activation!r}")


def _activation_grad(h, grad, activation):
    """d activation(h) / dh times grad, without keeping a graph from the forward."""
    if activation == "relu":
        return grad * (h > 0).to(grad.dtype)
    with torch.enable_grad():
        h = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(_activate(h, activation), h, grad)
    return dh


def _blocks(counts):
    """(expert, first row, end row) of each non-empty block of expert-sorted rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, b1, w2, b2, activation, dropout_p):
        sizes = counts.tolist()
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"counts sum to {sum(sizes)} but x has {x.shape[0]} rows")
        h = x.new_empty(x.shape[0], w1.shape[2])  # [N, f] pre-activation, kept for backward
        for e, s, t in _blocks(sizes):
            torch.addmm(b1[e], x[s:t], w1[e], out=h[s:t])
        a = _activate(h, activation)
        mask = None
        if dropout_p > 0:
            mask = torch.rand_like(h) >= dropout_p  # [N, f] bool
            a = a * mask / (1 - dropout_p)
        y = x.new_empty(x.shape[0], w2.shape[2])  # [N, d]
        for e, s, t in _blocks(sizes):
            torch.addmm(b2[e], a[s:t], w2[e], out=y[s:t])
        ctx.sizes, ctx.activation, ctx.dropout_p = sizes, activation, dropout_p
        ctx.save_for_backward(x, h, w1, w2, mask)
        return y

    @staticmethod
    @once_differentiable  # the backward writes into buffers (out=): no double backward
    def backward(ctx, grad_y):
        x, h, w1, w2, mask = ctx.saved_tensors
        sizes, p = ctx.sizes, ctx.dropout_p
        need_x, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:6]
        grad_y = grad_y.contiguous()
        a = _activate(h, ctx.activation)
        if mask is not None:
            a = a * mask / (1 - p)
        gw1 = torch.zeros_like(w1) if need_w1 else None
        gw2 = torch.zeros_like(w2) if need_w2 else None
        gb1 = h.new_zeros(w1.shape[0], w1.shape[2]) if need_b1 else None
        gb2 = h.new_zeros(w2.shape[0], w2.shape[2]) if need_b2 else None
        da = torch.empty_like(h)  # [N, f]
        for e, s, t in _blocks(sizes):
            g = grad_y[s:t]
            if need_w2:
                torch.mm(a[s:t].t(), g, out=gw2[e])
            if need_b2:
                gb2[e] = g.sum(0)
            torch.mm(g, w2[e].t(), out=da[s:t])
        if mask is not None:
            da = da * mask / (1 - p)
        dh = _activation_grad(h, da, ctx.activation)
        gx = torch.empty_like(x) if need_x else None
        for e, s, t in _blocks(sizes):
            if need_w1:
                torch.mm(x[s:t].t(), dh[s:t], out=gw1[e])
            if need_b1:
                gb1[e] = dh[s:t].sum(0)
            if need_x:
                torch.mm(dh[s:t], w1[e].t(), out=gx[s:t])
        return gx, None, gw1, gb1, gw2, gb2, None, None


def grouped_mlp(x, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """fc2(act(fc1(x))) with one weight set per contiguous block of rows.

    x: [N, d] rows sorted by expert; counts: [E] long, rows per expert (sums to N);
    w1: [E, d, f], b1: [E, f], w2: [E, f, d], b2: [E, d] -> [N, d].
    dropout_p: activation dropout between the two GEMMs (pass 0 at eval).
    """
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [N, d], w1: [E, d, f]"
    assert counts.numel() == w1.shape[0] == w2.shape[0], "one count per expert"
    return _GroupedMLP.apply(x, counts, w1, b1, w2, b2, activation, float(dropout_p))
