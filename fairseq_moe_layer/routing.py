"""Routing policies: from router logits to who goes where (--moe-routing; ROUTINGS is the registry).

A policy is one registered class (a Policy): its options (MoEConfig fields that only it reads, made with
options.setting), its checks (check), its properties (read by the layer, the checks, the refusals and the
fairseq glue, which spell no policy's name) and its route(): logits [T, E] -> a Routing, rows sorted by
expert, each with its token and its weight. A policy that does not route tokens one by one (slots) has its
own forward(layer, x, logits, padding_mask) instead. Either way the logits are the layer's
(MoELayer.router_logits: the gate and what the layer applies to them), made once per forward.
- topk: each token picks its k experts; GShard priority dropping at capacity C. All in fp32 and without any
  [T, E, C] tensor: the T*k assignments are ordered by priority, sorted by expert (a stable sort keeps the
  priority order inside each expert), and an assignment is kept if its rank inside its expert is below C.
- expert_choice (Zhou et al. 2022): each expert picks its top-C tokens; a token gets 0..E experts.
- dense: every token goes to every expert, weighted by the router probabilities (no selection at all).
- hash (Roller et al. 2021): a fixed map from the token id to an expert, no learned router.
- soft (Puigcerver et al. 2023): no routing of tokens at all; tokens are mixed into slots (its forward).

Letters: T tokens (of this rank, padding removed), E experts, k experts per token, C capacity (rows per
expert), N the rows kept (N <= T * k), d model dim; Soft MoE: G groups of n tokens, S = E * P slots.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from fairseq_moe_kernels import backend, host
from fairseq_moe_kernels.reference import sort_assignments

from .gates import registrar
from .losses import MoEAux, gate_entropy, router_z_loss
from .options import setting


@dataclass
class Routing:
    """Where each kept assignment goes. N = number of kept assignments (<= T*k).

    The N rows are sorted by expert, so expert e owns rows [offsets[e], offsets[e] + counts[e]).
    """

    token_index: torch.Tensor  # [N] long: the token each sorted row comes from
    weights: torch.Tensor  # [N] fp32: the factor its expert output is scaled by (has grad)
    counts: torch.Tensor  # [E] long: kept rows per expert
    probs: torch.Tensor  # [T, E] fp32: router probabilities (for the balance loss)
    top_experts: Optional[torch.Tensor]  # [T, k] long: the chosen experts, before dropping (policies with a
    # balance loss: it reads them; None where the policy balances the load by construction)
    demand: torch.Tensor  # [E] long: assignments per expert before dropping
    capacity: Optional[int]  # None when dropless
    dropped: Union[float, torch.Tensor] = 0.0  # what the policy's Policy.dropped says (a 0-d tensor: no host
    # read happens here)


class Policy:
    """A routing policy. Subclasses set the properties below, declare their options and implement route()."""

    name = None  # its --moe-routing value (set by register_routing)
    help = ""  # what it does, for --moe-routing's help and docs/flags.md
    options = {}  # MoEConfig field name -> options.setting(...): the settings only this policy reads
    mixes_tokens = False  # a token's routing depends on the other tokens of the batch: no causal decoder, and
    # padding is always kept out (it would change the real tokens' outputs)
    balance_loss = True  # route() returns top_experts: the balance loss and Shazeer's losses apply
    learned_router = True  # a gate computes its logits (False: no gate, no gate noise, no z-loss)
    needs_token_ids = False  # route() reads the token ids (the layer's token_ids=)
    slots = False  # tokens are mixed into slots, none is routed: forward() replaces the per-token data path,
    # on groups x [G, n, d] (a sentence each in fairseq)
    dropless = True  # has a dropless form (--moe-capacity-factor 0)
    has_capacity = True  # assignments over a capacity (MoEConfig.capacity) are dropped (False: none is ever
    # dropped, the capacity's settings have nothing to set)
    every_expert = False  # every token goes to every expert, weighted: no selection (top_k and the capacity are
    # not used)
    picks_by_score = False  # each token chooses its experts by the router's scores alone, among whichever experts
    # the layer has (fairseq_moe.prune may keep some of them)
    only_top_k = None  # the one k it takes (None: any k <= E)
    dropped = "the fraction of the T*k assignments over capacity"  # what Routing.dropped is for it

    def check(self, cfg):
        """Raise ValueError naming the flag, for settings this policy cannot take (beyond the generic checks
        of each setting's range, which MoEConfig.validate runs)."""

    def rows_per_token(self, cfg, k):
        """The most rows a token gets at k experts per token, known without reading the device (the Triton moe_mlp
        sizes its slots by it, and a token with more fails its device assert); None (here: a policy that does not
        say) where only the data tells."""
        return None

    def router_outputs(self, cfg):
        """Logits the gate computes per token."""
        return cfg.num_experts

    def at_k(self, cfg, k):
        """Options to reset for one call at k experts per token (MoELayer's top_k=): {field: value}."""
        return {}

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        """logits [T, E] fp32 (None without a learned router) -> Routing. cfg: the MoEConfig (None: the
        defaults of the policy's options); router: None or a fused op with the contract of
        fairseq_moe_kernels.reference.router; bias [E]: the balancing bias (topk)."""
        raise NotImplementedError

    def __call__(self, logits, top_k, capacity=None, router=None, cfg=None, training=False, bias=None,
                 token_ids=None):
        return self.route(logits, top_k, capacity, cfg, training, router=router, bias=bias, token_ids=token_ids)

    def setting(self, cfg, name):
        """The value of one of this policy's options in cfg (its default where cfg is None)."""
        return self.options[name].default if cfg is None else getattr(cfg, name)


ROUTINGS = {}  # name -> Policy instance
_register = registrar(ROUTINGS)
_SEALED = []  # not empty once MoEConfig is made (config.py): later policies can add no options


def register_routing(name):
    """@register_routing("name") on a Policy subclass: ROUTINGS[name] is an instance of it. A policy with
    options must be registered before MoEConfig is made (in this module), since they become its fields."""
    def wrap(cls):
        if cls.options and _SEALED:
            raise ValueError(f"routing policy {name!r} declares options ({', '.join(cls.options)}), but MoEConfig "
                             f"was made already: register it in fairseq_moe_layer/routing.py")
        cls.name = name
        _register(name)(cls())
        return cls
    return wrap


@register_routing("topk")
class TopK(Policy):
    """Top-k routing of logits[T, E] with GShard priority dropping.

    Options of fairseq's moe branch and DeepSpeed (below). Priority: every token's first choice comes before
    any token's second choice, and so on; inside one choice rank, earlier tokens first (or as the options
    say). Weights: for k = 1 the raw router probability (Switch: the router learns through the output), or 1
    with top1_weight "one"; for k >= 2 the probabilities renormalised over the choices that were kept
    (fairseq's moe branch). bias: [E] added to the scores for choosing only (the aux-loss-free balancing
    bias); weights are the scores themselves.
    """

    help = "each token picks its k experts"
    picks_by_score = True
    options = dict(
        second_expert_policy=setting(
            "all", "topk, training: choices 2..k are the best (all), drawn by Gumbel-max from the softmax of the "
                   "rest (sampling, the moe branch's default), or each kept with probability min(1, 2 x its "
                   "weight) before capacity (random)", choices=("all", "sampling", "random")),
        normalize_gate_prob_before_dropping=setting(
            False, "topk: renormalise the weights over the k choices before capacity dropping (a dropped choice "
                   "is lost weight) rather than over the kept ones"),
        batch_prioritized_routing=setting(
            False, "topk: at capacity, inside each choice rank, the tokens of highest router probability first "
                   "(BPR), not by position"),
        random_token_selection=setting(
            False, "topk, training: at capacity, tokens in a random order (DeepSpeed's RTS)"),
        score=setting(
            "softmax", "topk: the router's scores, softmax over the experts or a sigmoid per expert (DeepSeek-V3; "
                       "weights renormalised over the chosen for k >= 2)", choices=("softmax", "sigmoid")),
        top1_weight=setting(
            "prob", "topk with k = 1: the expert's output scaled by its router probability (Switch; the router "
                    "learns through the output) or taken as it is (the weight renormalised over the one choice, "
                    "as for k >= 2: Mixtral/Megatron; the router then learns from the balance and z losses "
                    "only; an upcycled model starts exactly dense)", choices=("prob", "one")),
        bias_update_rate=setting(
            0.0, "topk: DeepSeek-V3's aux-loss-free balancing: a per-expert bias added to the scores for choosing "
                 "only, moved by G toward balance (sign of mean load - load) after every update, from the load "
                 "of all ranks; checkpointed (needs an MoE task, whose optimizer step moves it)",
            ge=0, note="(0: no balancing bias)", metavar="G"),
        expert_groups=setting(
            1, "topk: group-limited routing (DeepSeek-V3), with --moe-topk-groups: the experts in G groups of "
               "E/G consecutive experts", ge=1, metavar="G"),
        topk_groups=setting(
            None, "topk: each token's experts come from its M groups whose two best scores sum highest (with "
                  "--moe-expert-groups; none: all groups)", type=int, ge=1, metavar="M"),
        topk_renormalize=setting(
            True, "topk with k >= 2: the weights are the scores renormalised over the chosen experts (GShard, "
                  "Mixtral, fairseq's moe branch) or, off, the router's probabilities as they are (Qwen2-MoE, "
                  "Qwen3-MoE and OLMoE: norm_topk_prob false; DeepSeek-V2)", negative="--no-moe-topk-renormalize"),
        routed_scaling_factor=setting(
            1.0, "topk: the routed experts' weights (after their renormalisation) times S, DeepSeek-V3's routed "
                 "scaling factor (2.5 there); shared experts are not scaled", gt=0, metavar="S"),
    )

    def check(self, cfg):
        bad = cfg.refuse
        for name in ("second_expert_policy", "normalize_gate_prob_before_dropping", "topk_renormalize"):
            if getattr(cfg, name) != self.options[name].default and cfg.top_k < 2:
                bad(name, f"applies to the second and later choices of --moe-routing {self.name} (here "
                          f"--moe-top-k {cfg.top_k})")
        if cfg.normalize_gate_prob_before_dropping and not cfg.topk_renormalize:
            bad("normalize_gate_prob_before_dropping", "says when the weights are renormalised, and "
                                                       "--no-moe-topk-renormalize that they are not")
        if cfg.batch_prioritized_routing and cfg.random_token_selection:
            bad("random_token_selection", "and --moe-batch-prioritized-routing are two different priorities: "
                                          "choose one")
        if cfg.num_experts % cfg.expert_groups:
            bad("expert_groups", f"must divide --moe-expert-count {cfg.num_experts}")
        if cfg.topk_groups is not None and cfg.topk_groups > cfg.expert_groups:
            bad("topk_groups", f"must be an integer in [1, --moe-expert-groups {cfg.expert_groups}]")
        if (cfg.expert_groups > 1) != (cfg.topk_groups is not None):
            bad("topk_groups", "and --moe-expert-groups G > 1 go together (group-limited routing needs both)")
        k_most = max(cfg.top_k, cfg.eval_top_k if isinstance(cfg.eval_top_k, int) else 0)
        if cfg.topk_groups is not None and k_most > cfg.topk_groups * (cfg.num_experts // cfg.expert_groups):
            bad("topk_groups", f"leaves fewer than --moe-top-k/--moe-eval-top-k {k_most} experts to choose from "
                               f"({cfg.topk_groups} groups of {cfg.num_experts // cfg.expert_groups})")
        if cfg.second_expert_policy == "sampling" and (cfg.score != "softmax" or cfg.bias_update_rate
                                                       or cfg.topk_groups is not None):
            bad("second_expert_policy", "sampling draws from the softmax over all the other experts: it cannot "
                                        "be combined with --moe-score sigmoid, --moe-bias-update-rate or "
                                        "--moe-topk-groups")

    def rows_per_token(self, cfg, k):
        return k  # (k distinct experts; fewer where dropped or thinned)

    def at_k(self, cfg, k):
        # With k = 1 the options of the second and later choices have nothing to act on: off.
        names = ("second_expert_policy", "normalize_gate_prob_before_dropping", "topk_renormalize")
        return {} if k > 1 else {name: self.options[name].default for name in names}

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        T, E = logits.shape
        opt = lambda name: self.setting(cfg, name)  # noqa: E731
        policy = opt("second_expert_policy") if top_k > 1 and training else "all"
        before = opt("normalize_gate_prob_before_dropping") and top_k > 1
        by_score = opt("batch_prioritized_routing")
        shuffle = opt("random_token_selection") and training
        score = opt("score")
        groups, topk_groups = opt("expert_groups"), opt("topk_groups")
        limited = groups > 1 and topk_groups is not None and topk_groups < groups
        if score == "sigmoid":
            scores = torch.sigmoid(logits.float())  # [T, E]
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
                first = probs.argmax(-1, keepdim=True)  # [T, 1]
                gumbel = -torch.empty_like(probs).exponential_().log()  # Gumbel(0, 1)
                rest = (logits.float() + gumbel).scatter(1, first, float("-inf")).topk(top_k - 1, dim=-1).indices
                top_experts = torch.cat([first, rest], 1)  # [T, k]
                top_probs = probs.gather(1, top_experts)
            else:
                top_experts = choice.topk(top_k, dim=-1).indices  # [T, k]
                top_probs = scores.gather(1, top_experts)
            if policy == "random":
                g = top_probs / top_probs.sum(-1, keepdim=True) if before else top_probs
                valid = torch.cat([torch.ones_like(g[:, :1], dtype=torch.bool),
                                   2 * g[:, 1:] > torch.rand_like(g[:, 1:])], 1)
            perm = (torch.randperm(T, device=logits.device) if shuffle else
                    torch.argsort(-probs.max(-1).values, stable=True) if by_score else None)  # [T] or None
            ranked = top_experts if perm is None else top_experts[perm]
            if valid is not None:  # a thinned choice asks for expert E, sorted after every real one
                ranked = torch.where(valid if perm is None else valid[perm], ranked, E)
            if valid is None:
                demand, order = sort_assignments(ranked, E)
            else:  # (the thinned choices, expert E, sorted after every real one: _within_capacity leaves them)
                demand, order = sort_assignments(ranked, E + 1)
                demand = demand[:E]
        # Assignment a = j * T + i is the j-th choice of the token of priority rank i (token perm[i]):
        # this flat order is the priority order, and order (sorted by expert, stable) keeps it inside
        # each expert.
        kept_order, counts = _within_capacity(order, demand, capacity, thinned=valid is not None)
        kept = torch.zeros(top_k * T, dtype=torch.bool, device=logits.device).index_fill_(0, kept_order, True)
        kept_tk = kept.view(top_k, T).t()  # [T, k], rows in priority order
        if perm is not None:
            kept_tk = torch.empty_like(kept_tk).index_copy_(0, perm, kept_tk)  # rows in token order
        if top_k == 1:
            weights = torch.ones_like(top_probs) if opt("top1_weight") == "one" else top_probs
        elif not opt("topk_renormalize"):  # (the scores as they are; a dropped choice's weight is lost)
            weights = top_probs * kept_tk
        elif before:
            weights = top_probs * kept_tk / top_probs.sum(-1, keepdim=True).clamp(
                min=torch.finfo(top_probs.dtype).eps)
        else:
            masked = top_probs * kept_tk
            denom = masked.sum(-1, keepdim=True).clamp(min=torch.finfo(masked.dtype).eps)
            weights = masked / denom
        if opt("routed_scaling_factor") != 1.0:  # (DeepSeek-V3: after the renormalisation, before the sum)
            weights = weights * opt("routed_scaling_factor")
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


route = ROUTINGS[TopK.name]  # top-k routing as a function: route(logits, top_k, capacity, router, cfg, ...)


def _within_capacity(order, demand, capacity, *, thinned=False):
    """(the assignments kept, kept per expert): in each expert, the first `capacity` in priority order. order: the
    assignments sorted by expert (demand[e] of expert e, one block after another; thinned: more after the last block,
    left out). Where the kept rows are fewer than order's, their number comes from the host's copy of the kept counts
    (host.routed: the layer's one read of the device, with what the other ranks send it where the experts are spread;
    the expert ops then reuse it); dropless and unthinned, none."""
    if capacity is None and not thinned:
        return order, demand
    counts = demand if capacity is None else demand.clamp(max=capacity)
    n = sum(host.routed(counts))
    if capacity is None:
        return order[:n], counts
    # Expert e keeps positions starts[e] .. starts[e] + counts[e] of order: kept row i of e sits at i + (where e's
    # block starts in order - where its kept rows start), without a boolean index (a read of the device per call).
    shift = (torch.cumsum(demand, 0) - demand) - (torch.cumsum(counts, 0) - counts)  # [E]
    offset = torch.repeat_interleave(shift, counts, output_size=n)
    return order[offset + torch.arange(n, device=order.device)], counts


@register_routing("hash")
class Hash(Policy):
    """Token id i goes to expert i mod E, with weight 1: over fairseq's dictionaries (sorted by frequency)
    a round-robin, i.e. Roller et al.'s balanced assignment of the vocabulary. No router, no logits; the
    same token always meets the same expert, in incremental decoding too. Over capacity, the later
    tokens (by position) are dropped. token_ids: [T] long (MoELayer's token_ids)."""

    help = "token id mod E, no router; k = 1"
    balance_loss = False
    learned_router = False
    needs_token_ids = True
    only_top_k = 1
    dropped = "the fraction of the tokens over capacity"

    def rows_per_token(self, cfg, k):
        return 1

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        if token_ids is None:
            raise ValueError(f"--moe-routing {self.name} routes by token id: call the layer with token_ids=")
        E = cfg.num_experts
        experts = token_ids.reshape(-1, 1).long() % E  # [T, 1]
        demand, order = sort_assignments(experts, E)
        kept_order, counts = _within_capacity(order, demand, capacity)
        T = experts.shape[0]
        return Routing(token_index=kept_order, weights=torch.ones(kept_order.numel(), device=experts.device),
                       counts=counts, probs=torch.nn.functional.one_hot(experts[:, 0], E).float(),
                       top_experts=None, demand=demand, capacity=capacity,
                       dropped=1.0 - kept_order.numel() / T if T else 0.0)


@register_routing("expert_choice")
class ExpertChoice(Policy):
    """Each expert takes the C tokens it scores highest (probabilities: softmax over the experts), with
    that probability as the weight; the rows of an expert are in token order. C = min(capacity, T):
    capacity comes from MoEConfig.capacity (ceil(capacity_factor * k * T / E) in training), so a token
    gets k experts on average."""

    help = "each expert picks its ceil(CF * k * tokens / experts) tokens; encoder layers only"
    mixes_tokens = True
    balance_loss = False
    dropless = False
    dropped = "the fraction of the tokens no expert took"


    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        T, E = logits.shape
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        C = min(capacity, T)
        top_w, top_t = probs.t().topk(C, dim=1)  # [E, C]: each expert's tokens by score
        top_t, order = top_t.sort(dim=1)
        token_index = top_t.reshape(-1)  # [E * C]
        counts = host.full(E, C, logits.device)
        taken = torch.zeros(T, dtype=torch.bool, device=logits.device).index_fill_(0, token_index, True)
        return Routing(token_index=token_index, weights=top_w.gather(1, order).reshape(-1), counts=counts,
                       probs=probs, top_experts=None, demand=counts, capacity=C,
                       dropped=1.0 - taken.float().mean() if T else 0.0)


@register_routing("dense")
class Dense(Policy):
    """Every token to every expert, weighted by its router probability: y = sum_e p_e(x) expert_e(x).
    No selection, no capacity, nothing dropped (top_k and capacity are not used)."""

    help = "every token to every expert, weighted"
    balance_loss = False
    has_capacity = False
    every_expert = True
    dropped = "always 0"

    def rows_per_token(self, cfg, k):
        return cfg.num_experts  # (every expert, once)

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        T, E = logits.shape
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        counts = host.full(E, T, logits.device)
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
class Soft(Policy):
    """Soft MoE on x [G, n, d] (G groups of n tokens; [n, d]: one group): each expert's P slots are
    mixtures of a group's tokens, each token a mixture of its group's slot outputs (soft_weights)."""

    help = "Soft MoE: slots mixing the tokens of a sentence; encoder layers only"
    options = dict(soft_slots=setting(1, "soft: slots per expert", ge=1, metavar="P"))
    mixes_tokens = True
    balance_loss = False
    slots = True
    has_capacity = False
    dropped = "always 0"

    def router_outputs(self, cfg):
        return cfg.num_experts * cfg.soft_slots  # one logit per slot

    def route(self, logits, top_k, capacity, cfg, training=False, router=None, bias=None, token_ids=None):
        raise ValueError(f"--moe-routing {self.name} mixes tokens into slots (its forward): it routes no token")

    def forward(self, layer, x, logits, padding_mask=None):
        """MoELayer.forward for this policy: (y [G, n, d] or [n, d], MoEAux). logits [G * n, E * P]: the layer's
        (MoELayer.router_logits of x's positions, padding too, in order)."""
        cfg = layer.cfg
        shape = x.shape
        if x.dim() not in (2, 3):
            raise ValueError(f"--moe-routing {self.name} takes x [groups, tokens, d] or [tokens, d], "
                             f"not {tuple(shape)}")
        if padding_mask is not None and padding_mask.shape != shape[:-1]:
            raise ValueError(f"padding_mask {tuple(padding_mask.shape)} must match x{tuple(shape[:-1])}")
        x = x.reshape(shape[0] if x.dim() == 3 else 1, shape[-2], shape[-1])  # [G, n, d] (n = 0 too)
        mask = None if padding_mask is None else padding_mask.reshape(x.shape[:2]).bool()  # [G, n]
        G, n, d = x.shape
        E, P = cfg.num_experts, cfg.soft_slots
        dtype = layer.experts.compute_dtype(x)  # autocast's where it is on
        ops = backend.ops(backend.resolve(cfg.kernel_backend, x.device, dtype))
        logits = logits.view(G, n, E * P)
        dispatch, combine = soft_weights(logits, mask)  # [G, n, E*P], fp32
        slots = torch.einsum("gns,gnd->gsd", dispatch.to(x.dtype), x)  # [G, E*P, d]
        # [E*G*P, d] sorted by expert, cast before they travel (as the top-k policies' rows)
        rows = slots.view(G, E, P, d).transpose(0, 1).reshape(E * G * P, d).to(dtype)
        counts = host.full(E, G * P, x.device)  # [E]
        out = layer.experts(rows, counts, ops) if layer.ep is None else layer.remote(rows, counts, ops)
        out = out.view(E, G, P, d).transpose(0, 1).reshape(G, E * P, d)  # [G, E*P, d]
        y = torch.einsum("gns,gsd->gnd", combine.to(x.dtype), out)  # [G, n, d]
        if layer.shared is not None:
            y = y + layer.shared.all_tokens(x.reshape(-1, d), ops).view(G, n, d)
        if mask is not None:
            y = y.masked_fill(mask.unsqueeze(-1), 0.0)
        real = logits.reshape(G * n, E * P) if mask is None else logits[~mask]  # [T, E*P] of the real tokens
        T = real.shape[0]
        zero = logits.sum() * 0.0  # a zero that belongs to the graph (of every gate parameter)
        # demand: how much of the tokens' outputs each expert provides (the combine weights it gets).
        demand = (combine.reshape(G * n, E * P) if mask is None else combine[~mask]).sum(0).view(E, P).sum(1)
        aux = MoEAux(zero, router_z_loss(real) if T else zero, demand.detach(), counts, T, 1,
                     gate_entropy(torch.softmax(real.detach().float(), -1)) if T else zero.detach())
        return y.view(shape), aux
