"""The experts of other ranks with the all-to-alls overlapped with expert compute.

--moe-a2a-overlap-degree D > 1 cuts every (destination rank) block of rows into D consecutive
parts; chunk c (part c of every block) travels while chunk c - 1 is computed, forward and
backward, using asynchronous collectives. Each row still meets the same expert with the same
weights, so outputs equal degree 1's; weight gradients are sums over the chunks (equal within
float rounding). Each chunk is computed by the layer's kernel backend, forward and backward.
"""
import torch
import torch.distributed as dist

from fairseq_moe_kernels import host

from .comm import block_transpose_index


def chunk_index(send_chunks):
    """Row index of every chunk in the rows laid out (destination, local expert). send_chunks [P, D, El] (its host
    list known, or read here)."""
    P, D, El = send_chunks.shape
    per = _per_block(host.sizes(send_chunks), El)  # [(dest, chunk)] rows, dest major
    start = [sum(per[:i]) for i in range(len(per))]
    device = send_chunks.device
    return [torch.cat([torch.arange(start[r * D + c], start[r * D + c] + per[r * D + c], device=device)
                       for r in range(P)]) for c in range(D)]


def _per_block(h, El):
    """A flat host list of [..., El] counts -> the sum of each block of El."""
    return [sum(h[i:i + El]) for i in range(0, len(h), El)]


class _Chunks:
    """Host lists of a Plan's chunked counts: per chunk c, rows per peer sent and received, and the rows each local
    expert gets."""

    def __init__(self, plan):
        P, D, El = plan.send.shape
        send, recv = (_per_block(host.sizes(t), El) for t in (plan.send, plan.recv))  # [(peer, chunk)]
        rh = host.sizes(plan.recv)
        self.send = [[send[r * D + c] for r in range(P)] for c in range(D)]
        self.recv = [[recv[r * D + c] for r in range(P)] for c in range(D)]
        self.experts = [[sum(rh[(r * D + c) * El + e] for r in range(P)) for e in range(El)] for c in range(D)]


def _a2a(x, send, recv, group):
    """An asynchronous all_to_all_single; send/recv: rows per peer (host lists)."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True)
    return out, work


class _Pipelined(torch.autograd.Function):
    """Forward: chunk c's rows travel while chunk c - 1 is computed. Backward: the same for the
    gradients, each chunk's backward being the kernel backend's own (autograd through its grouped MLP,
    kept per chunk from the forward), so both backends run here as they do without overlap. The counts come read
    (a Plan with D chunks): no chunk reads the device."""

    @staticmethod
    def forward(ctx, rows, plan, w1, b1, w2, b2, mlp):
        ep, recv_c = plan.ep, plan.recv  # recv_c [P source, D, El]
        degree = plan.send.shape[1]
        n = _Chunks(plan)
        index = chunk_index(plan.send)
        weights = [None if w is None else w.detach().requires_grad_(w.requires_grad) for w in (w1, b1, w2, b2)]
        grad = any(ctx.needs_input_grad)  # at eval no chunk keeps a graph
        out = torch.empty_like(rows)
        saved, pending = [], []
        inbound = _a2a(rows.index_select(0, index[0]), n.send[0], n.recv[0], ep.group)
        for c in range(degree):
            x, work = inbound
            work.wait()
            if c + 1 < degree:  # the next chunk travels while this one is computed
                inbound = _a2a(rows.index_select(0, index[c + 1]), n.send[c + 1], n.recv[c + 1], ep.group)
            order = block_transpose_index(recv_c[:, c], total=sum(n.recv[c]))  # (source, expert) -> (expert, source)
            x = x.index_select(0, order).requires_grad_(rows.requires_grad and grad)
            counts = host.known(recv_c[:, c].sum(0), n.experts[c])
            with torch.set_grad_enabled(grad):
                y = mlp(x, counts, *weights)  # [n_c, d], with its graph for backward
            back = torch.empty_like(x).index_copy_(0, order, y.detach())
            pending.append((c, *_a2a(back, n.recv[c], n.send[c], ep.group)))
            if grad:
                saved.append((x, y, order))
        for c, back, work in pending:
            work.wait()
            out.index_copy_(0, index[c], back)
        ctx.ep, ctx.chunks, ctx.weights, ctx.index, ctx.n = ep, saved, weights, index, n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ep, index, n, weights = ctx.ep, ctx.index, ctx.n, ctx.weights
        grad_out = grad_out.contiguous()
        grad_rows = torch.empty_like(grad_out)
        grads = [None if w is None else torch.zeros_like(w) for w in weights]
        trains = [w is not None and w.requires_grad for w in weights]  # (swiglu experts have no biases)
        pending = []
        degree = len(ctx.chunks)
        inbound = _a2a(grad_out.index_select(0, index[0]), n.send[0], n.recv[0], ep.group)
        for c, (x, y, order) in enumerate(ctx.chunks):
            g, work = inbound
            work.wait()
            if c + 1 < degree:
                inbound = _a2a(grad_out.index_select(0, index[c + 1]), n.send[c + 1], n.recv[c + 1], ep.group)
            wanted = [t for t, train in zip((x, *weights), (x.requires_grad, *trains)) if train]
            got = iter(torch.autograd.grad(y, wanted, g.index_select(0, order), allow_unused=True)
                       if wanted and y.requires_grad else ())
            gx = next(got) if x.requires_grad else None
            for total, train in zip(grads, trains):
                part = next(got) if train else None
                if part is not None:
                    total += part
            gx = torch.zeros_like(x) if gx is None else gx
            gx = torch.empty_like(gx).index_copy_(0, order, gx)
            pending.append((c, *_a2a(gx, n.recv[c], n.send[c], ep.group)))
        for c, back, work in pending:
            work.wait()
            grad_rows.index_copy_(0, index[c], back)
        ctx.chunks = None  # free the chunks' graphs
        return (grad_rows, None, *(gw if train else None for gw, train in zip(grads, trains)), None)


def pipelined_experts(rows, plan, experts, ops):
    """rows [N, d] sorted by global expert, plan: the call's comm.Plan (D > 1 chunks; read) -> expert outputs
    [N, d], same order. ops: the kernel backend (fairseq_moe_kernels.backend.ops); its grouped MLP computes each
    chunk."""
    def mlp(x, counts, w1, b1, w2, b2):  # (in compute_dtype(x), as Experts.forward: autocast's where it is on)
        return experts(x, counts, ops, weights=(w1, b1, w2, b2))

    return _Pipelined.apply(rows, plan, experts.w1, experts.b1, experts.w2, experts.b2, mlp)
