"""A throw-away routing policy and gate for the registration test (tests/fairseq_moe/test_init.py): registered
for one test only, each must get its flag, help, checks, refusals, contract tests and 2-rank check from the
registries alone, with no other edit."""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_moe_kernels.reference import sort_assignments
from fairseq_moe_layer.gates import GATES, register_gate
from fairseq_moe_layer.routing import ROUTINGS, Policy, Routing, _within_capacity, register_routing

POLICY, GATE = "throwaway_best", "throwaway_tanh"


class BestExpert(Policy):
    """Each token to its best expert alone, weighted by its probability; later tokens dropped at capacity."""

    help = "a throw-away policy of the registration test: each token to its best expert"
    balance_loss = False
    only_top_k = 1

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        T, E = logits.shape
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        best = probs.argmax(-1, keepdim=True)  # [T, 1]
        demand, order = sort_assignments(best, E)
        kept, counts = _within_capacity(order, demand, capacity)
        return Routing(token_index=kept, weights=probs.gather(1, best)[:, 0][kept], counts=counts, probs=probs,
                       top_experts=None, demand=demand, capacity=capacity,
                       dropped=1.0 - kept.numel() / T if T else 0.0)


class TanhGate(nn.Module):
    """logits = 3 tanh(x w^T): a gate with no .weight (the layer must not need one)."""

    help = "a throw-away gate of the registration test: 3 tanh(x w^T)"

    def __init__(self, model_dim, num_experts, fp32=True):
        super().__init__()
        self.fp32 = fp32
        self.w = nn.Parameter(torch.randn(num_experts, model_dim) * 0.3)

    def forward(self, x):  # x: [T, d] -> logits [T, E] fp32
        dtype = torch.float32 if self.fp32 else x.dtype
        return 3 * torch.tanh(F.linear(x.to(dtype), self.w.to(dtype)).float())


@contextlib.contextmanager
def registered():
    register_routing(POLICY)(BestExpert)
    register_gate(GATE)(TanhGate)
    try:
        yield
    finally:
        ROUTINGS.pop(POLICY)
        GATES.pop(GATE)


def check_on_ranks(rank, W):
    """On every rank (a spawned process: the registration is redone here): test_comm's checks of every policy
    and every gate, for the throw-away ones."""
    from tests.fairseq_moe_layer.test_comm import _every_gate, _every_policy, _run_all

    with registered():
        _run_all(rank, W, _every_policy([POLICY]) + _every_gate([GATE]))
