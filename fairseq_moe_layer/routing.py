"""Routing policies: from router logits to who goes where (--moe-routing; ROUTINGS is the registry).

A policy maps logits [T, E] to a Routing: rows sorted by expert, each with its token and its weight.
- topk (route): each token picks its k experts; GShard priority dropping at capacity C. All in fp32
  and without any [T, E, C] tensor: the T*k assignments are ordered by priority, sorted by expert (a
  stable sort keeps the priority order inside each expert), and an assignment is kept if its rank
  inside its expert is below C.
- expert_choice (Zhou et al. 2022): each expert picks its top-C tokens; a token gets 0..E experts.
- dense: every token goes to every expert, weighted by the router probabilities (no selection at all).
- hash (Roller et al. 2021): a fixed map from the token id to an expert, no learned router.
- soft (Puigcerver et al. 2023): no routing of tokens at all; MoELayer mixes tokens into slots
  (soft_weights); registered here so that --moe-routing offers it.

Letters: T tokens (of this rank, padding removed), E experts, k experts per token, C capacity (rows per
expert), N the rows kept (N <= T * k).
"""
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_moe_kernels.reference import sort_assignments

from .gates import registrar


@dataclass
class Routing:
    """Where each kept assignment goes. N = number of kept assignments (<= T*k).

    The N rows are sorted by expert, so expert e owns rows [offsets[e], offsets[e] + counts[e]).
    """

    token_index: torch.Tensor  # [N] long: the token each sorted row comes from
    weights: torch.Tensor  # [N] fp32: the factor its expert output is scaled by (has grad)
    counts: torch.Tensor  # [E] long: kept rows per expert
    probs: torch.Tensor  # [T, E] fp32: router probabilities (for the balance loss)
    top_experts: Optional[torch.Tensor]  # [T, k] long: the chosen experts, before dropping (topk only:
    # the balance loss reads it; None where the policy balances the load by construction)
    demand: torch.Tensor  # [E] long: assignments per expert before dropping
    capacity: Optional[int]  # None when dropless
    dropped: object = 0.0  # (a number, or a 0-d tensor so that no host read happens here) topk: the
    # fraction of the T*k assignments dropped; expert_choice: of the
    # tokens no expert took


ROUTINGS = {}  # name -> fn(logits [T, E], top_k, capacity, router, options, training, bias, token_ids) -> Routing
register_routing = registrar(ROUTINGS)


