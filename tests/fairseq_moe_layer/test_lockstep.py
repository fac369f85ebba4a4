"""lockstep.py: ranks that call their MoE layers in different orders and numbers (inference) still get, from
each call, what one process holding every expert computes for the same tokens."""
import pytest
import torch
from torch import nn

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.comm import expert_parallel
from fairseq_moe_layer.lockstep import lockstep

from tests.fairseq_moe_layer.test_comm import spawn

# Each rank's calls: (layer, tokens). Rank 1 calls fewer layers, in another order; rank 2 (of 4) none at all.
CALLS = {0: [(0, 5), (1, 3), (0, 0), (1, 7), (0, 2)], 1: [(1, 4), (1, 6)], 2: [], 3: [(0, 9)]}


def _layers(ep, routing):
    cfgs = [MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=1 if routing == "hash" else 2, routing=routing,
                      capacity_factor=1.0, eval_capacity_token_fraction=0.5),
            MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=1, capacity_factor=0.0)]
    layers = []
    for i, cfg in enumerate(cfgs):
        torch.manual_seed(i)
        layers.append(MoELayer(cfg, ep).double().eval())
    return nn.ModuleList(layers)


def _check(rank, W, routing):
    full = _layers(None, routing)
    spread = _layers(expert_parallel(4), routing)
    with torch.no_grad(), lockstep(spread):
        for n, (index, T) in enumerate(CALLS[rank]):
            g = torch.Generator().manual_seed(10 * rank + n)
            x = torch.randn(T, 6, generator=g, dtype=torch.float64)
            ids = torch.randint(0, 50, (T,), generator=g)
            want, _ = full[index](x, token_ids=ids)
            got, aux = spread[index](x, token_ids=ids)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert aux.num_tokens == T
    # Off again: the same calls on every rank need no agreement.
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(spread[1](x)[0], full[1](x)[0], rtol=1e-12, atol=1e-12)
    assert not spread[0].ep.lockstep.on


@pytest.mark.slow
@pytest.mark.parametrize("W, routing", [(2, "topk"), (4, "topk"), (2, "hash")])
def test_ranks_with_different_calls_get_what_one_process_computes(W, routing):
    spawn(_check, W, routing)


def test_drain_makes_no_collective_without_layers_or_after_a_failed_call():
    """No layer yet (an error while the model is built) or a failed call of this group here (its peers may be in
    that call's all-to-all): drain leaves at once, with no collective (none could run here: no process group)."""
    from fairseq_moe_layer.lockstep import Lockstep, inference

    with pytest.raises(RuntimeError, match="while building"):
        with inference():
            Lockstep(None)
            raise RuntimeError("while building")
    step = Lockstep(None)
    step.on = True
    step.layers.append(object())
    step.broken = True
    step.drain()
