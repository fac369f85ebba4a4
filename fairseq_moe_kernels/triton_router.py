"""Triton router: logits -> fp32 scores -> top-k -> weights, per-expert counts and the expert-sorted
order of the assignments. Same signature and results as reference.router.

Legend: T tokens, E experts, k choices per token, B blocks of BLOCK_T tokens. Assignment a = j*T + t
is token t's j-th choice; order lists the assignments sorted by expert, priority order kept inside one.

Forward, three launches and no global sort:
  1. _topk_kernel, one program per token block: scores, top-k, weights, and the block's histogram of
     its j-th choices, hist[j, b, e] (k*B*E small integers).
  2. torch cumsum over the flattened (j, b) axis of hist: the first slot in `order` of block b's
     j-th choices of expert e. (j, b) ascending is assignment order, so the sort comes out stable.
  3. _order_kernel, one program per (block, j): slot = that offset + the number of earlier tokens
     of the block whose j-th choice is the same expert.
Backward (weights -> logits) recomputes the scores from the logits instead of saving [T, E].

Top-k takes the largest logits, lowest expert id first among exact ties. Scores are monotone in
the logits, so this is a top-k of the scores; torch.topk's order of exactly tied scores is
unspecified (it differs between CPU and CUDA), so only then may the experts differ from the reference.
"""
import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


