"""Slow, obvious oracles shared by the MoE tests: per-token Python loops, no sorting tricks."""
import torch
import torch.nn.functional as F

ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def gshard_kept(top_experts, capacity):
    """The (token, choice) pairs GShard's priority rule keeps: all first choices in token order,
    then all second choices in token order, ...; each expert takes assignments until it has
    `capacity` of them (None: no limit). Returns (kept set, {expert: [(choice, token), ...]})."""
    T, k = top_experts.shape
    taken = {}
    kept = set()
    for j in range(k):
        for t in range(T):
            e = int(top_experts[t, j])
            rows = taken.setdefault(e, [])
            if capacity is None or len(rows) < capacity:
                rows.append((j, t))
                kept.add((t, j))
    return kept, taken


def expected_routing(logits, k, capacity):
    """(token_index, weights, counts) that route() must return, built token by token."""
    T, E = logits.shape
    probs = torch.softmax(logits.float(), -1)
    top_p, top_e = probs.topk(k, -1)
    kept, taken = gshard_kept(top_e, capacity)
    token_index, weights = [], []
    for e in range(E):
        for j, t in taken.get(e, []):
            mine = [top_p[t, i] for i in range(k) if (t, i) in kept]
            token_index.append(t)
            weights.append(top_p[t, j] if k == 1 else top_p[t, j] / sum(mine))
    counts = [len(taken.get(e, [])) for e in range(E)]
    return torch.tensor(token_index, dtype=torch.long), torch.stack(weights), torch.tensor(counts)


def expert_mlp(x, e, w1, b1, w2, b2, activation="relu"):
    """Expert e on one token x [d]. swiglu (no biases): w1[e] [d, 2f] holds the gate's columns, then the up
    projection's; Shazeer (2020)'s (Swish_1(x W) * x V) W2."""
    if activation == "swiglu":
        f = w2.shape[1]
        return (F.silu(x @ w1[e][:, :f]) * (x @ w1[e][:, f:])) @ w2[e]
    return ACT[activation](x @ w1[e] + b1[e]) @ w2[e] + b2[e]


def moe_oracle(x, gate_weight, w1, b1, w2, b2, k, activation="relu", capacity=None, renormalize=True):
    """MoE layer on x [T, d] by a loop over tokens: softmax of the token's fp32 logits, top-k,
    weight = raw probability (k = 1, or not renormalize) or renormalised over the kept choices (k >= 2), sum of
    weight * expert MLP. Dropped choices (GShard priority, see gshard_kept) contribute nothing."""
    T = x.shape[0]
    logits = F.linear(x.float(), gate_weight.float())  # [T, E] fp32, the linear gate
    probs = [torch.softmax(logits[t], -1) for t in range(T)]
    tops = [p.topk(k) for p in probs]
    kept, _ = gshard_kept(torch.stack([e for _, e in tops]), capacity)
    out = []
    for t, (top_p, top_e) in enumerate(tops):
        mine = [j for j in range(k) if (t, j) in kept]
        y = torch.zeros_like(x[t])
        for j in mine:
            w = top_p[j] if k == 1 or not renormalize else top_p[j] / sum(top_p[i] for i in mine)
            y = y + w.to(x.dtype) * expert_mlp(x[t], int(top_e[j]), w1, b1, w2, b2, activation)
        out.append(y)
    return torch.stack(out)


def expert_choice_oracle(probs, capacity):
    """{expert: [(token, weight), ...] in token order}: each expert takes its `capacity` tokens of highest
    probability (probs [T, E]), looked at one expert and one token at a time."""
    T, E = probs.shape
    out = {}
    for e in range(E):
        ranked = sorted(range(T), key=lambda t: -float(probs[t, e].detach()))[:min(capacity, T)]
        out[e] = [(t, probs[t, e]) for t in sorted(ranked)]
    return out


def policy_oracle(x, gate_weight, w1, b1, w2, b2, routing, capacity=None, activation="relu"):
    """The layer's output for the expert_choice and dense policies, token by token: sum over the experts
    that took the token (expert choice) or over all experts (dense) of probability * expert MLP."""
    T, E = x.shape[0], w1.shape[0]
    probs = torch.softmax(F.linear(x.float(), gate_weight.float()), -1)
    if routing == "dense":
        taken = {e: [(t, probs[t, e]) for t in range(T)] for e in range(E)}
    else:
        taken = expert_choice_oracle(probs, capacity)
    out = [torch.zeros_like(x[t]) for t in range(T)]
    for e, rows in taken.items():
        for t, w in rows:
            out[t] = out[t] + w.to(x.dtype) * expert_mlp(x[t], e, w1, b1, w2, b2, activation)
    return torch.stack(out) if T else x.new_zeros(0, x.shape[1])


def topk_oracle(probs, k, capacity, order=None, before=False, valid=None):
    """(token_index, weights, counts) of top-k routing with the moe branch's options, built token by
    token: choice rank by choice rank, tokens in `order` (default: position); a choice (t, j) with
    valid[t][j] False asks for nothing; weights renormalised over the kept choices, or (before) over
    all k choices before dropping."""
    T, E = probs.shape
    top_p, top_e = probs.topk(k, -1)
    order = list(range(T)) if order is None else list(order)
    taken, kept = {}, set()
    for j in range(k):
        for t in order:
            if valid is not None and not valid[t][j]:
                continue
            rows = taken.setdefault(int(top_e[t, j]), [])
            if capacity is None or len(rows) < capacity:
                rows.append((j, t))
                kept.add((t, j))
    token_index, weights = [], []
    for e in range(E):
        for j, t in taken.get(e, []):
            denom = sum(top_p[t]) if before else sum(top_p[t, i] for i in range(k) if (t, i) in kept)
            token_index.append(t)
            weights.append(top_p[t, j] if k == 1 else top_p[t, j] / denom)
    counts = [len(taken.get(e, [])) for e in range(E)]
    return torch.tensor(token_index, dtype=torch.long), torch.stack(weights), torch.tensor(counts)


def soft_oracle(x, gate_weight, w1, b1, w2, b2, slots, padding=None, activation="relu", noise=None):
    """Soft MoE (Puigcerver et al. 2023) on x [G, n, d], group by group, slot by slot: slot s is the sum
    over the group's real tokens of softmax_tokens(logits[:, s]) * x; expert s // slots runs on it; token t
    gets the sum over slots of softmax_slots(logits[t]) * the slot's output. noise [G, n, S]: added to each
    token's logits (--moe-gate-noise gaussian)."""
    G, n, d = x.shape
    out = torch.zeros_like(x)
    for g in range(G):
        real = [t for t in range(n) if padding is None or not padding[g, t]]
        if not real:
            continue
        logits = torch.stack([F.linear(x[g, t].float(), gate_weight.float()) + (0 if noise is None else noise[g, t])
                              for t in real])  # [r, S]
        S = logits.shape[1]
        slot_out = []
        for s in range(S):
            w = torch.softmax(logits[:, s], 0)
            slot_in = sum(w[i].to(x.dtype) * x[g, t] for i, t in enumerate(real))
            slot_out.append(expert_mlp(slot_in, s // slots, w1, b1, w2, b2, activation))
        for i, t in enumerate(real):
            c = torch.softmax(logits[i], 0)
            out[g, t] = sum(c[s].to(x.dtype) * slot_out[s] for s in range(S))
    return out
