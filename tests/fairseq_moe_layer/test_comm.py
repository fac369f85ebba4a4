"""Expert parallelism on several gloo processes: the all-to-alls and the MoE layer across ranks.

Each test spawns W CPU processes once and runs its checks inside them: a flat and a hierarchical
all-to-all return exactly what the formula says (zero-row peers included), forward and backward;
MoELayer with experts spread over the ranks equals the single-process layer with the same weights,
with and without the all-to-alls overlapped with expert compute (--moe-a2a-overlap-degree).
"""
import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.comm import all_to_all, exchange_counts, expert_parallel
from fairseq_moe_layer.experts import EXPERT_KINDS
from fairseq_moe_layer.gates import GATES
from fairseq_moe_layer.routing import ROUTINGS

from tests import warm
from tests.conftest import free_port


def spawn(fn, world_size, *args):
    """fn(rank, world_size, *args) on world_size gloo processes (tests/warm.py: spawned as torch's spawn does, or
    forked warm)."""
    port = free_port()
    warm.spawn(_init_and_run, world_size, (world_size, port, fn, args))


def _init_and_run(rank, world_size, port, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _rows(src, counts, d=3):
    """Rows rank src sends: row i to dst is (src, dst, i, ...) so every row says where it belongs."""
    out = [torch.tensor([[src, dst, i] + [src * 100 + dst * 10 + i] * (d - 3) for i in range(n)],
                        dtype=torch.float64).view(n, d) for dst, n in enumerate(counts)]
    return torch.cat(out)


def _check_all_to_all(rank, W, local_size):
    ep = expert_parallel(W, local_size=local_size)
    assert ep.local_size == (local_size or 1)
    g = torch.Generator().manual_seed(7)
    counts = torch.randint(0, 4, (W, W), generator=g)  # counts[s][r], zeros included
    counts[1, :] = 0  # rank 1 sends nothing at all
    send = counts[rank]
    recv = exchange_counts(send, ep.group)
    assert recv.tolist() == counts[:, rank].tolist()
    x = _rows(rank, send.tolist(), d=5).requires_grad_(True)
    y = all_to_all(x, send, recv, ep)
    expected = torch.cat([_rows(s, counts[s].tolist(), d=5)[counts[s, :rank].sum():][:counts[s, rank]]
                          for s in range(W)])
    assert torch.equal(y, expected)
    # Backward: the gradient of sum(y * weight) sends each row's weight back to where it came from.
    weight = torch.arange(y.numel(), dtype=torch.float64).view_as(y) + rank * 1000
    (y * weight).sum().backward()
    back = all_to_all(weight, recv, send, ep)
    assert torch.equal(x.grad, back)


def _check_layer(rank, W, E, k, capacity_factor, local_size, overlap_degree=1, kernel_backend="torch",
                 routing="topk", normalization="world_size", shared_experts=0, gate="linear", expert_kind="ffn"):
    """The layer with its experts spread over the ranks equals the 1-rank layer (torch kernels, fp64;
    with kernel_backend="triton" the spread layer runs the Triton kernels, fp32 in the interpreter)."""
    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=E, top_k=k, capacity_factor=capacity_factor,
                    eval_capacity_token_fraction=-1, routing=routing, expert_grad_normalization=normalization,
                    shared_experts=shared_experts, gate=gate, expert_kind=expert_kind)
    policy = ROUTINGS[routing]
    dtype, tol = (torch.float64, 1e-12) if kernel_backend == "torch" else (torch.float32, 1e-5)
    torch.manual_seed(0)
    full = MoELayer(cfg).to(dtype)  # all E experts, the same weights on every rank
    ep = expert_parallel(E, local_size=local_size, overlap_degree=overlap_degree)
    torch.manual_seed(0)
    spread = MoELayer(dataclasses.replace(cfg, kernel_backend=kernel_backend), ep).to(dtype)
    lo, hi = ep.first_expert, ep.first_expert + ep.num_local_experts
    # The per-expert seeding gives each rank the slice of the 1-rank init, with no copying.
    names = [n for n, _ in full.experts.named_parameters()]  # (w1, b1, w2, b2; swiglu: w1, w2)
    for name in names:
        assert torch.equal(getattr(spread.experts, name), getattr(full.experts, name)[lo:hi]), name
    gates = [] if full.gate is None else list(zip(full.gate.parameters(), spread.gate.parameters()))
    assert all(torch.equal(p2, p1) for p1, p2 in gates)

    calls = []
    if kernel_backend == "triton":  # count the Triton grouped MLP's calls (the overlapped chunks use it)
        from fairseq_moe_kernels import backend

        ops = backend.ops("triton")
        mlp = ops.grouped_mlp
        ops.grouped_mlp = lambda *a, **kw: calls.append(1) or mlp(*a, **kw)
    g = torch.Generator().manual_seed(100 + rank)
    T = [0, 7, 13, 4][rank % 4] if capacity_factor else [5, 0, 9, 11][rank % 4]  # a rank with no tokens
    x = torch.randn(T, 6, generator=g, dtype=torch.float64).to(dtype)
    if policy.slots:  # groups of tokens: [G, n, d] (a rank with no group)
        x = x[:T - T % 3].view(-1, 3, 6)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ids = torch.randint(0, 50, (T,), generator=g) if policy.needs_token_ids else None
    y1, aux1 = full(x1, token_ids=ids)
    y2, aux2 = spread(x2, token_ids=ids)
    torch.testing.assert_close(y2, y1, rtol=tol, atol=tol)
    assert torch.equal(aux1.counts, aux2.counts)
    ((y1 * y1).sum() + aux1.balance_loss).backward()
    ((y2 * y2).sum() + aux2.balance_loss).backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=tol, atol=tol)
    for p1, p2 in gates:  # (none without a learned router)
        torch.testing.assert_close(p2.grad, p1.grad, rtol=tol, atol=tol)
    if shared_experts:  # replicated like the gate: this rank's tokens only (data parallelism averages them)
        for p1, p2 in zip(full.shared.parameters(), spread.shared.parameters()):
            torch.testing.assert_close(p2.grad, p1.grad, rtol=tol, atol=tol)
    # An expert's gradient gathers the tokens of every rank (its EP group's through the all-to-all,
    # the other groups' through its replicas), divided by W as data parallelism averages (or, with the
    # moe branch's sqrt_world_size, by replicas * sqrt(P)).
    divisor = W if normalization == "world_size" else ep.replicas * ep.size ** 0.5
    for name in names:
        grad = getattr(full.experts, name).grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(getattr(spread.experts, name).grad, grad[lo:hi] / divisor,
                                   rtol=10 * tol, atol=tol)
    if kernel_backend == "triton":
        ops.grouped_mlp = mlp
        assert len(calls) == overlap_degree  # one per chunk (the whole block when not overlapped)


