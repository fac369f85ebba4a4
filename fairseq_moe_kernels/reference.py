"""PyTorch references of the MoE ops: router, permute, unpermute and the grouped MLP.

Legend: T tokens, N = kept assignments (rows sorted by expert), d model dim, f ffn dim, E experts,
k choices per token.
The expert MLPs take an activation: relu, gelu or silu (act(x W1 + b1) W2 + b2), or swiglu (Shazeer 2020, the
experts of Mixtral, Qwen-MoE, OLMoE, DeepSeek): W1 is [E, d, 2f], its first f columns the gate's and its last f
the up projection's, and the expert computes (silu(x W1[:, :f]) * x W1[:, f:]) W2. Either bias may be None (no
bias: swiglu experts have none).
These are also the CPU implementation, so they are written for speed where it is cheap to:
the grouped MLP has a hand-written backward that writes each expert's weight gradient into one
preallocated [E, ...] buffer, on the CPU a large one kept across steps (grad_buffers.py). (Autograd through
per-expert slices of stacked weights would materialise a full [E, ...] gradient per slice, a cost that grows as E^2.)
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import grad_buffers, host


def count(ids, n):
    """How many of ids (a long tensor of values in [0, n)) are each value: [n] long. bincount's result without its
    read of the device (on CUDA torch.bincount reads the largest id to size its output)."""
    ids = ids.reshape(-1).long()  # (scatter_add_ takes long indices and values; bincount took int32 too)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def sort_assignments(experts, num_experts):
    """(counts [E], order [k*T]) of the choices experts[T, k], taken in assignment order.

    Assignment a = j*T + t is token t's j-th choice (every first choice before any second choice,
    the priority order of routing.route). order is the stable argsort of the experts of the
    assignments, so inside one expert the assignments keep their priority order; token = order % T.
    """
    flat = experts.t().reshape(-1)  # [k*T] in assignment order
    return count(flat, num_experts), torch.argsort(flat, stable=True)


def router(logits, top_k, score="softmax", renormalize=False):
    """Top-k routing of logits[T, E] -> (weights [T, k] fp32, experts [T, k] long, counts [E] long,
    order [k*T] long).

    Scores are fp32 whatever the logits' dtype: softmax over the experts, or an independent sigmoid
    per expert. experts: torch.topk of the scores (its order of exactly tied scores is unspecified).
    weights: the chosen scores, divided by their sum when renormalize (route() renormalises for
    k >= 2 and keeps the raw probability for k = 1). weights carry the gradient w.r.t. logits.
    """
    assert logits.dim() == 2 and 1 <= top_k <= logits.shape[1], "logits: [T, E], 1 <= k <= E"
    if score == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    elif score == "sigmoid":
        probs = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"unknown router score {score!r} (softmax or sigmoid)")
    weights, experts = probs.topk(top_k, dim=-1)  # [T, k]
    if renormalize:
        # The same clamp as route(): sigmoid scores can all be ~0.
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    counts, order = sort_assignments(experts, logits.shape[1])
    return weights, experts, counts, order


def permute(x, token_index):
    """Rows of x in expert-sorted order. x: [T, d], token_index: [N] -> [N, d]."""
    return x.index_select(0, token_index)


def unpermute(rows, token_index, weights, num_tokens):
    """Weighted sum of each token's expert outputs. rows: [N, d], weights: [N] -> [T, d].

    A token none of whose assignments was kept gets zeros (the residual passes it unchanged).
    """
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, token_index, rows * weights.to(rows.dtype).unsqueeze(1))


ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")


def act_width(w1, activation):
    """f, the width fc2 reads, of fc1 weights w1 [E, d, f] (swiglu: [E, d, 2f])."""
    f = w1.shape[-1]
    if activation != "swiglu":
        return f
    if f % 2:
        raise ValueError(f"swiglu experts' fc1 weights are [E, d, 2f] (gate, then up): got an odd width {f}")
    return f // 2


def _activate(h, activation):
    if activation == "swiglu":
        f = h.shape[-1] // 2
        return F.silu(h[..., :f]) * h[..., f:]
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
    if activation == "swiglu":  # silu(g) * u: d/dg = u * s * (1 + g * (1 - s)) with s = sigmoid(g), d/du = silu(g)
        f = h.shape[-1] // 2  # (in fp32, rounded once, as autograd's silu backward and the Triton kernel compute)
        wide = torch.promote_types(grad.dtype, torch.float32)
        g, u, grad32 = h[..., :f].to(wide), h[..., f:].to(wide), grad.to(wide)
        sig = torch.sigmoid(g)
        return torch.cat([grad32 * u * sig * (1 + g * (1 - sig)), grad32 * g * sig], -1).to(grad.dtype)
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


def _fc1_act(x, sizes, w1, b1, activation, dropout_p):
    """-> (a [N, f] what fc2 reads, saved what backward needs ([N, f]; swiglu: [N, 2f]), dropout mask or None)."""
    h = grad_buffers.rows(w1, x.shape[0], w1.shape[2], x.dtype)  # [N, f] (swiglu: [N, 2f])
    for e, s, t in _blocks(sizes):
        if b1 is None:
            torch.mm(x[s:t], w1[e], out=h[s:t])
        else:
            torch.addmm(b1[e], x[s:t], w1[e], out=h[s:t])
    # relu: keep its output (its derivative is output > 0); otherwise keep the pre-activation.
    a = F.relu(h, inplace=True) if activation == "relu" else _activate(h, activation)
    saved = a if activation == "relu" else h
    mask = None
    if dropout_p > 0:
        mask = torch.rand_like(a) >= dropout_p  # [N, f] bool
        a = a * mask / (1 - dropout_p)
    return a, saved, mask


def _fc2(a, sizes, w2, b2):
    y = a.new_empty(a.shape[0], w2.shape[2])  # [N, d]
    for e, s, t in _blocks(sizes):
        if b2 is None:
            torch.mm(a[s:t], w2[e], out=y[s:t])
        else:
            torch.addmm(b2[e], a[s:t], w2[e], out=y[s:t])
    return y


def _recompute_a(saved, mask, activation, dropout_p):
    a = saved if activation == "relu" else _activate(saved, activation)
    return a if mask is None else a * mask / (1 - dropout_p)


def _grad_buffer(like, shape, sizes):
    """An uninitialised [E, ...] gradient buffer for weight `like` (its dtype/device; grad_buffers.py: last step's
    where nothing holds it any more) with zeros for the experts that got no rows.

    Every other expert's slice is overwritten whole by its GEMM; zero-filling the whole buffer
    first would cost about 7% of a step at E=128 (measured, benchmarks/bench_layer.py --profile).
    """
    buf = grad_buffers.empty(like, shape)
    for e, n in enumerate(sizes):
        if n == 0:
            buf[e].zero_()
    return buf


def _fc2_backward(a, gy, sizes, w2, need_w2, need_b2, row_scale=None):
    """-> (gy W2^T [N, f], gw2, gb2) for gy = d loss / d fc2 output [N, d].

    row_scale [N, 1]: the fc2 output was multiplied row-wise by it; gy is the gradient before that
    scaling, so the weight gradients use gy * row_scale while the returned gy W2^T stays unscaled.
    """
    gw2 = _grad_buffer(w2, w2.shape, sizes) if need_w2 else None
    gb2 = _grad_buffer(w2, (w2.shape[0], w2.shape[2]), sizes) if need_b2 else None
    da = grad_buffers.rows(w2, a.shape[0], a.shape[1], a.dtype, shared=True)  # [N, f]
    for e, s, t in _blocks(sizes):
        g = gy[s:t] if row_scale is None else gy[s:t] * row_scale[s:t]
        if need_w2:
            torch.mm(a[s:t].t(), g, out=gw2[e])
        if need_b2:
            gb2[e] = g.sum(0)
        torch.mm(gy[s:t], w2[e].t(), out=da[s:t])
    return da, gw2, gb2


def _fc1_backward(x, saved, mask, da, sizes, w1, activation, dropout_p, need_x, need_w1, need_b1):
    """-> (d loss / d x rows [N, d], gw1, gb1) from d loss / d a, which relu overwrites (its callers are done with it:
    an [N, f] tensor fewer, whose fresh pages cost 5x the operation: 62 against 12 ms at N = 32768, f = 2048)."""
    if mask is not None:
        da = da * mask / (1 - dropout_p)
    if activation == "relu":
        dh = torch.ops.aten.threshold_backward.grad_input(da, saved, 0, grad_input=da)
    else:
        dh = _activation_grad(saved, da, activation)
    gw1 = _grad_buffer(w1, w1.shape, sizes) if need_w1 else None
    gb1 = _grad_buffer(w1, (w1.shape[0], w1.shape[2]), sizes) if need_b1 else None
    gx = torch.empty_like(x) if need_x else None
    for e, s, t in _blocks(sizes):
        if need_w1:
            torch.mm(x[s:t].t(), dh[s:t], out=gw1[e])
        if need_b1:
            gb1[e] = dh[s:t].sum(0)
        if need_x:
            torch.mm(dh[s:t], w1[e].t(), out=gx[s:t])
    return gx, gw1, gb1


def _sizes(counts, rows):
    sizes = host.sizes(counts)  # (the host's copy: read here only where routing did not read it, host.py)
    if sum(sizes) != rows:
        raise ValueError(f"counts sum to {sum(sizes)} but there are {rows} rows")
    return sizes


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, b1, w2, b2, activation, dropout_p):
        sizes = _sizes(counts, x.shape[0])
        a, saved, mask = _fc1_act(x, sizes, w1, b1, activation, dropout_p)
        y = _fc2(a, sizes, w2, b2)
        ctx.sizes, ctx.activation, ctx.dropout_p = sizes, activation, dropout_p
        ctx.save_for_backward(x, saved, w1, w2, mask)
        return y

    @staticmethod
    @once_differentiable  # the backward writes into buffers (out=): no double backward
    def backward(ctx, grad_y):
        x, saved, w1, w2, mask = ctx.saved_tensors
        need_x, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:6]
        a = _recompute_a(saved, mask, ctx.activation, ctx.dropout_p)
        da, gw2, gb2 = _fc2_backward(a, grad_y.contiguous(), ctx.sizes, w2, need_w2, need_b2)
        gx, gw1, gb1 = _fc1_backward(x, saved, mask, da, ctx.sizes, w1, ctx.activation,
                                     ctx.dropout_p, need_x, need_w1, need_b1)
        return gx, None, gw1, gb1, gw2, gb2, None, None


def _row_dots(x, y, rows=256):
    """[N, f], [N, f] -> [N]: each row's dot product, `rows` rows at a time, so that the products stay in the cache
    (the same sums, bit for bit, as (x * y).sum(1), whose [N, f] product costs 4x: 67 against 17 ms at N = 32768,
    f = 2048, one thread). A last piece of one row joins the one before: torch sums a single output apart."""
    n = x.shape[0]
    out = x.new_empty(n)
    starts = list(range(0, n, rows))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    for s, t in zip(starts, starts[1:] + [n]):
        torch.sum(x[s:t] * y[s:t], 1, out=out[s:t])
    return out


class _MoEMLP(torch.autograd.Function):
    """permute -> grouped MLP -> weighted unpermute in one op, keeping only [N, f] for backward.

    Neither the permuted input nor the expert output is saved: backward gathers the rows of x
    again, and the routing-weight gradient <g_t, y_n> is computed as <g_t W2^T, a_n> + <g_t, b2>
    from quantities the backward computes anyway.
    """

    @staticmethod
    def forward(ctx, x, token_index, weights, counts, w1, b1, w2, b2, activation, dropout_p):
        sizes = _sizes(counts, token_index.shape[0])
        rows = x.index_select(0, token_index)  # [N, d], transient
        a, saved, mask = _fc1_act(rows, sizes, w1, b1, activation, dropout_p)
        del rows
        y = _fc2(a, sizes, w2, b2)  # [N, d]
        out = x.new_zeros(x.shape)  # [T, d]
        out.index_add_(0, token_index, y.mul_(weights.to(y.dtype).unsqueeze(1)))
        ctx.sizes, ctx.activation, ctx.dropout_p = sizes, activation, dropout_p
        ctx.save_for_backward(x, token_index, weights, saved, mask, w1, w2, b2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, token_index, weights, saved, mask, w1, w2, b2 = ctx.saved_tensors
        need_x, _, need_wt, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:8]
        sizes, act, p = ctx.sizes, ctx.activation, ctx.dropout_p
        g = grad_out.index_select(0, token_index)  # [N, d]: d loss / d (weighted) row
        w = weights.to(g.dtype).unsqueeze(1)  # [N, 1]
        a = _recompute_a(saved, mask, act, p)
        da, gw2, gb2 = _fc2_backward(a, g, sizes, w2, need_w2, need_b2, row_scale=w)  # da = g W2^T
        gwt = None
        if need_wt:
            gwt = _row_dots(da, a)  # <g W2^T, a> ...
            for e, s, t in _blocks(sizes) if b2 is not None else ():
                gwt[s:t] += g[s:t] @ b2[e]  # ... + <g, b2>
            gwt = gwt.to(weights.dtype)
        da.mul_(w)
        if need_x or need_w1:
            rows = x.index_select(0, token_index)
        else:
            rows = x.new_empty(0, x.shape[1])
        grow, gw1, gb1 = _fc1_backward(rows, saved, mask, da, sizes, w1, act, p, need_x, need_w1, need_b1)
        gx = None
        if need_x:
            gx = torch.zeros_like(x).index_add_(0, token_index, grow)
        return gx, None, gwt, None, gw1, gb1, gw2, gb2, None, None


def moe_mlp(x, token_index, weights, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0, rows_per_token=None):
    """The experts of an MoE layer on its own tokens: sum_n weights[n] * expert(x[token_index[n]]).

    x: [T, d]; token_index: [N] long, rows sorted by expert (expert e owns counts[e] consecutive
    rows); weights: [N] routing weights; w1: [E, d, f] (swiglu: [E, d, 2f]), b1: [E, f] or None, w2: [E, f, d],
    b2: [E, d] or None -> [T, d] (zeros for tokens with no row). Equals unpermute(grouped_mlp(permute(x, ...)), ...).
    rows_per_token: the most rows any token has, where the caller knows a bound without reading the device (top-k:
    k); the Triton kernel sizes its per-token slots by it (else it reads the largest), this one needs none.
    """
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [T, d], w1: [E, d, f]"
    assert token_index.shape == weights.shape and counts.numel() == w1.shape[0], "one count per expert"
    check_shapes(w1, b1, w2, b2, activation)
    return _MoEMLP.apply(x, token_index, weights, counts, w1, b1, w2, b2, activation, float(dropout_p))


def grouped_mlp(x, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """fc2(act(fc1(x))) with one weight set per contiguous block of rows.

    x: [N, d] rows sorted by expert; counts: [E] long, rows per expert (sums to N);
    w1: [E, d, f] (swiglu: [E, d, 2f]), b1: [E, f] or None, w2: [E, f, d], b2: [E, d] or None -> [N, d].
    dropout_p: activation dropout between the two GEMMs (pass 0 at eval).
    """
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [N, d], w1: [E, d, f]"
    assert counts.numel() == w1.shape[0] == w2.shape[0], "one count per expert"
    check_shapes(w1, b1, w2, b2, activation)
    return _GroupedMLP.apply(x, counts, w1, b1, w2, b2, activation, float(dropout_p))


def check_shapes(w1, b1, w2, b2, activation):
    """The expert weights' shapes against each other and the activation (ValueError naming the mismatch)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r} (one of {', '.join(ACTIVATIONS)})")
    E, d, f = w1.shape[0], w1.shape[1], act_width(w1, activation)
    expected = {"w2": (w2, (E, f, d)), "b1": (b1, (E, w1.shape[2])), "b2": (b2, (E, d))}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"expert weights: {name} is {tuple(t.shape)}, expected {shape} beside w1 "
                             f"{tuple(w1.shape)} ({activation})")
