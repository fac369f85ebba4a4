"""Triton permute / unpermute: tokens to expert-sorted rows and back. Same signatures and results as
reference.permute / reference.unpermute.

Legend: T tokens, N rows (kept assignments, sorted by expert), d model dim.
Two kernels, each the other's backward:
  _gather_rows: out[n] = scale[n] * src[index[n]], optionally also dot[n] = <src[index[n]], other[n]>.
      permute forward; unpermute backward (grad rows, and grad weights as the dot with the rows).
  _sum_rows:    out[t] = sum over the rows n of token t of weight[n] * rows[n].
      unpermute forward; permute backward (unit weights).
_sum_rows uses no atomics: the rows of each token are listed in CSR form (a stable argsort of the
token index and per-token offsets), and each token sums its own rows in ascending n, in fp32, so the
result is deterministic and the summation order is the reference's (index_add over n).
"""
import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .reference import count

BLOCK_N = 32  # rows (or tokens) per program
BLOCK_D = 64  # model-dim chunk; d = 72 already takes two chunks


@triton.jit
def _gather_rows(src_ptr, index_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr, N, D,
                 HAS_SCALE: tl.constexpr, WITH_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # src: [T, d], index: [N], scale: [N], other: [N, d] -> out: [N, d], dot: [N] fp32
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = n < N
    n = n.to(tl.int64)  # n * D can pass 2**31
    src_row = tl.load(index_ptr + n, mask=valid, other=0).to(tl.int64)  # an int32 index too
    if HAS_SCALE:
        scale = tl.load(scale_ptr + n, mask=valid, other=0.0).to(tl.float32)
    dot = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):  # the whole row in one program, so the dot needs no atomics
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (cols < D)[None, :]
        v = tl.load(src_ptr + src_row[:, None] * D + cols[None, :], mask=mask, other=0.0)
        if WITH_DOT:
            o = tl.load(other_ptr + n[:, None] * D + cols[None, :], mask=mask, other=0.0)
            dot += tl.sum(v.to(tl.float32) * o.to(tl.float32), axis=1)
        if HAS_SCALE:
            v = v.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + n[:, None] * D + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)
    if WITH_DOT:
        tl.store(dot_ptr + n, dot, mask=valid)


@triton.jit
def _sum_rows(rows_ptr, perm_ptr, start_ptr, weights_ptr, out_ptr, T, D, HAS_WEIGHTS: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows: [N, d], perm: [N] rows grouped by token, start: [T + 1], weights: [N] -> out: [T, d]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    valid = t < T
    t = t.to(tl.int64)  # t * D can pass 2**31
    # Everything per token is kept [BLOCK_T, 1] (2-D): Triton 3.6's layout pass (TritonGPURemoveLayout-
    # Conversions) fails to compile this loop for sm_90 when 1-D row ids feed the 2-D gather.
    lo = tl.load(start_ptr + t, mask=valid, other=0)[:, None]  # [BLOCK_T, 1] first row of each token
    hi = tl.load(start_ptr + t + 1, mask=valid, other=0)[:, None]
    col_ok = (cols < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(tl.max(hi - lo, axis=1), axis=0)):  # as many steps as the busiest token
        has = lo + j < hi
        n = tl.load(perm_ptr + lo + j, mask=has, other=0)  # [BLOCK_T, 1] its j-th row
        v = tl.load(rows_ptr + n * D + cols[None, :], mask=has & col_ok, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(weights_ptr + n, mask=has, other=0.0).to(tl.float32)
        acc += v
    tl.store(out_ptr + t[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok)


def gather_rows(src, index, scale=None, other=None):
    """-> (scale[:, None] * src[index] [N, d] in src's dtype, <src[index], other> [N] fp32 or None)."""
    N, D = index.shape[0], src.shape[1]
    out = src.new_empty(N, D)
    dot = torch.empty(N, dtype=torch.float32, device=src.device) if other is not None else None
    if N and D:
        _gather_rows[(triton.cdiv(N, BLOCK_N),)](
            src.contiguous(), index.contiguous(), scale.contiguous() if scale is not None else src,
            other.contiguous() if other is not None else src, out, dot if dot is not None else out,
            N, D, scale is not None, other is not None, BLOCK_N, BLOCK_D)
    elif dot is not None:
        dot.zero_()
    return out, dot


def sum_rows(rows, token_index, weights, num_tokens):
    """out[t] = sum of weights[n] * rows[n] over the rows n of token t (weights None: 1) -> [T, d]."""
    D = rows.shape[1]
    out = rows.new_empty(num_tokens, D)
    if not (num_tokens and D):
        return out
    # CSR lists of each token's rows, ascending n. Tokens >= T (invalid) sort last and are never read.
    perm = torch.argsort(token_index, stable=True)  # [N]
    per_token = count(token_index.clamp(max=num_tokens), num_tokens + 1)[:num_tokens]  # [T] (no device read)
    start = torch.zeros(num_tokens + 1, dtype=torch.long, device=rows.device)
    torch.cumsum(per_token, 0, out=start[1:])
    grid = (triton.cdiv(num_tokens, BLOCK_N), triton.cdiv(D, BLOCK_D))
    _sum_rows[grid](rows.contiguous(), perm, start, weights.contiguous() if weights is not None else rows,
                    out, num_tokens, D, weights is not None, BLOCK_N, BLOCK_D)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_index):
        ctx.save_for_backward(token_index)
        ctx.num_tokens = x.shape[0]
        return gather_rows(x, token_index)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        (token_index,) = ctx.saved_tensors
        return sum_rows(grad_rows, token_index, None, ctx.num_tokens), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, token_index, weights, num_tokens):
        ctx.save_for_backward(rows, token_index, weights)
        return sum_rows(rows, token_index, weights, num_tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        rows, token_index, weights = ctx.saved_tensors
        need_rows, _, need_weights, _ = ctx.needs_input_grad
        # d out[t] / d rows[n] = weights[n]; d out[t] / d weights[n] = rows[n], t = token_index[n].
        grad_rows, grad_weights = gather_rows(grad_out, token_index, weights, rows if need_weights else None)
        if grad_weights is not None:
            grad_weights = grad_weights.to(weights.dtype)
        return grad_rows.to(rows.dtype) if need_rows else None, None, grad_weights, None


def permute(x, token_index):
    """Rows of x in expert-sorted order. x: [T, d], token_index: [N] long -> [N, d]."""
    assert x.dim() == 2 and token_index.dim() == 1, "x: [T, d], token_index: [N]"
    return _Permute.apply(x, token_index)


def unpermute(rows, token_index, weights, num_tokens):
    """Weighted sum of each token's rows. rows: [N, d], token_index: [N], weights: [N] -> [T, d]
    in rows' dtype; zeros for a token with no row."""
    assert rows.dim() == 2 and token_index.shape == weights.shape == rows.shape[:1], "rows: [N, d], [N], [N]"
    return _Unpermute.apply(rows, token_index, weights, int(num_tokens))