def _check_host_reads(rank, W, local_size=None, overlap_degree=1, expected=((0.0, 1, 0), (1.0, 1, 0))):
    """With the experts spread, the reads of the device (tests/host_reads.py counts; on a GPU each read is a sync) in
    a forward and a backward, (capacity factor, forward, backward) as expected: one read a call, dropless or at
    capacity (routing's kept counts read with what the other ranks send, comm.Plan), flat, 2-D or overlapped; none
    in a backward; with a padding mask one more, the first time that mask is seen."""
    from tests.host_reads import counted

    for capacity_factor, forward, backward in expected:
        cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, capacity_factor=capacity_factor)
        torch.manual_seed(0)
        layer = MoELayer(cfg, expert_parallel(4, local_size=local_size, overlap_degree=overlap_degree))
        x = torch.randn(9 + rank, 6, requires_grad=True)
        with counted() as found:
            y, aux = layer(x)
        assert sum(found.values()) == forward, (capacity_factor, found)
        with counted() as found:
            ((y * y).sum() + aux.balance_loss).backward()
        assert sum(found.values()) == backward, (capacity_factor, found)


def _check_routing_bias(rank, W):
    """The aux-loss-free bias moves by the load of every rank's tokens: on W ranks (experts spread) it
    equals the bias the 1-rank layer gets from all the tokens, and every rank holds the same bias."""
    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, score="sigmoid", bias_update_rate=0.05,
                    capacity_factor=0.0)
    torch.manual_seed(0)
    full = MoELayer(cfg)
    torch.manual_seed(0)
    spread = MoELayer(cfg, expert_parallel(4))
    xs = [torch.randn(5 + r, 6, generator=torch.Generator().manual_seed(50 + r)) for r in range(W)]
    spread(xs[rank])
    spread.update_routing_bias()
    full(torch.cat(xs))  # all the tokens on one process
    want = 0.05 * torch.sign(full._demand.mean() - full._demand)
    torch.testing.assert_close(spread.routing_bias, want)
    biases = [torch.empty_like(spread.routing_bias) for _ in range(W)]
    dist.all_gather(biases, spread.routing_bias)
    assert all(torch.equal(b, biases[0]) for b in biases) and spread.routing_bias.any()