@triton.jit
def _load_scores(logits_ptr, stride_t, T, E, pid, SIGMOID: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """-> (t [BLOCK_T], e [BLOCK_E], x [BLOCK_T, BLOCK_E] fp32 logits, -inf in padding, scores)."""
    t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * E can pass 2**31
    e = tl.arange(0, BLOCK_E)
    mask = (t < T)[:, None] & (e < E)[None, :]
    # Tokens past T read 0 (not -inf): their softmax stays finite, and nothing of them is stored.
    x = tl.load(logits_ptr + t[:, None] * stride_t + e[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where((e < E)[None, :], x, float("-inf"))
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-x))  # padding: exp(inf) = inf -> 0
    else:
        z = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = z / tl.sum(z, axis=1)[:, None]
    return t, e, x, p


@triton.jit
def _topk_kernel(logits_ptr, weights_ptr, experts_ptr, hist_ptr, stride_t, T, E, B,
                 K: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr, EPS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    t, e, x, p = _load_scores(logits_ptr, stride_t, T, E, pid, SIGMOID, BLOCK_T, BLOCK_E)
    valid = t < T
    kk = tl.arange(0, BLOCK_K)
    avail = (e < E)[None, :] & (t >= 0)[:, None]  # [BLOCK_T, BLOCK_E] not yet chosen (t >= 0: broadcast)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_e = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        keys = tl.where(avail, x, float("-inf"))
        best = tl.max(keys, axis=1)
        idx = tl.min(tl.where(avail & (keys == best[:, None]), e[None, :], BLOCK_E), axis=1)
        # NaN logits match nothing: take the first available expert so ids stay in range.
        idx = tl.where(idx == BLOCK_E, tl.min(tl.where(avail, e[None, :], BLOCK_E), axis=1), idx)
        hit = e[None, :] == idx[:, None]  # [BLOCK_T, BLOCK_E] one-hot of the j-th choice
        w = tl.sum(tl.where(hit, p, 0.0), axis=1)
        avail = avail & ~hit
        total += w
        top_w = tl.where(kk[None, :] == j, w[:, None], top_w)
        top_e = tl.where(kk[None, :] == j, idx[:, None], top_e)
        counts = tl.sum((hit & valid[:, None]).to(tl.int32), axis=0)  # [BLOCK_E]
        tl.store(hist_ptr + (j * B + pid) * E + e, counts, mask=e < E)
    if RENORM:
        top_w = top_w / tl.maximum(total, EPS)[:, None]
    out = t[:, None] * K + kk[None, :]
    mask = valid[:, None] & (kk < K)[None, :]
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(experts_ptr + out, top_e.to(tl.int64), mask=mask)


@triton.jit
def _order_kernel(experts_ptr, offsets_ptr, order_ptr, T, E, B, K: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.program_id(1)
    i = tl.arange(0, BLOCK_T)
    t = (pid * BLOCK_T + i).to(tl.int64)  # int64 offsets, as in the other kernels
    valid = t < T
    ex = tl.load(experts_ptr + t * K + j, mask=valid, other=-1)  # [BLOCK_T]
    # Rank among the block's earlier tokens with the same j-th choice: [BLOCK_T, BLOCK_T] compare.
    same = (ex[:, None] == ex[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same.to(tl.int64), axis=1)
    base = tl.load(offsets_ptr + (j * B + pid) * E + ex, mask=valid, other=0)
    tl.store(order_ptr + base + rank, j.to(tl.int64) * T + t, mask=valid)


@triton.jit
def _backward_kernel(logits_ptr, experts_ptr, grad_w_ptr, grad_logits_ptr, stride_t, T, E,
                     K: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr, EPS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    t, e, x, p = _load_scores(logits_ptr, stride_t, T, E, pid, SIGMOID, BLOCK_T, BLOCK_E)
    valid = t < T
    # weights = top / D with D = max(sum top, EPS): d/d top_j = g_j / D - [sum >= EPS] <g, top> / D^2.
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        ex = tl.load(experts_ptr + t * K + j, mask=valid, other=0)
        g = tl.load(grad_w_ptr + t * K + j, mask=valid, other=0.0)
        top = tl.sum(tl.where(e[None, :] == ex[:, None], p, 0.0), axis=1)
        total += top
        dot += g * top
    scale = tl.full([BLOCK_T], 1.0, tl.float32)
    shift = tl.zeros([BLOCK_T], dtype=tl.float32)
    if RENORM:
        denom = tl.maximum(total, EPS)
        scale = 1.0 / denom
        shift = tl.where(total >= EPS, dot / (denom * denom), 0.0)
    gp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)  # d loss / d scores
    for j in tl.static_range(K):
        ex = tl.load(experts_ptr + t * K + j, mask=valid, other=0)
        g = tl.load(grad_w_ptr + t * K + j, mask=valid, other=0.0)
        gp += tl.where(e[None, :] == ex[:, None], (g * scale - shift)[:, None], 0.0)
    if SIGMOID:
        gl = gp * p * (1.0 - p)
    else:
        gl = p * (gp - tl.sum(gp * p, axis=1)[:, None])
    mask = valid[:, None] & (e < E)[None, :]
    out = grad_logits_ptr + t[:, None] * E + e[None, :]
    tl.store(out, gl.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def block_t(num_experts):
    """Tokens per program: about 4K score elements, at least 16 tokens (the order kernel's
    compare is BLOCK_T x BLOCK_T)."""
    return max(16, min(64, 4096 // triton.next_power_of_2(num_experts)))


def num_warps(num_experts):
    """Warps of the top-k and backward programs: 8 once E pads to 128 or more. With 4, the k = 8 choices
    over a [32, 128] tile need 255 registers and spill (ptxas, sm_90); 8 warps halve the tile per thread."""
    return 8 if num_experts > 64 else 4


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, sigmoid, renormalize):
        T, E = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        dev, BT, BE = logits.device, block_t(E), triton.next_power_of_2(E)
        B = triton.cdiv(T, BT)
        eps = torch.finfo(torch.float32).eps
        weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
        experts = torch.empty(T, top_k, dtype=torch.long, device=dev)
        hist = torch.empty(top_k, B, E, dtype=torch.int32, device=dev)
        order = torch.empty(top_k * T, dtype=torch.long, device=dev)
        if T:
            _topk_kernel[(B,)](logits, weights, experts, hist, logits.stride(0), T, E, B, top_k,
                               sigmoid, renormalize, eps, BT, BE, triton.next_power_of_2(top_k),
                               num_warps=num_warps(E))
        flat = hist.view(top_k * B, E).long()  # [(j, b), E] in assignment order
        counts = flat.sum(0)  # [E]
        before = torch.cumsum(flat, 0) - flat  # [(j, b), E] earlier blocks' rows of each expert
        offsets = (before + (torch.cumsum(counts, 0) - counts)).contiguous()
        if T:
            _order_kernel[(B, top_k)](experts, offsets, order, T, E, B, top_k, BT)
        ctx.save_for_backward(logits, experts)
        ctx.sigmoid, ctx.renormalize, ctx.eps = sigmoid, renormalize, eps
        ctx.mark_non_differentiable(experts, counts, order)
        return weights, experts, counts, order

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_weights, *_):
        logits, experts = ctx.saved_tensors
        T, E = logits.shape
        grad_logits = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
        if T:
            BT = block_t(E)
            _backward_kernel[(triton.cdiv(T, BT),)](
                logits, experts, grad_weights.float().contiguous(), grad_logits, logits.stride(0), T, E,
                experts.shape[1], ctx.sigmoid, ctx.renormalize, ctx.eps, BT, triton.next_power_of_2(E),
                num_warps=num_warps(E))
        return grad_logits, None, None, None


def router(logits, top_k, score="softmax", renormalize=False):
    """Top-k routing of logits[T, E] -> (weights [T, k] fp32, experts [T, k] long, counts [E] long,
    order [k*T] long); see reference.router. Grad flows from weights to logits."""
    assert logits.dim() == 2 and 1 <= top_k <= logits.shape[1], "logits: [T, E], 1 <= k <= E"
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown router score {score!r} (softmax or sigmoid)")
    return _Router.apply(logits, int(top_k), score == "sigmoid", bool(renormalize))