@register_routing("topk")
def route(logits, top_k, capacity=None, router=None, options=None, training=False, bias=None, token_ids=None):
    """Top-k routing of logits[T, E] with GShard priority dropping.

    router: None (torch ops here) or a fused op with the contract of fairseq_moe_kernels.reference.router
    (used when no option below changes the selection or the priority).
    options: the MoEConfig (None: the defaults), for the options of fairseq's moe branch and DeepSpeed:
    - second_expert_policy: "all" (the k best), "sampling" (choices 2..k drawn by the Gumbel-max trick
      from the softmax over the experts not chosen yet), "random" (choice j >= 2 kept with probability
      min(1, 2 * its weight), before capacity); both in training only.
    - normalize_gate_prob_before_dropping: weights renormalised over the k choices before dropping
      (a dropped choice is then lost weight), instead of over the kept ones after.
    - batch_prioritized_routing: inside one choice rank, tokens by their highest probability, not by
      position; random_token_selection (training only): in a random order.
    - score: "softmax" over the experts, or "sigmoid" per expert (DeepSeek-V3; the balance loss and the
      entropy then read the scores normalised over the experts).
    - expert_groups G, topk_groups M: the k experts come from the M groups (of E / G consecutive experts)
      whose two best scores sum highest (DeepSeek-V3's group-limited routing).
    bias: [E] added to the scores for choosing only (the aux-loss-free balancing bias); weights are the
    scores themselves.

    Priority: every token's first choice comes before any token's second choice, and so on;
    inside one choice rank, earlier tokens first (or as the options say). Weights: for k = 1 the raw
    router probability (Switch: the router learns through the output), or 1 with top1_weight "one"; for
    k >= 2 the probabilities
    renormalised over the choices that were kept (fairseq's moe branch).
    """
    T, E = logits.shape
    policy = getattr(options, "second_expert_policy", "all") if top_k > 1 and training else "all"
    before = getattr(options, "normalize_gate_prob_before_dropping", False) and top_k > 1
    by_score = getattr(options, "batch_prioritized_routing", False)
    shuffle = getattr(options, "random_token_selection", False) and training
    score = getattr(options, "score", "softmax")
    groups, topk_groups = getattr(options, "expert_groups", 1), getattr(options, "topk_groups", None)
    limited = groups > 1 and topk_groups is not None and topk_groups < groups
    if score == "sigmoid":
        scores = torch.sigmoid(logits.float())
        probs = scores / scores.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)
    else:
        probs = scores = torch.softmax(logits.float(), dim=-1)  # [T, E], also what the balance loss reads
    valid = None  # [T, k] bool: the choices that ask for an expert (policy "random" thins them)
    if router is not None and policy == "all" and not (by_score or shuffle or limited) and bias is None:
        # a fused kernel with fairseq_moe_kernels.reference.router's contract (raw scores)
        top_probs, top_experts, demand, order = router(logits, top_k, score=score)
        perm = None
    else:
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if limited:  # only the experts of the topk_groups best groups may be chosen
            grouped = choice.view(T, groups, E // groups)
            group_score = grouped.topk(min(2, E // groups), dim=-1).values.sum(-1)  # [T, G]
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(topk_groups, dim=-1).indices, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(E // groups, dim=1), float("-inf"))
        if policy == "sampling":
            first = probs.argmax(-1, keepdim=True)
            gumbel = -torch.empty_like(probs).exponential_().log()  # Gumbel(0, 1)
            rest = (logits.float() + gumbel).scatter(1, first, float("-inf")).topk(top_k - 1, dim=-1).indices
            top_experts = torch.cat([first, rest], 1)
            top_probs = probs.gather(1, top_experts)
        else:
            top_experts = choice.topk(top_k, dim=-1).indices  # [T, k]
            top_probs = scores.gather(1, top_experts)
        if policy == "random":
            g = top_probs / top_probs.sum(-1, keepdim=True) if before else top_probs
            valid = torch.cat([torch.ones_like(g[:, :1], dtype=torch.bool),
                               2 * g[:, 1:] > torch.rand_like(g[:, 1:])], 1)
        perm = (torch.randperm(T, device=logits.device) if shuffle else
                torch.argsort(-probs.max(-1).values, stable=True) if by_score else None)
        ranked = top_experts if perm is None else top_experts[perm]
        if valid is not None:  # a thinned choice asks for expert E, sorted after every real one
            ranked = torch.where(valid if perm is None else valid[perm], ranked, E)
        demand, order = sort_assignments(ranked, E + 1)
        demand, order = demand[:E], order[:int(demand[:E].sum())]
    # Assignment a = j * T + i is the j-th choice of the token of priority rank i (token perm[i]):
    # this flat order is the priority order, and order (sorted by expert, stable) keeps it inside
    # each expert.
    flat_expert = (top_experts if perm is None else top_experts[perm]).t().reshape(-1)  # [k*T]
    kept_order, counts = _within_capacity(order, flat_expert, demand, capacity)
    kept = torch.zeros(top_k * T, dtype=torch.bool, device=logits.device).index_fill_(0, kept_order, True)
    kept_tk = kept.view(top_k, T).t()  # [T, k], rows in priority order
    if perm is not None:
        kept_tk = torch.empty_like(kept_tk).index_copy_(0, perm, kept_tk)  # rows in token order
    if top_k == 1:
        one = getattr(options, "top1_weight", "prob") == "one"
        weights = torch.ones_like(top_probs) if one else top_probs
    elif before:
        weights = top_probs * kept_tk / top_probs.sum(-1, keepdim=True).clamp(min=torch.finfo(top_probs.dtype).eps)
    else:
        masked = top_probs * kept_tk
        denom = masked.sum(-1, keepdim=True).clamp(min=torch.finfo(masked.dtype).eps)
        weights = masked / denom
    flat_weights = (weights if perm is None else weights[perm]).t().reshape(-1)  # [k*T] in assignment order
    token_index = kept_order % T
    return Routing(
        token_index=token_index if perm is None else perm[token_index],
        weights=flat_weights[kept_order],
        counts=counts,
        probs=probs,
        top_experts=top_experts,
        demand=demand,
        capacity=capacity,
        dropped=1.0 - kept_order.numel() / demand.sum().clamp(min=1),
    )


def _within_capacity(order, flat_expert, demand, capacity):
    """(the assignments kept, kept per expert): in each expert, the first `capacity` in priority order."""
    if capacity is None:
        return order, demand
    starts = torch.cumsum(demand, 0) - demand  # [E] first sorted row of each expert
    rank = torch.arange(order.numel(), device=order.device) - starts[flat_expert[order]]
    return order[rank < capacity], demand.clamp(max=capacity)


@register_routing("hash")
def hash_routing(logits, top_k, capacity=None, router=None, options=None, training=False, bias=None,
                 token_ids=None):
    """Token id i goes to expert i mod E, with weight 1: over fairseq's dictionaries (sorted by frequency)
    a round-robin, i.e. Roller et al.'s balanced assignment of the vocabulary. No router, no logits; the
    same token always meets the same expert, in incremental decoding too. Over capacity, the later
    tokens (by position) are dropped. token_ids: [T] long (MoELayer's token_ids)."""
    if token_ids is None:
        raise ValueError("--moe-routing hash routes by token id: call the layer with token_ids=")
    E = options.num_experts
    experts = token_ids.reshape(-1, 1).long() % E  # [T, 1]
    demand, order = sort_assignments(experts, E)
    kept_order, counts = _within_capacity(order, experts[:, 0], demand, capacity)
    T = experts.shape[0]
    return Routing(token_index=kept_order, weights=torch.ones(kept_order.numel(), device=experts.device),
                   counts=counts, probs=torch.nn.functional.one_hot(experts[:, 0], E).float(), top_experts=None,
                   demand=demand, capacity=capacity, dropped=1.0 - kept_order.numel() / T if T else 0.0)


@register_routing("expert_choice")
def expert_choice(logits, top_k, capacity, router=None, options=None, training=False, bias=None, token_ids=None):
    """Each expert takes the C tokens it scores highest (probabilities: softmax over the experts), with
    that probability as the weight; the rows of an expert are in token order. C = min(capacity, T):
    capacity comes from MoEConfig.capacity (ceil(capacity_factor * k * T / E) in training), so a token
    gets k experts on average. Mixes tokens: the choice for one token depends on the others."""
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    C = min(capacity, T)
    top_w, top_t = probs.t().topk(C, dim=1)  # [E, C]: each expert's tokens by score
    top_t, order = top_t.sort(dim=1)
    token_index = top_t.reshape(-1)
    counts = torch.full((E,), C, dtype=torch.long, device=logits.device)
    taken = torch.zeros(T, dtype=torch.bool, device=logits.device).index_fill_(0, token_index, True)
    return Routing(token_index=token_index, weights=top_w.gather(1, order).reshape(-1), counts=counts,
                   probs=probs, top_experts=None, demand=counts, capacity=C,
                   dropped=1.0 - taken.float().mean() if T else 0.0)


@register_routing("dense")
def dense(logits, top_k, capacity=None, router=None, options=None, training=False, bias=None, token_ids=None):
    """Every token to every expert, weighted by its router probability: y = sum_e p_e(x) expert_e(x).
    No selection, no capacity, nothing dropped (top_k and capacity are not used)."""
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    counts = torch.full((E,), T, dtype=torch.long, device=logits.device)
    return Routing(token_index=torch.arange(T, device=logits.device).repeat(E), weights=probs.t().reshape(-1),
                   counts=counts, probs=probs, top_experts=None, demand=counts, capacity=None)


def soft_weights(logits, padding_mask=None):
    """Soft MoE's (dispatch, combine) weights from the slot logits [G, n, S] of G groups of n tokens:
    dispatch softmaxes over the tokens of a group (each slot is a mixture of tokens), combine over the
    slots (each token a mixture of slot outputs). Padding takes no part in any slot (dispatch 0); a
    group of padding only dispatches nothing."""
    logits = logits.float()
    if padding_mask is not None:
        logits = logits.masked_fill(padding_mask.unsqueeze(-1), float("-inf"))
    dispatch = torch.nan_to_num(torch.softmax(logits, dim=1), nan=0.0)
    combine = torch.nan_to_num(torch.softmax(logits, dim=2), nan=0.0)
    return dispatch, combine


@register_routing("soft")
def soft(logits, top_k, capacity=None, router=None, options=None, training=False, bias=None, token_ids=None):
    raise ValueError("--moe-routing soft mixes tokens into slots inside MoELayer: it has no per-token routing")


soft.slots = True  # (not a per-token policy: MoELayer takes the soft path; the contract test skips it)
