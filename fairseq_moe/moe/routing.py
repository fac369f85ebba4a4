"""Routing: from router logits to who goes where, with capacity and dropping.

All in fp32 and without any [T, E, C] tensor: the T*k assignments are ordered by priority, sorted
by expert (a stable sort keeps the priority order inside each expert), and an assignment is kept if
its rank inside its expert is below the capacity C.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_moe_kernels.reference import sort_assignments


@dataclass
class Routing:
    """Where each kept assignment goes. N = number of kept assignments (<= T*k).

    The N rows are sorted by expert, so expert e owns rows [offsets[e], offsets[e] + counts[e]).
    """

    token_index: torch.Tensor  # [N] long: the token each sorted row comes from
    weights: torch.Tensor  # [N] fp32: the factor its expert output is scaled by (has grad)
    counts: torch.Tensor  # [E] long: kept rows per expert
    probs: torch.Tensor  # [T, E] fp32: router probabilities (for the balance loss)
    top_experts: torch.Tensor  # [T, k] long: the chosen experts, before dropping
    demand: torch.Tensor  # [E] long: assignments per expert before dropping
    capacity: Optional[int]  # None when dropless


def route(logits, top_k, capacity=None, router=None):
    """Top-k routing of logits[T, E] with GShard priority dropping.

    router: None (torch ops here) or a fused op with the contract of fairseq_moe_kernels.reference.router.

    Priority: every token's first choice comes before any token's second choice, and so on;
    inside one choice rank, earlier tokens first. Weights: for k = 1 the raw router probability
    (Switch: the router learns through the output); for k >= 2 the probabilities renormalised
    over the choices that were kept (fairseq's moe branch).
    """
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E], also what the balance loss reads
    if router is None:
        top_probs, top_experts = probs.topk(top_k, dim=-1)  # [T, k]
        demand, order = sort_assignments(top_experts, E)
    else:  # a fused kernel with fairseq_moe_kernels.reference.router's contract (raw probabilities)
        top_probs, top_experts, demand, order = router(logits, top_k)
    # Assignment a = j * T + t is token t's j-th choice: this flat order is the priority order, and
    # order (sorted by expert, stable) keeps it inside each expert.
    flat_expert = top_experts.t().reshape(-1)  # [k*T]
    if capacity is None:
        kept_order = order
        counts = demand
        kept = torch.ones_like(flat_expert, dtype=torch.bool)
    else:
        starts = torch.cumsum(demand, 0) - demand  # [E] first sorted row of each expert
        rank = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
        keep_sorted = rank < capacity
        kept_order = order[keep_sorted]
        counts = demand.clamp(max=capacity)
        kept = torch.zeros_like(flat_expert, dtype=torch.bool)
        kept[order] = keep_sorted

    if top_k == 1:
        weights = top_probs
    else:
        kept_tk = kept.view(top_k, T).t()  # [T, k]
        masked = top_probs * kept_tk
        denom = masked.sum(-1, keepdim=True).clamp(min=torch.finfo(masked.dtype).eps)
        weights = masked / denom
    flat_weights = weights.t().reshape(-1)  # [k*T] in assignment order
    return Routing(
        token_index=kept_order % T,
        weights=flat_weights[kept_order],
        counts=counts,
        probs=probs,
        top_experts=top_experts,
        demand=demand,
        capacity=capacity,
    )
