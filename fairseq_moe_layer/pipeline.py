"""The experts of other ranks with the all-to-alls overlapped with expert compute.

--moe-a2a-overlap-degree D > 1 cuts every (destination rank) block of rows into D consecutive
parts; chunk c (part c of every block) travels while chunk c - 1 is computed, forward and
backward, using asynchronous collectives. Each row still meets the same expert with the same
weights, so outputs equal degree 1's; weight gradients are sums over the chunks (equal within
float rounding). Each chunk is computed by the layer's kernel backend, forward and backward.
"""
import torch
import torch.distributed as dist

from .comm import block_transpose_index, exchange_counts


def chunk_counts(send, D):
    """send: [P, El] rows per (destination, local expert) -> [P, D, El], chunk c = part c of each block."""
    P, El = send.shape
    total = send.sum(1, keepdim=True)  # [P, 1]
    bounds = torch.arange(D + 1, device=send.device) * total // D  # [P, D + 1] row bounds per block
    cum = torch.cat([send.new_zeros(P, 1), send.cumsum(1)], 1)  # [P, El + 1] expert bounds per block
    lo = torch.maximum(bounds[:, :-1, None], cum[:, None, :-1])  # [P, D, El]
    hi = torch.minimum(bounds[:, 1:, None], cum[:, None, 1:])
    return (hi - lo).clamp(min=0)


def chunk_index(send_chunks):
    """Row index of every chunk in the rows laid out (destination, local expert)."""
    P, D, El = send_chunks.shape
    per = send_chunks.sum(2)  # [P, D]
    flat = per.reshape(-1)
    start = (torch.cumsum(flat, 0) - flat).view(P, D)  # where (dest, chunk) starts in the rows
    return [torch.cat([torch.arange(int(start[r, c]), int(start[r, c] + per[r, c]), device=per.device)
                       for r in range(P)]) for c in range(D)]


def _a2a(x, send, recv, group):
    out = x.new_empty((int(recv.sum()),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv.tolist(), send.tolist(), group=group,
                                  async_op=True)
    return out, work


class _Pipelined(torch.autograd.Function):
    """Forward: chunk c's rows travel while chunk c - 1 is computed. Backward: the same for the
    gradients, each chunk's backward being the kernel backend's own (autograd through its grouped MLP,
    kept per chunk from the forward), so both backends run here as they do without overlap."""

    @staticmethod
    def forward(ctx, rows, send, w1, b1, w2, b2, ep, mlp, degree):
        send_c = chunk_counts(send, degree)  # [P, D, El]
        recv_c = exchange_counts(send_c, ep.group)  # [P source, D, El]
        index = chunk_index(send_c)
        weights = [w.detach().requires_grad_(w.requires_grad) for w in (w1, b1, w2, b2)]
        grad = any(ctx.needs_input_grad)  # at eval no chunk keeps a graph
        out = torch.empty_like(rows)
        saved, pending = [], []
        inbound = _a2a(rows.index_select(0, index[0]), send_c[:, 0].sum(1), recv_c[:, 0].sum(1), ep.group)
        for c in range(degree):
            x, work = inbound
            work.wait()
            if c + 1 < degree:  # the next chunk travels while this one is computed
                inbound = _a2a(rows.index_select(0, index[c + 1]), send_c[:, c + 1].sum(1),
                               recv_c[:, c + 1].sum(1), ep.group)
            order = block_transpose_index(recv_c[:, c])  # (source, expert) -> (expert, source)
            x = x.index_select(0, order).requires_grad_(rows.requires_grad and grad)
            with torch.set_grad_enabled(grad):
                y = mlp(x, recv_c[:, c].sum(0), *weights)  # [n_c, d], with its graph for backward
            back = torch.empty_like(x).index_copy_(0, order, y.detach())
            pending.append((c, *_a2a(back, recv_c[:, c].sum(1), send_c[:, c].sum(1), ep.group)))
            if grad:
                saved.append((x, y, order))
        for c, back, work in pending:
            work.wait()
            out.index_copy_(0, index[c], back)
        ctx.ep, ctx.chunks, ctx.weights = ep, saved, weights
        ctx.index, ctx.send_c, ctx.recv_c = index, send_c, recv_c
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ep, index, send_c, recv_c, weights = ctx.ep, ctx.index, ctx.send_c, ctx.recv_c, ctx.weights
        grad_out = grad_out.contiguous()
        grad_rows = torch.empty_like(grad_out)
        grads = [torch.zeros_like(w) for w in weights]
        pending = []
        degree = len(ctx.chunks)
        inbound = _a2a(grad_out.index_select(0, index[0]), send_c[:, 0].sum(1), recv_c[:, 0].sum(1), ep.group)
        for c, (x, y, order) in enumerate(ctx.chunks):
            g, work = inbound
            work.wait()
            if c + 1 < degree:
                inbound = _a2a(grad_out.index_select(0, index[c + 1]), send_c[:, c + 1].sum(1),
                               recv_c[:, c + 1].sum(1), ep.group)
            wanted = [t for t in (x, *weights) if t.requires_grad]
            got = iter(torch.autograd.grad(y, wanted, g.index_select(0, order), allow_unused=True)
                       if wanted and y.requires_grad else ())
            gx = next(got) if x.requires_grad else None
            for total, w in zip(grads, weights):
                part = next(got) if w.requires_grad else None
                if part is not None:
                    total += part
            gx = torch.zeros_like(x) if gx is None else gx
            gx = torch.empty_like(gx).index_copy_(0, order, gx)
            pending.append((c, *_a2a(gx, recv_c[:, c].sum(1), send_c[:, c].sum(1), ep.group)))
        for c, back, work in pending:
            work.wait()
            grad_rows.index_copy_(0, index[c], back)
        ctx.chunks = None  # free the chunks' graphs
        return (grad_rows, None, *(gw if w.requires_grad else None for gw, w in zip(grads, weights)),
                None, None, None)


def pipelined_experts(rows, send, experts, ep, degree, ops):
    """rows [N, d] sorted by global expert, send [P, El] -> expert outputs [N, d], same order.
    ops: the kernel backend (fairseq_moe_kernels.backend.ops); its grouped MLP computes each chunk."""
    def mlp(x, counts, w1, b1, w2, b2):  # (in compute_dtype(x), as Experts.forward: autocast's where it is on)
        return experts(x, counts, ops, weights=(w1, b1, w2, b2))

    return _Pipelined.apply(rows, send, experts.w1, experts.b1, experts.w2, experts.b2, ep, mlp, degree)
