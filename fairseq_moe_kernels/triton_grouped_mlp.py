"""Triton grouped MLP: fc1 -> activation (-> dropout) -> fc2 with one weight set per expert block.

Legend: T tokens, N rows (kept assignments, sorted by expert), d model dim, f ffn dim, E experts,
k rows per token (k_max: the most any token has). Same signatures and semantics as
fairseq_moe_kernels/reference.py, which holds the ground truth and the derivation of every gradient.

moe_mlp fuses the permute and the unpermute into the GEMMs: fc1 reads the rows x[token_index[n]]
straight from x (no [N, d] permuted copy), and fc2 writes each row's weighted output straight to a
slot of its token, [T, k_max, d], summed over the slots afterwards. A slot buffer rather than float
atomics keeps the result deterministic (bitwise the same on every run) at the cost of T*k_max*d
zero-filled floats. Backward does the same in reverse: grad_out rows are gathered inside the
first GEMM, the x gradient is scattered to slots by the last one, the weight gradients gather x.

Two kernels do all the work:
  _rows_gemm     Y[dst(n)] = epilogue(X[src(n)] @ W[e(n)]) for one block of rows of one expert e(n)
  _experts_gemm  G[e] = A[src(rows of e)]^T @ B[src(rows of e)]: weight gradients, reduced over rows
As in the reference, only the [N, f] activation input (and the dropout mask) is kept for backward.
swiglu (GLU): W1 is [E, d, 2f], the gate's columns then the up projection's; a block of fc1 computes both halves of
its columns (two accumulators) and keeps both pre-activations ([N, 2f]); fc2's backward writes both halves of dh.
Either bias may be None (swiglu experts have none).
"""
import triton
import triton.language as tl
import torch
from torch.autograd.function import once_differentiable

from . import host
from .reference import act_width, check_shapes, count

_ACT = {"relu": 0, "gelu": 1, "silu": 2, "swiglu": 2}  # (swiglu: silu(gate) * up, GLU=True)
# tl.dot with an fp32 accumulator: fp64 compiles in the interpreter but not for a GPU.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TUNE = not triton.knobs.runtime.interpret  # the interpreter must not autotune: fixed blocks there
_BLOCK_M = 64 if _TUNE else 16  # rows per block: fixed, since the block -> expert table depends on it
_FIXED = dict(BLOCK_N=16, BLOCK_K=16)  # interpreter: small tiles, so tiny test shapes still span several
_FIXED_E = dict(BLOCK_I=16, BLOCK_J=16, BLOCK_R=16)


@triton.jit
def _act(h, ACT: tl.constexpr):
    if ACT == 0:
        return tl.maximum(h, 0.0)
    elif ACT == 1:  # exact gelu, as F.gelu: h * Phi(h)
        return 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    else:
        return h * tl.sigmoid(h)


@triton.jit
def _act_grad(s, g, ACT: tl.constexpr):
    """g * act'(h), from s = what forward saved: the relu output for relu, h otherwise."""
    if ACT == 0:
        return tl.where(s > 0, g, 0.0)
    elif ACT == 1:  # Phi(h) + h * phi(h)
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        return g * (cdf + s * 0.3989422804014327 * tl.exp(-0.5 * s * s))
    else:
        sg = tl.sigmoid(s)
        return g * sg * (1.0 + s * (1.0 - sg))


