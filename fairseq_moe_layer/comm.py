"""Expert-parallel communication: process groups and an autograd all-to-all with variable splits.

Legend: W ranks in the world, P ranks in one expert-parallel (EP) group, E experts, E_l = E / P
local experts per rank. Rows sent from rank s to rank r are counted by counts[s][r].

Every rank issues the same collectives in the same order whatever its token count (zero included):
the counts are always exchanged first, then the rows, so no input can make a rank wait forever.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fairseq_moe_kernels import host

from .lockstep import Lockstep


@dataclass
class ExpertParallel:
    """Where the experts of a layer live. Build it with expert_parallel(num_experts, ...)."""

    group: Optional[object]  # the EP group: its P ranks together hold all E experts
    size: int  # P
    ep_rank: int  # this rank's index in its EP group (not its global rank)
    num_local_experts: int  # E_l
    replicas: int  # W / P: how many ranks hold each expert
    replica_group: Optional[object]  # ranks holding the same experts as this one (None if 1)
    local_group: Optional[object] = None  # hierarchical a2a: ranks of this node in the EP group
    node_group: Optional[object] = None  # hierarchical a2a: same local index on every node
    local_size: int = 1  # L: ranks per node in the EP group (1 = flat all-to-all)
    overlap_degree: int = 1  # chunks whose all-to-alls overlap expert compute (pipeline.py)
    lockstep: Optional[Lockstep] = None  # keeps the group's layer calls matched in inference (lockstep.py)

    def __post_init__(self):
        if self.lockstep is None:
            self.lockstep = Lockstep(self.group)

    def __deepcopy__(self, memo):
        """A copy of a model (fairseq's --store-ema) shares the process groups: they cannot be copied."""
        return self

    @property
    def first_expert(self):
        return self.ep_rank * self.num_local_experts


def expert_parallel_size(num_experts, world_size):
    """P, the ranks that together hold all E experts: W when E % W == 0, E when W % E == 0."""
    if num_experts % world_size == 0:
        return world_size
    if world_size % num_experts == 0:
        return num_experts
    raise ValueError(
        f"--moe-expert-count {num_experts} and --distributed-world-size {world_size} (the job's ranks: torchrun's "
        f"--nproc-per-node x nodes, fairseq_moe.launch's --nproc): one must be a multiple of the other (E/W "
        f"experts per rank, or W/E replicas of each expert)"
    )


def local_experts(num_experts, world_size, rank):
    """(first expert, number of experts) that rank holds when E experts are spread over W ranks."""
    P = expert_parallel_size(num_experts, world_size)
    return (rank % P) * (num_experts // P), num_experts // P


def check_overlap_degree(overlap_degree):
    if not isinstance(overlap_degree, int) or isinstance(overlap_degree, bool) or overlap_degree < 1:
        raise ValueError(f"--moe-a2a-overlap-degree must be an integer >= 1, got {overlap_degree!r}")


def expert_parallel(num_experts, local_size=None, overlap_degree=1, lockstep=None):
    """Split num_experts over the default process group, replicating when W > E.

    E % W == 0: E/W experts per rank. W % E == 0: one expert per rank, W/E replicas of each.
    local_size (ranks per node, --moe-a2a-local-size): > 1 selects the hierarchical all-to-all.
    overlap_degree (--moe-a2a-overlap-degree): > 1 overlaps the flat all-to-alls with expert compute.
    lockstep: the Lockstep the layers meet in (inference; lockstep.py), where several ExpertParallels share one
    (default: one of its own, over its group).
    Every rank must call this in the same order (it creates process groups, a collective).
    """
    W, rank = dist.get_world_size(), dist.get_rank()
    P = expert_parallel_size(num_experts, W)
    replicas = W // P
    check_overlap_degree(overlap_degree)
    # EP groups are blocks of P consecutive ranks; replica groups take one rank of each block.
    blocks = range(0, W, P)
    group = _my_group([list(range(b, b + P)) for b in blocks], rank)
    replica_group = _my_group([list(range(i, W, P)) for i in range(P)], rank) if replicas > 1 else None
    L = local_size or 1
    if L < 1 or (P % L and L % P):  # (a node of several whole EP groups: each group's all-to-all is within it)
        raise ValueError(f"--moe-a2a-local-size {L} must divide the expert-parallel size {P}, or be a multiple of it")
    local_group = node_group = None
    if 1 < L < P:  # inside each block: nodes of L consecutive ranks, and the ranks sharing a local index
        local_group = _my_group([list(range(b + n * L, b + (n + 1) * L)) for b in blocks for n in range(P // L)], rank)
        node_group = _my_group([list(range(b + i, b + P, L)) for b in blocks for i in range(L)], rank)
    else:
        L = 1
    if overlap_degree > 1 and L > 1:
        raise ValueError("--moe-a2a-overlap-degree > 1 works with the flat all-to-all only; "
                         f"drop it or set --moe-a2a-local-size 1 (got {L})")
    return ExpertParallel(group, P, rank % P, num_experts // P, replicas, replica_group,
                          local_group, node_group, L, overlap_degree, lockstep)


def _my_group(rank_lists, rank):
    """Create a process group of each list (every rank creates all, in the same order); return this rank's."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def exchange_counts(send_counts, group):
    """send_counts: [P, ...] long, what this rank sends to each rank -> what each rank sends here."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def chunk_counts(send, D):
    """send: [P, El] rows per (destination, local expert) -> [P, D, El], chunk c = part c of each block (the
    overlapped all-to-all's chunks, pipeline.py)."""
    P, El = send.shape
    total = send.sum(1, keepdim=True)  # [P, 1]
    bounds = torch.arange(D + 1, device=send.device) * total // D  # [P, D + 1] row bounds per block
    cum = torch.cat([send.new_zeros(P, 1), send.cumsum(1)], 1)  # [P, El + 1] expert bounds per block
    lo = torch.maximum(bounds[:, :-1, None], cum[:, None, :-1])  # [P, D, El]
    hi = torch.minimum(bounds[:, 1:, None], cum[:, None, 1:])
    return (hi - lo).clamp(min=0)


@dataclass
class Way:
    """One direction of an all-to-all of rows: the rows sent to and received from each rank of the EP group (host
    lists), and the 2-D all-to-all's counts of its two steps (device tensors (c, r1, r2) whose host lists host.py
    keeps on them; None for the flat one)."""

    send: list
    recv: list
    steps: Optional[tuple] = None

    def back(self, steps=None):
        """The way the gradients go: send and receive swapped (steps: the 2-D steps' counts of that direction)."""
        return Way(self.recv, self.send, steps)


def _step_counts(per_rank, ep):
    """The 2-D all-to-all's counts for rows per_rank [P] to each rank of the EP group, exchanged (collectives), not
    read: c [N dest nodes, L local ranks], r1 [L source local, N dest node], r2 [N source node, L source local]."""
    L, N = ep.local_size, ep.size // ep.local_size
    c = per_rank.reshape(N, L)
    r1 = exchange_counts(c.t().contiguous(), ep.local_group)
    r2 = exchange_counts(r1.t().contiguous(), ep.node_group)
    return c, r1, r2


class Plan:
    """The counts of one layer call's all-to-alls, both ways (the rows out to their experts' ranks, the outputs back,
    and the gradients of each): exchanged with the EP group's ranks when made (collectives: every rank makes one per
    layer call, in the same place), then read from the device in one read (read(), or together with routing's read
    of the kept counts: host.ahead). After it no all-to-all of the call, no backward and no expert op reads the
    device. counts: [E] long, this rank's rows per expert (global ids), rows sorted by expert."""

    def __init__(self, counts, ep):
        P, El, D = ep.size, ep.num_local_experts, ep.overlap_degree
        self.ep, self.counts = ep, counts
        send = counts.view(P, El)  # rows for (destination rank, its local expert)
        self.send = send if D == 1 else chunk_counts(send, D)  # [P, El], or [P, D, El] in D chunks
        self.recv = exchange_counts(self.send, ep.group)  # [P source ranks, (D,) El]
        self.steps = (None, None)
        if ep.local_size > 1:  # (out, back)
            self.steps = (_step_counts(send.sum(1), ep), _step_counts(self.recv.sum(1), ep))
        # (what is read with the counts: the counts' own view needs no read of its own)
        self.tensors = [*([self.send] if D > 1 else []), self.recv, *(t for s in self.steps if s for t in s)]

    def read(self):
        """Read what is not read yet of the counts (at most one read); -> self."""
        host.read(self.counts, *self.tensors)
        return self

    def ways(self):
        """(out, back): the Ways of the rows out to the experts and of their outputs back (flat or 2-D; D = 1)."""
        P = self.ep.size
        per_rank = lambda h: [sum(h[i * len(h) // P:(i + 1) * len(h) // P]) for i in range(P)]  # noqa: E731
        out = Way(per_rank(host.sizes(self.counts)), per_rank(host.sizes(self.recv)), self.steps[0])
        return out, out.back(self.steps[1])


def _flat(x, send, recv, group):
    """One all_to_all_single. send/recv: row counts per peer (lists of ints)."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def block_transpose_index(counts, total=None):
    """Row index that reorders blocks laid out (a, b) [a major] into (b, a) order.

    counts: [A, B] long, the rows of block (a, b); total: their sum where the caller knows it (else read from the
    device here). Returns idx with out = rows[idx].
    """
    A, B = counts.shape
    flat = counts.reshape(-1)
    src_start = (torch.cumsum(flat, 0) - flat).view(A, B).t().reshape(-1)  # (b, a) order
    sizes = counts.t().reshape(-1)
    dst_start = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum()) if total is None else total
    offset = torch.repeat_interleave(src_start - dst_start, sizes, output_size=total)
    return offset + torch.arange(total, device=counts.device)


def _hierarchical(x, way, ep):
    """The flat all-to-all's result in two steps (Tutel's 2-D all-to-all), variable splits.

    Rank me = (n, m): node n, local index m; P = N nodes x L local ranks, rank id n * L + m.
    1) intra-node: send to local peer m' every chunk bound for (n'', m'), for all nodes n'';
    2) inter-node: send to (n'', m) everything gathered for it from this node's ranks.
    Both steps' counts were exchanged and read before (way.steps: _step_counts, then one read).
    """
    L, N = ep.local_size, ep.size // ep.local_size
    c, r1, r2 = way.steps
    ch, r1h, r2h = host.read(c, r1, r2)  # (flat, row-major; known: read with the call's other counts)
    # Step 1: reorder my chunks from (n'', m') to (m', n'') so that each local peer's part is contiguous.
    x1 = x.index_select(0, block_transpose_index(c, total=sum(ch)))
    y1 = _flat(x1, [sum(ch[m::L]) for m in range(L)], [sum(r1h[l * N:(l + 1) * N]) for l in range(L)],
               ep.local_group)  # (src local l, dest node n'')
    # Step 2: regroup by destination node, then send each node its rows.
    x2 = y1.index_select(0, block_transpose_index(r1, total=sum(r1h)))  # (dest node n'', src local l)
    return _flat(x2, [sum(r1h[n::N]) for n in range(N)], [sum(r2h[n * L:(n + 1) * L]) for n in range(N)],
                 ep.node_group)  # rows ordered by source rank n * L + l, exactly as the flat op


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, way, back, ep, counts):
        ctx.way, ctx.back, ctx.ep, ctx.counts = way, back, ep, counts
        return _hierarchical(x, way, ep) if way.steps is not None else _flat(x, way.send, way.recv, ep.group)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the splits swapped: the way back (where not given, its
        # 2-D steps' counts exchanged and read now, all_to_all's).
        way, back = ctx.way, ctx.back
        if back is None:
            back = way.back(_read_steps(ctx.counts[1], ctx.ep))
        return _AllToAll.apply(grad, back, way, ctx.ep, None), None, None, None, None


def send_rows(x, way, back, ep):
    """Differentiable all-to-all of rows x [sum(way.send), ...] ordered by destination rank along way, its gradient
    along back (Ways, from a Plan: the counts known on the host, so nothing is read from the device, forward or
    backward) -> [sum(way.recv), ...] ordered by source rank."""
    return _AllToAll.apply(x, way, back, ep, None)


def _read_steps(per_rank, ep):
    """The 2-D steps' counts of rows per_rank [P], exchanged and read (None for the flat all-to-all)."""
    if ep.local_size == 1:
        return None
    steps = _step_counts(per_rank, ep)
    host.read(*steps)
    return steps


def all_to_all(x, send_counts, recv_counts, ep):
    """Differentiable all-to-all of rows, flat or hierarchical as ep says.

    x: [sum(send_counts), ...] rows ordered by destination rank; send_counts, recv_counts: [P] long (recv_counts
    from exchange_counts). Exchanges the 2-D all-to-all's step counts first, then reads whatever counts are not known
    on the host yet in one read (host.py); the backward does the same for its direction. Returns
    [sum(recv_counts), ...] ordered by source rank. (The MoE layer plans both ways at once instead: Plan, send_rows.)
    """
    steps = _step_counts(send_counts, ep) if ep.local_size > 1 else None
    host.read(send_counts, recv_counts, *(steps or ()))
    way = Way(host.sizes(send_counts), host.sizes(recv_counts), steps)
    return _AllToAll.apply(x, way, None, ep, (send_counts, recv_counts))


def expert_grad_hook(grad, ep, normalization="world_size"):
    """The gradient of an expert parameter, made to match data parallelism's convention.

    Through the all-to-all an expert's gradient already sums the tokens of every rank of its EP
    group, while data parallelism averages the shared parameters' gradients over the W ranks.
    So: sum over the replicas of the expert, divide by W. Run as a tensor hook, once per backward
    (gradient accumulation adds the results, as it should); every replica runs the same backward.
    normalization "sqrt_world_size" (fairseq's moe branch, --moe-normalize-expert-grad): divide by
    replicas * sqrt(P) = sqrt(W * replicas) instead, so the experts' steps grow with sqrt(P).
    """
    if ep.replicas > 1:
        grad = grad.clone()
        dist.all_reduce(grad, group=ep.replica_group)
    if normalization == "sqrt_world_size":
        return grad / (ep.replicas * ep.size ** 0.5)
    return grad / dist.get_world_size()
