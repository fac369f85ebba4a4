"""The MoE layer reads the device from the host at most once per forward (issue 33): on a GPU each read waits for
every kernel before it. Counted on the CPU with tests/host_reads.py (the same calls, which there cost nothing);
forward and backward of one process, the torch backend. Expert parallelism: tests/fairseq_moe_layer/test_comm.py."""
import pytest
import torch

from fairseq_moe_layer import MoEConfig, MoELayer

from tests.host_reads import counted

BASE = dict(model_dim=8, ffn_dim=16, num_experts=4, top_k=2, kernel_backend="torch")


@pytest.mark.parametrize("name, settings, forward_reads", [
    ("top-2 dropless", dict(capacity_factor=0.0), 1),  # (the expert GEMMs' row counts)
    ("top-2 at capacity", dict(capacity_factor=1.0), 1),  # (the kept counts: routing reads them, the GEMMs reuse them)
    ("top-1 at capacity", dict(top_k=1, capacity_factor=1.0), 1),
    ("top-2, second expert by its weight (thinned)", dict(capacity_factor=0.0, second_expert_policy="random"), 1),
    ("top-2 at capacity, batch-prioritized", dict(capacity_factor=1.0, batch_prioritized_routing=True), 1),
    ("top-2 at capacity, thinned", dict(capacity_factor=1.0, second_expert_policy="random"), 1),
    ("top-2 at capacity, random token priority", dict(capacity_factor=1.0, random_token_selection=True), 1),
    ("top-2 dropless, a shared expert", dict(capacity_factor=0.0, shared_experts=1), 1),
    ("expert choice", dict(top_k=1, routing="expert_choice", capacity_factor=1.0), 0),  # (constant counts)
    ("dense", dict(top_k=1, routing="dense"), 0),
])
def test_one_read_per_forward_none_in_backward(name, settings, forward_reads):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**{**BASE, **settings}))
    x = torch.randn(3, 10, 8, requires_grad=True)
    with counted() as found:
        y, aux = layer(x)
    assert sum(found.values()) == forward_reads, (name, found)
    with counted() as found:
        ((y * y).sum() + aux.balance_loss + aux.z_loss).backward()
    assert not found, (name, found)


def test_a_padding_mask_is_one_read_more_once_per_mask():
    """The padding's positions are left out before routing (their number sizes everything after): one read, made once
    per mask tensor (kept on it): a second layer given the same mask (fairseq gives every layer of an encoder the
    same) reads only its counts."""
    torch.manual_seed(0)
    layers = [MoELayer(MoEConfig(**BASE, capacity_factor=1.0)) for _ in range(2)]
    x = torch.randn(3, 10, 8)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, 6:] = True
    for layer, reads in zip(layers, (2, 1)):
        with counted() as found:
            y, _ = layer(x, padding_mask=mask)
        assert sum(found.values()) == reads and any("nonzero" in k for k in found) == (reads == 2), found
        assert y[0, 6:].abs().sum() == 0 and y[0, :6].abs().sum() > 0


def test_hash_routing_reads_once_but_for_one_hots_check_on_the_cpu():
    """Hash routing at capacity: the kept counts (1); torch's one_hot checks its ids' range on the CPU only (2 more
    there, none on CUDA)."""
    layer = MoELayer(MoEConfig(**{**BASE, "top_k": 1, "routing": "hash", "capacity_factor": 1.0}))
    x = torch.randn(3, 10, 8)
    with counted() as found:
        layer(x, token_ids=torch.randint(0, 50, (3, 10)))
    outside_one_hot = {k: n for k, n in found.items() if "routing.py" not in k or n != 2}
    assert sum(found.values()) == 3 and len(outside_one_hot) == 1 and "host.py" in next(iter(outside_one_hot)), found


def test_kept_positions_follow_the_mask_and_do_not_hold_it():
    """What a mask keeps on itself is read again once the mask is changed in place, and does not keep the mask alive
    (a view of a tensor kept on that tensor would: a cycle Python's collector cannot see)."""
    import gc
    import weakref

    from fairseq_moe_layer.layer import _kept_positions

    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    assert _kept_positions(mask).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    mask[0, 4] = True  # in place
    assert _kept_positions(mask).tolist() == [0, 1, 2, 3, 5, 6, 7]
    gone = weakref.ref(mask)
    del mask
    gc.collect()
    assert gone() is None