@triton.jit
def _rows_gemm(
    X, src, stride_xm, stride_xk,  # X: [rows, K]; row n reads X[src[n]] if GATHER else X[n]
    W, stride_we, stride_wk, stride_wn,  # W: [E, K, C] by strides, so W^T of a stored weight is a view
    bias, stride_be,  # [E, C] added (HAS_BIAS); EPILOGUE 2: [E, K], dotted with the rows (WEIGHT_GRAD)
    scale,  # [N] per-row factor (the routing weights)
    Y, dst, stride_ym,  # Y: [rows, C]; row n writes Y[dst[n]] if SCATTER else Y[n]
    saved, mask, a_out, part, stride_pm,  # [N, f] activation tensors (C == f), part: [N, f / BLOCK_N]
    stride_sm,  # saved's row stride: f, or 2f with GLU (the gate's f columns, then the up's)
    block_expert, block_start, block_end,  # [num_blocks]: each block's expert and rows [start, end)
    K, C, keep,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, DROPOUT: tl.constexpr, STORE_A: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, B2_DOT: tl.constexpr, GLU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """EPILOGUE 0: Y = (acc + bias) * scale.  (fc2 forward; x gradient of fc1)
    EPILOGUE 1: acc = h = fc1 output: Y = saved (relu(h) for relu, else h), a_out = dropout(act(h)).
    EPILOGUE 2: acc = g W2^T: part = <acc, a> (+ <g, b2> in column block 0, B2_DOT), Y = dh, the gradient
    of h = act'(h) * dropout(acc * scale); a_out = a, recomputed from saved and mask.
    GLU (swiglu): in EPILOGUE 1 W's columns C + j are the up projection's (a second accumulator), a = silu(gate) *
    up, Y = saved gets both halves; in EPILOGUE 2 saved's two halves give a and Y = dh gets both halves."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    rows = tl.load(block_start + pid_m) + tl.arange(0, BLOCK_M)  # [BM] sorted row ids
    row_ok = rows < tl.load(block_end + pid_m)
    rows = rows.to(tl.int64)
    if GATHER:
        x_rows = tl.load(src + rows, mask=row_ok, other=0).to(tl.int64)  # [BM] token ids (int32 ones too)
    else:
        x_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < C
    # Offsets in int64 throughout: on a GPU an int32 index times a stride wraps silently past 2**31
    # (N * f is 4.3e9 at T=64K, k=8, f=8K), and the stride of a column-major x is its row count.
    cols = cols.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    ks64 = ks.to(tl.int64)
    x_ptrs = X + x_rows[:, None] * stride_xm + ks64[None, :] * stride_xk  # [BM, BK]
    w_ptrs = W + e * stride_we + ks64[:, None] * stride_wk + cols[None, :] * stride_wn  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU in EPILOGUE 1: the up projection's columns
    g_b2 = tl.zeros((BLOCK_M,), dtype=tl.float32)  # <g, b2> per row, accumulated along K = d
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if GLU and EPILOGUE == 1:
            wu = tl.load(w_ptrs + C * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
        if B2_DOT:
            bt = tl.load(bias + e * stride_be + k0 + ks, mask=k_ok, other=0.0)
            g_b2 += tl.sum(xt.to(tl.float32) * bt.to(tl.float32)[None, :], 1)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    ok = row_ok[:, None] & col_ok[None, :]
    f_off = rows[:, None] * C + cols[None, :]  # [BM, BN] into the contiguous [N, f] tensors
    if HAS_BIAS:
        acc += tl.load(bias + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        s_row = tl.load(scale + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]  # [BM, 1]
    if DROPOUT:
        kept = tl.load(mask + f_off, mask=ok, other=0) != 0
    if EPILOGUE == 1:
        a = _act(acc, ACT)
        out = acc  # what backward needs: h, or for relu its output (its derivative is output > 0)
        if GLU:  # a = silu(gate) * up; both pre-activations kept (the up half stored below)
            if HAS_BIAS:  # (the up half's bias: columns C + j of b1)
                acc_u += tl.load(bias + e * stride_be + C + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            a = a * acc_u
        if ACT == 0:
            out = a
        if DROPOUT:
            a = tl.where(kept, a / keep, 0.0)
        if STORE_A:
            tl.store(a_out + f_off, a.to(a_out.dtype.element_ty), mask=ok)
    elif EPILOGUE == 2:
        s_off = rows[:, None] * stride_sm + cols[None, :]  # (f_off, or the gate half of a GLU's [N, 2f])
        s = tl.load(saved + s_off, mask=ok, other=0.0).to(tl.float32)
        a = _act(s, ACT)  # relu(relu output) is itself; padding: act(0) = 0 adds nothing below
        if GLU:
            su = tl.load(saved + s_off + C, mask=ok, other=0.0).to(tl.float32)
            a = a * su
        if DROPOUT:
            a = tl.where(kept, a / keep, 0.0)
        if STORE_A:
            tl.store(a_out + f_off, a.to(a_out.dtype.element_ty), mask=ok)
        if WEIGHT_GRAD:  # d out / d weight_n = <g W2^T, a> + <g, b2>, summed over column blocks later
            partial = tl.sum(acc * a, 1) + tl.where(pid_n == 0, g_b2, 0.0)
            tl.store(part + rows * stride_pm + pid_n, partial, mask=row_ok)
        if HAS_SCALE:
            acc = acc * s_row
        if DROPOUT:
            acc = tl.where(kept, acc / keep, 0.0)
        if GLU:  # d/d gate = da * up * silu'(gate), d/d up = da * silu(gate) (stored below)
            out = _act_grad(s, acc * su, ACT)
            acc_u = acc * _act(s, ACT)
        else:
            out = _act_grad(s, acc, ACT)
    else:
        out = acc
        if HAS_SCALE:
            out = acc * s_row
    if SCATTER:
        y_rows = tl.load(dst + rows, mask=row_ok, other=0).to(tl.int64)  # [BM] slot ids
    else:
        y_rows = rows
    tl.store(Y + y_rows[:, None] * stride_ym + cols[None, :], out.to(Y.dtype.element_ty), mask=ok)
    if GLU and EPILOGUE != 0:  # the up half: its pre-activation (1), its gradient (2)
        tl.store(Y + y_rows[:, None] * stride_ym + C + cols[None, :], acc_u.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _experts_gemm(
    A, a_src, stride_am, stride_ai,  # A: [rows, I]; row n reads A[a_src[n]] if GATHER_A else A[n]
    B, b_src, stride_bm, stride_bj,  # B: [rows, J]; row n reads B[b_src[n]] * scale[n]
    scale, G, GB, starts, ends, I, J,  # G: [E, I, J] and GB: [E, J] contiguous; expert e owns rows [starts[e], ends[e])
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, HAS_SCALE: tl.constexpr, BIAS_GRAD: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """G[e] = A_e^T B_e and GB[e] = column sums of B_e: one weight gradient tile per program.
    An expert without rows runs no iteration and writes zeros, so G needs no zero-filling."""
    e = tl.program_id(0)
    pid_i = tl.program_id(1)
    pid_j = tl.program_id(2)
    start = tl.load(starts + e)
    end = tl.load(ends + e)
    ii = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = ii < I
    j_ok = jj < J
    ii, jj = ii.to(tl.int64), jj.to(tl.int64)  # int64 offsets, as in _rows_gemm
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    col_sum = tl.zeros((BLOCK_J,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < end
        rows = rows.to(tl.int64)
        if GATHER_A:
            a_rows = tl.load(a_src + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            a_rows = rows
        if GATHER_B:
            b_rows = tl.load(b_src + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            b_rows = rows
        at = tl.load(A + a_rows[:, None] * stride_am + ii[None, :] * stride_ai,
                     mask=r_ok[:, None] & i_ok[None, :], other=0.0)  # [BR, BI]
        bt = tl.load(B + b_rows[:, None] * stride_bm + jj[None, :] * stride_bj,
                     mask=r_ok[:, None] & j_ok[None, :], other=0.0)  # [BR, BJ]
        if HAS_SCALE:  # scaled in fp32, rounded to the input dtype like the reference's g * w
            w = tl.load(scale + rows, mask=r_ok, other=0.0).to(tl.float32)
            bt = (bt.to(tl.float32) * w[:, None]).to(B.dtype.element_ty)
        acc = tl.dot(tl.trans(at), bt, acc, input_precision=PRECISION)  # [BI, BJ]
        if BIAS_GRAD:
            col_sum += tl.sum(bt.to(tl.float32), 0)
    e64 = e.to(tl.int64)
    tl.store(G + e64 * I * J + ii[:, None] * J + jj[None, :], acc.to(G.dtype.element_ty),
             mask=i_ok[:, None] & j_ok[None, :])
    if BIAS_GRAD:
        if pid_i == 0:  # the row tiles of I all have the same column sums: one of them stores them
            tl.store(GB + e64 * J + jj, col_sum.to(GB.dtype.element_ty), mask=j_ok)


def _rows_configs():
    return [triton.Config(dict(BLOCK_N=n, BLOCK_K=k), num_warps=w, num_stages=s)
            for n, k, w, s in [(64, 32, 4, 4), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (256, 32, 8, 3)]]


def _experts_configs():
    return [triton.Config(dict(BLOCK_I=i, BLOCK_J=j, BLOCK_R=r), num_warps=w, num_stages=s)
            for i, j, r, w, s in [(64, 64, 32, 4, 4), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3),
                                  (128, 128, 32, 8, 3), (128, 128, 64, 8, 3)]]


if _TUNE:  # a mode is a different kernel: tune each separately (the autotuner adds the dtypes)
    _rows_kernel = triton.autotune(_rows_configs(), key=["K", "C", "EPILOGUE", "GATHER", "SCATTER", "GLU"])(_rows_gemm)
    _experts_kernel = triton.autotune(_experts_configs(), key=["I", "J", "GATHER_A", "GATHER_B"])(_experts_gemm)
    _MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in _rows_configs())
else:
    _rows_kernel, _experts_kernel, _MIN_BLOCK_N = _rows_gemm, _experts_gemm, _FIXED["BLOCK_N"]


class _Plan:
    """Where the rows of each expert are: the block table of _rows_gemm, the ranges of _experts_gemm."""

    def __init__(self, counts, num_rows, device):
        sizes = host.sizes(counts)  # (the host's copy, as in the reference: read once per counts, host.py)
        if sum(sizes) != num_rows:
            raise ValueError(f"counts sum to {sum(sizes)} but there are {num_rows} rows")
        counts = counts.to(device=device, dtype=torch.int64)
        ends = torch.cumsum(counts, 0)
        starts = ends - counts  # [E]
        per_expert = (counts + _BLOCK_M - 1) // _BLOCK_M  # [E] blocks; none for an empty expert
        self.num_blocks = sum((n + _BLOCK_M - 1) // _BLOCK_M for n in sizes)
        expert = torch.repeat_interleave(torch.arange(len(sizes), device=device), per_expert,
                                         output_size=self.num_blocks)  # [num_blocks]
        nth = torch.arange(self.num_blocks, device=device) - (torch.cumsum(per_expert, 0) - per_expert)[expert]
        block_start = starts[expert] + nth * _BLOCK_M
        self.table = (expert.int(), block_start.int(), torch.minimum(block_start + _BLOCK_M, ends[expert]).int())
        self.starts, self.ends = starts.int(), ends.int()
        self.rows = num_rows


def _token_slots(token_index, num_tokens, bound=None):
    """slot[n] = token_index[n] * k_max + (rank of row n among its token's rows), and k_max: bound (the caller's,
    known on the host: no read) or the largest count of rows of a token (read from the device)."""
    per_token = count(token_index, num_tokens)  # [T] (bincount's, without its read of the device)
    if bound is not None and bound < 1:
        raise ValueError(f"rows_per_token must be >= 1, got {bound}")
    if bound is None:
        k_max = int(per_token.max()) if token_index.numel() else 0
    else:
        k_max = bound
        if token_index.numel():  # (on the device, without a wait: a token with more rows would overrun its slots)
            torch._assert_async(per_token.max() <= bound, f"a token has more than rows_per_token {bound} rows")
    order = torch.argsort(token_index, stable=True)  # [N]: rows grouped by token
    first = torch.cumsum(per_token, 0) - per_token  # [T]
    rank = torch.empty_like(token_index)
    rank[order] = torch.arange(order.numel(), device=order.device) - first[token_index[order]]
    return token_index * k_max + rank, k_max


def _slot_buffer(like, num_tokens, k_max):
    return like.new_zeros(num_tokens * max(k_max, 1), like.shape[1])  # [T * k_max, d]


def _sum_slots(buf, num_tokens, k_max):
    return buf if k_max <= 1 else buf.view(num_tokens, k_max, -1).sum(1)  # [T, d]


def _precision(t):
    return "ieee" if t.dtype == torch.float32 else "tf32"  # fp32 stays fp32 on GPUs; 16-bit ignores it


def _rows(plan, X, src, W, w_strides, Y, dst, K, C, *, bias=None, scale=None, epilogue=0, act=0,
          saved=None, mask=None, keep=1.0, a_out=None, part=None, weight_grad=False, glu=False):
    """Launch _rows_gemm; returns the BLOCK_N it ran with (the width of part that was written)."""
    if plan.num_blocks == 0:
        return _MIN_BLOCK_N
    grid = lambda meta: (plan.num_blocks, triton.cdiv(C, meta["BLOCK_N"]))  # noqa: E731
    _rows_kernel[grid](
        X, src, X.stride(0), X.stride(1), W, *w_strides, bias, 0 if bias is None else bias.stride(0),
        scale, Y, dst, Y.stride(0), saved, None if mask is None else mask.view(torch.uint8), a_out, part,
        0 if part is None else part.stride(0), C if saved is None else saved.stride(0), *plan.table, K, C, keep,
        GATHER=src is not None, SCATTER=dst is not None, HAS_BIAS=bias is not None and epilogue != 2,
        HAS_SCALE=scale is not None, EPILOGUE=epilogue, ACT=act, DROPOUT=mask is not None,
        STORE_A=a_out is not None, WEIGHT_GRAD=weight_grad, B2_DOT=weight_grad and bias is not None, GLU=glu,
        PRECISION=_precision(X), BLOCK_M=_BLOCK_M,
        **({} if _TUNE else _FIXED))
    return _rows_kernel.best_config.kwargs["BLOCK_N"] if _TUNE else _FIXED["BLOCK_N"]


def _experts(plan, A, a_src, B, b_src, scale, G, GB):
    E, I, J = G.shape
    grid = lambda meta: (E, triton.cdiv(I, meta["BLOCK_I"]), triton.cdiv(J, meta["BLOCK_J"]))  # noqa: E731
    _experts_kernel[grid](
        A, a_src, A.stride(0), A.stride(1), B, b_src, B.stride(0), B.stride(1), scale, G, GB,
        plan.starts, plan.ends, I, J, GATHER_A=a_src is not None, GATHER_B=b_src is not None,
        HAS_SCALE=scale is not None, BIAS_GRAD=GB is not None, PRECISION=_precision(A),
        **({} if _TUNE else _FIXED_E))


def _forward(plan, x, src, scale, out, dst, w1, b1, w2, b2, activation, p):
    """fc1 (+ gather) -> act -> dropout -> fc2 (* scale, + scatter) into out; -> (saved, mask)."""
    N, d, f, glu = plan.rows, w1.shape[1], act_width(w1, activation), activation == "swiglu"
    act = _ACT[activation]
    saved = x.new_empty(N, w1.shape[2])  # [N, f] (GLU: [N, 2f]): kept for backward
    mask = torch.rand((N, f), dtype=x.dtype, device=x.device) >= p if p > 0 else None  # [N, f] bool, drawn as the
    # reference draws it (rand_like of its [N, f] activation)
    a = x.new_empty(N, f) if (mask is not None or act != 0) else None  # transient fc2 input
    _rows(plan, x, src, w1, w1.stride(), saved, None, d, f, bias=_contiguous(b1), epilogue=1, act=act,
          mask=mask, keep=1.0 - p, a_out=a, glu=glu)
    _rows(plan, saved if a is None else a, None, w2, w2.stride(), out, dst, f, d, bias=_contiguous(b2),
          scale=scale)
    return saved, mask


def _contiguous(t):
    return None if t is None else t.contiguous()


def _backward(plan, grad, src, scale, gx, dst, x, saved, mask, w1, w2, b2, activation, p, needs):
    """Gradients of the MLP; grad holds d loss / d output rows (at src[n] if src is given).

    -> (gx filled in when asked, gwt, gw1, gb1, gw2, gb2); gwt only when scale is the routing weights."""
    need_x, need_wt, need_w1, need_b1, need_w2, need_b2 = needs
    N, d, f, glu = plan.rows, w1.shape[1], act_width(w1, activation), activation == "swiglu"
    act = _ACT[activation]
    dh = saved.new_empty(N, w1.shape[2])  # [N, f] (GLU: [N, 2f]) d loss / d h
    a = saved.new_empty(N, f) if (need_w2 or need_b2) and (mask is not None or act != 0) else None
    part = torch.empty(N, triton.cdiv(f, _MIN_BLOCK_N), device=saved.device, dtype=torch.float32) if need_wt else None
    block_n = _rows(plan, grad, src, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), dh, None, d, f,
                    bias=_contiguous(b2) if need_wt else None, scale=scale, epilogue=2, act=act,
                    saved=saved, mask=mask, keep=1.0 - p, a_out=a, part=part, weight_grad=need_wt, glu=glu)
    gwt = part[:, :triton.cdiv(f, block_n)].sum(1) if need_wt else None  # [N]
    gw1 = gb1 = gw2 = gb2 = None
    if need_w2 or need_b2:
        gw2, gb2 = w2.new_empty(w2.shape), w2.new_empty(w2.shape[0], d) if need_b2 else None
        _experts(plan, saved if a is None else a, None, grad, src, scale, gw2, gb2)
    if need_w1 or need_b1:
        gw1, gb1 = w1.new_empty(w1.shape), w1.new_empty(w1.shape[0], w1.shape[2]) if need_b1 else None
        _experts(plan, x, src, dh, None, None, gw1, gb1)
    if need_x:
        _rows(plan, dh, None, w1, (w1.stride(0), w1.stride(2), w1.stride(1)), gx, dst, w1.shape[2], d)
    return gwt, gw1, gb1 if need_b1 else None, gw2 if need_w2 else None, gb2


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, b1, w2, b2, activation, dropout_p):
        plan = _Plan(counts, x.shape[0], x.device)
        y = x.new_empty(x.shape)  # [N, d]
        saved, mask = _forward(plan, x, None, None, y, None, w1, b1, w2, b2, activation, dropout_p)
        ctx.plan, ctx.activation, ctx.dropout_p = plan, activation, dropout_p
        ctx.save_for_backward(x, saved, mask, w1, w2, b2)
        return y

    @staticmethod
    @once_differentiable  # the kernels compute the gradient: no graph for a double backward
    def backward(ctx, grad_y):
        x, saved, mask, w1, w2, b2 = ctx.saved_tensors
        need_x, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:6]
        gx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
        _, gw1, gb1, gw2, gb2 = _backward(ctx.plan, grad_y, None, None, gx, None, x, saved, mask, w1, w2, b2,
                                          ctx.activation, ctx.dropout_p,
                                          (need_x, False, need_w1, need_b1, need_w2, need_b2))
        return gx, None, gw1, gb1, gw2, gb2, None, None


class _MoEMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_index, weights, counts, w1, b1, w2, b2, activation, dropout_p, rows_per_token):
        T = x.shape[0]
        plan = _Plan(counts, token_index.shape[0], x.device)
        slot, k_max = _token_slots(token_index, T, rows_per_token)
        buf = _slot_buffer(x, T, k_max)  # [T * k_max, d]
        saved, mask = _forward(plan, x, token_index, weights, buf, slot, w1, b1, w2, b2, activation, dropout_p)
        ctx.plan, ctx.k_max, ctx.activation, ctx.dropout_p = plan, k_max, activation, dropout_p
        ctx.save_for_backward(x, token_index, weights, slot, saved, mask, w1, w2, b2)
        return _sum_slots(buf, T, k_max)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, token_index, weights, slot, saved, mask, w1, w2, b2 = ctx.saved_tensors
        need_x, _, need_wt, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:8]
        T, k_max = x.shape[0], ctx.k_max
        gbuf = _slot_buffer(x, T, k_max) if need_x else None
        gwt, gw1, gb1, gw2, gb2 = _backward(ctx.plan, grad_out, token_index, weights, gbuf, slot, x, saved,
                                            mask, w1, w2, b2, ctx.activation, ctx.dropout_p,
                                            (need_x, need_wt, need_w1, need_b1, need_w2, need_b2))
        gx = _sum_slots(gbuf, T, k_max) if need_x else None
        gwt = gwt.to(weights.dtype) if need_wt else None
        return gx, None, gwt, None, gw1, gb1, gw2, gb2, None, None, None


def _check(x, w1, w2, activation, b1=None, b2=None):
    check_shapes(w1, b1, w2, b2, activation)
    assert x.dtype == w1.dtype == w2.dtype, "x and the expert weights share one dtype"
    if x.dtype not in _DTYPES:
        raise TypeError(f"the Triton MLP takes fp16, bf16 or fp32, not {x.dtype}: use the torch backend")
    if activation not in _ACT:
        raise ValueError(f"unknown activation {activation!r}")


def moe_mlp(x, token_index, weights, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0, rows_per_token=None):
    """sum_n weights[n] * expert(x[token_index[n]]), gather and scatter fused: see reference.moe_mlp.

    x: [T, d]; token_index: [N] long, sorted by expert; weights: [N]; counts: [E];
    w1: [E, d, f], b1: [E, f], w2: [E, f, d], b2: [E, d] -> [T, d] (zeros for tokens with no row).
    rows_per_token: a bound on any token's rows known on the host (top-k: k) sizes the per-token slots; None: the
    largest is read from the device (a wait on a GPU). A bound below the largest fails the device's own assert
    (torch._assert_async: checked without a wait).
    """
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [T, d], w1: [E, d, f]"
    assert token_index.shape == weights.shape and counts.numel() == w1.shape[0], "one count per expert"
    _check(x, w1, w2, activation, b1, b2)
    # The kernels read token_index and weights at unit stride: a strided view would be misread.
    return _MoEMLP.apply(x, token_index.contiguous(), weights.contiguous(), counts, w1, b1, w2, b2, activation,
                         float(dropout_p), rows_per_token)


def grouped_mlp(x, counts, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """fc2(act(fc1(x))) with one weight set per contiguous block of rows: see reference.grouped_mlp.

    x: [N, d] rows sorted by expert; counts: [E]; w1: [E, d, f], b1: [E, f], w2: [E, f, d],
    b2: [E, d] -> [N, d]. dropout_p: activation dropout between the two GEMMs.
    """
    assert x.dim() == 2 and w1.dim() == 3 and w1.shape[1] == x.shape[1], "x: [N, d], w1: [E, d, f]"
    assert counts.numel() == w1.shape[0] == w2.shape[0], "one count per expert"
    _check(x, w1, w2, activation, b1, b2)
    return _GroupedMLP.apply(x, counts, w1, b1, w2, b2, activation, float(dropout_p))