def _check_global_balance(rank, W, spread, sizes, ignored=None):
    """--moe-balance-loss-scope global on W ranks (rank r holding sizes[r] tokens, maybe none; experts spread or
    not): the ranks' losses add up to the loss of one process holding every token (the layer in eval: no collective,
    the same dropless routing), and their gradients (summed over the ranks, as fairseq's trainer sums and divides by
    the global sample size) to its gradient; each rank's input gradient is that process's on its tokens. Rank
    `ignored` runs a batch whose loss is thrown away (fairseq's dummy batch: its gradient is dropped): the others
    equal one process holding their tokens only."""
    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, capacity_factor=0.0,
                    eval_capacity_token_fraction=0.0, balance_loss_scope="global")
    torch.manual_seed(0)
    whole = MoELayer(cfg).double()
    torch.manual_seed(0)
    layer = MoELayer(cfg, expert_parallel(4) if spread else None).double()
    xs = [torch.randn(n, 6, generator=torch.Generator().manual_seed(70 + r), dtype=torch.float64)
          for r, n in enumerate(sizes)]
    x = xs[rank].clone().requires_grad_(True)
    layer.ignored = rank == ignored
    _, aux = layer(x)
    assert aux.balance_share_of_global and aux.num_tokens == sizes[rank]
    (aux.balance_loss * (0.0 if layer.ignored else 1.0)).backward()  # (fairseq: a dummy batch's loss times 0)
    total = aux.balance_loss.detach().clone() * (0.0 if layer.ignored else 1.0)
    dist.all_reduce(total)
    grad = layer.gate.weight.grad.clone()
    dist.all_reduce(grad)
    if ignored is not None:
        xs[ignored] = xs[ignored][:0]
        sizes = [0 if r == ignored else n for r, n in enumerate(sizes)]
    xw = torch.cat(xs).requires_grad_(True)
    whole.eval()
    _, ref = whole(xw)
    assert not ref.balance_share_of_global
    ref.balance_loss.backward()
    torch.testing.assert_close(total, ref.balance_loss.detach())
    torch.testing.assert_close(grad, whole.gate.weight.grad)
    start = sum(sizes[:rank])
    if rank != ignored:
        torch.testing.assert_close(x.grad, xw.grad[start:start + sizes[rank]])
    # A rank's own tokens give another loss: the counts of the others changed it. (Every rank runs it: with the
    # experts spread a forward is a collective.)
    layer.eval()
    alone = layer(xs[rank])[1].balance_loss
    assert not torch.allclose(alone, aux.balance_loss.detach()) or not sizes[rank] or ignored is not None


def _check_bad_split(rank, W):
    with pytest.raises(ValueError, match="--moe-expert-count 3"):
        expert_parallel(3)
    with pytest.raises(ValueError, match="--moe-a2a-overlap-degree"):
        expert_parallel(2, overlap_degree=0)


def _run_all(rank, W, checks):
    for fn, args in checks:
        fn(rank, W, *args)


def _every_policy(names=None):
    """_check_layer of every policy in ROUTINGS (or of those named): top-2, or top-1 where the policy takes no
    other; at capacity with all-to-alls overlapped in 2 chunks, and dropless, where the policy has a dropless
    form."""
    checks = []
    for name in sorted(ROUTINGS if names is None else names):
        def valid(**kw):
            try:
                MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, routing=name, **kw).validate()
                return True
            except ValueError:
                return False

        k = 2 if valid(top_k=2) else 1
        checks.append((_check_layer, (4, k, 1.0, None, 2, "torch", name)))
        if valid(top_k=k, capacity_factor=0.0):
            checks.append((_check_layer, (4, k, 0.0, None, 1, "torch", name)))
    return checks


