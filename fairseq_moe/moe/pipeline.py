"""The experts of other ranks with the all-to-alls overlapped with expert compute.

--moe-a2a-overlap-degree D > 1 cuts every (destination rank) block of rows into D consecutive
parts; chunk c (part c of every block) travels while chunk c - 1 is computed, forward and
backward, using asynchronous collectives. Each row still meets the same expert with the same
weights, so outputs equal degree 1's; weight gradients are sums over the chunks (equal within
float rounding).
"""
import torch
import torch.distributed as dist

from fairseq_moe_kernels.reference import _fc1_act, _fc1_backward, _fc2, _fc2_backward, _recompute_a

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
    @staticmethod
    def forward(ctx, rows, send, w1, b1, w2, b2, ep, activation, dropout_p, degree):
        send_c = chunk_counts(send, degree)  # [P, D, El]
        recv_c = exchange_counts(send_c, ep.group)  # [P source, D, El]
        index = chunk_index(send_c)
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
            x = x.index_select(0, order)
            sizes = recv_c[:, c].sum(0).tolist()
            a, act_saved, mask = _fc1_act(x, sizes, w1, b1, activation, dropout_p)
            y = torch.empty_like(x).index_copy_(0, order, _fc2(a, sizes, w2, b2))
            pending.append((c, *_a2a(y, recv_c[:, c].sum(1), send_c[:, c].sum(1), ep.group)))
            saved.append((x, act_saved, mask, order, sizes))
        for c, back, work in pending:
            work.wait()
            out.index_copy_(0, index[c], back)
        ctx.ep, ctx.activation, ctx.dropout_p = ep, activation, dropout_p
        ctx.chunks, ctx.index, ctx.send_c, ctx.recv_c = saved, index, send_c, recv_c
        ctx.save_for_backward(w1, w2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w1, w2 = ctx.saved_tensors
        ep, index, send_c, recv_c = ctx.ep, ctx.index, ctx.send_c, ctx.recv_c
        grad_out = grad_out.contiguous()
        grad_rows = torch.empty_like(grad_out)
        gw1, gb1 = torch.zeros_like(w1), w1.new_zeros(w1.shape[0], w1.shape[2])
        gw2, gb2 = torch.zeros_like(w2), w2.new_zeros(w2.shape[0], w2.shape[2])
        pending = []
        degree = len(ctx.chunks)
        inbound = _a2a(grad_out.index_select(0, index[0]), send_c[:, 0].sum(1), recv_c[:, 0].sum(1), ep.group)
        for c, (x, act_saved, mask, order, sizes) in enumerate(ctx.chunks):
            g, work = inbound
            work.wait()
            if c + 1 < degree:
                inbound = _a2a(grad_out.index_select(0, index[c + 1]), send_c[:, c + 1].sum(1),
                               recv_c[:, c + 1].sum(1), ep.group)
            g = g.index_select(0, order)
            a = _recompute_a(act_saved, mask, ctx.activation, ctx.dropout_p)
            da, cw2, cb2 = _fc2_backward(a, g, sizes, w2, True, True)
            gx, cw1, cb1 = _fc1_backward(x, act_saved, mask, da, sizes, w1, ctx.activation,
                                         ctx.dropout_p, True, True, True)
            for total, part in ((gw1, cw1), (gb1, cb1), (gw2, cw2), (gb2, cb2)):
                total += part
            gx = torch.empty_like(gx).index_copy_(0, order, gx)
            pending.append((c, *_a2a(gx, recv_c[:, c].sum(1), send_c[:, c].sum(1), ep.group)))
        for c, back, work in pending:
            work.wait()
            grad_rows.index_copy_(0, index[c], back)
        return grad_rows, None, gw1, gb1, gw2, gb2, None, None, None, None


def pipelined_experts(rows, send, experts, ep, degree):
    """rows [N, d] sorted by global expert, send [P, El] -> expert outputs [N, d], same order."""
    return _Pipelined.apply(rows, send, experts.w1, experts.b1, experts.w2, experts.b2, ep,
                            experts.activation, experts.dropout_p(), degree)