def _every_expert_kind():
    """_check_layer of every expert kind in EXPERT_KINDS, dropless and at capacity, overlapped, with a shared one."""
    return [(_check_layer, (4, 2, cf, None, overlap, "torch", "topk", "world_size", int(cf > 0), "linear", kind))
            for kind in sorted(EXPERT_KINDS) for cf, overlap in ((0.0, 2), (1.0, 1))]


def _every_gate(names=None):
    """_check_layer of every gate in GATES (or of those named), with top-2 routing at capacity."""
    return [(_check_layer, (4, 2, 1.0, None, 1, "torch", "topk", "world_size", 0, name))
            for name in sorted(GATES if names is None else names)]


# One spawn per world size runs all its checks: a process start-up costs seconds here.
CHECKS = {
    2: [
        (_check_all_to_all, (None,)),
        (_check_layer, (4, 2, 0.0, None)),  # E/W = 2 experts per rank, dropless
        (_check_layer, (4, 2, 0.0, None, 3)),  # all-to-alls overlapped with compute, 3 chunks
        (_check_bad_split, ()),
        (_check_layer, (4, 2, 1.0, None, 1, "triton")),  # Triton kernels (interpreter) across ranks
        (_check_layer, (4, 2, 0.0, None, 2, "triton")),  # ... and in the overlapped chunks
        *_every_policy(),  # every registered routing policy, at capacity and dropless
        *_every_gate(),  # every registered gate
        *_every_expert_kind(),  # every registered kind of expert
        (_check_layer, (4, 1, 1.5, None, 1, "triton", "expert_choice")),
        (_check_routing_bias, ()),
        (_check_host_reads, ()),
        (_check_global_balance, (False, (7, 12))),  # the global-batch balance loss, dense ranks
        (_check_global_balance, (True, (9, 5))),  # ... experts spread
        (_check_global_balance, (False, (7, 12), 1)),  # ... rank 1 on fairseq's dummy batch
    ],
    4: [
        (_check_all_to_all, (2,)),  # hierarchical: 2 nodes x 2 local ranks
        (_check_layer, (8, 2, 1.0, 2, 1, "torch", "topk", "world_size", 1)),  # capacity dropping, hierarchical
        # all-to-all, a shared expert
        (_check_layer, (2, 1, 0.0, None)),  # W/E = 2 replicas of each expert
        (_check_layer, (2, 1, 0.0, None, 1, "torch", "topk", "sqrt_world_size")),  # ... divided by 2 * sqrt(2)
        (_check_layer, (4, 4, 0.0, None)),  # k = 4
        (_check_layer, (8, 2, 1.0, None, 2)),  # overlap, capacity dropping, a rank with no tokens
        (_check_host_reads, (2,)),  # the 2-D all-to-all: one read a call
        (_check_host_reads, (None, 2)),  # overlapped in 2 chunks: one read a call
        (_check_global_balance, (True, (6, 0, 11, 3))),  # the global-batch balance loss, a rank with no tokens
        (_check_global_balance, (True, (6, 4, 11, 3), 2)),  # ... rank 2 on fairseq's dummy batch
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(CHECKS))
def test_expert_parallel(world_size):
    spawn(_run_all, world_size, CHECKS[world_size])


@pytest.mark.parametrize("D", [1, 2, 3, 7])
def test_overlap_chunks_partition_every_block(D):
    from fairseq_moe_layer.comm import chunk_counts
    from fairseq_moe_layer.pipeline import chunk_index

    send = torch.tensor([[3, 0, 2], [0, 0, 0], [1, 5, 4], [0, 1, 0]])  # [P, El], an empty peer
    chunks = chunk_counts(send, D)  # [P, D, El]
    assert torch.equal(chunks.sum(1), send) and (chunks >= 0).all()
    rows = torch.cat(chunk_index(chunks))
    assert torch.equal(rows.sort().values, torch.arange(int(send.sum())))
    # Inside each chunk, rows stay ordered by destination, then by local expert.
    for idx in chunk_index(chunks):
        assert torch.equal(idx, idx.sort().values)
