"""Top-k routing's scores (softmax or sigmoid), DeepSeek-V3's group-limited top-k and its aux-loss-free
balancing bias: against plain loops, and the bias balancing a skewed router by itself."""
import dataclasses

import pytest
import torch

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.routing import route

BASE = MoEConfig(model_dim=4, ffn_dim=4, num_experts=6, top_k=2)


def opts(**kw):
    return dataclasses.replace(BASE, **kw).validate()


def logits_for(seed, T=11, E=6):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def loop_choice(scores, k, bias=None, groups=1, topk_groups=None):
    """Each token's k experts, by a loop: the scores plus the bias, only among the experts of its
    topk_groups groups whose two best (biased) scores sum highest."""
    T, E = scores.shape
    size = E // groups
    out = []
    for t in range(T):
        choice = [float(scores[t, e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if topk_groups is not None:
            group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -group_score[g])[:topk_groups]
            allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
        out.append(sorted(allowed, key=lambda e: -choice[e])[:k])
    return out


def check(r, scores, chosen, k):
    """Routing r sends token t to exactly chosen[t], with the scores renormalised over them (k >= 2)."""
    got = {}
    rows = torch.split(torch.arange(r.token_index.numel()), r.counts.tolist())
    for e, idx in enumerate(rows):
        for i in idx.tolist():
            got.setdefault(int(r.token_index[i]), {})[e] = float(r.weights[i])
    for t, experts in enumerate(chosen):
        assert sorted(got[t]) == sorted(experts)
        total = sum(float(scores[t, e]) for e in experts)
        for e in experts:
            want = float(scores[t, e]) if k == 1 else float(scores[t, e]) / total
            assert got[t][e] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_sigmoid_scores(k):
    logits = logits_for(k)
    r = route(logits, k, None, cfg=opts(score="sigmoid", top_k=k))
    scores = torch.sigmoid(logits.float())
    check(r, scores, loop_choice(scores, k), k)
    torch.testing.assert_close(r.probs, scores / scores.sum(-1, keepdim=True))  # what the balance loss reads


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_chooses_but_does_not_weigh(score):
    logits = logits_for(3)
    bias = torch.tensor([0.0, 0.5, -0.3, 0.2, 0.0, 1.0])
    r = route(logits, 2, None, cfg=opts(score=score, bias_update_rate=0.1), bias=bias)
    scores = torch.sigmoid(logits.float()) if score == "sigmoid" else torch.softmax(logits.float(), -1)
    check(r, scores, loop_choice(scores, 2, bias), 2)
    assert loop_choice(scores, 2, bias) != loop_choice(scores, 2)  # the bias changed some choices


@pytest.mark.parametrize("groups, topk_groups, k", [(3, 1, 2), (3, 2, 3), (2, 1, 1), (6, 2, 2)])
def test_group_limited_top_k(groups, topk_groups, k):
    logits = logits_for(4 + groups)
    bias = torch.linspace(-0.2, 0.2, 6)
    o = opts(score="sigmoid", expert_groups=groups, topk_groups=topk_groups, top_k=k, bias_update_rate=0.1)
    r = route(logits, k, None, cfg=o, bias=bias)
    scores = torch.sigmoid(logits.float())
    chosen = loop_choice(scores, k, bias, groups, topk_groups)
    check(r, scores, chosen, k)
    size = 6 // groups
    assert all(len({e // size for e in experts}) <= topk_groups for experts in chosen)


def test_the_bias_balances_a_skewed_router():
    """With the router frozen on inputs that favour two experts, the bias alone (DeepSeek-V3's update,
    rate 0.01, a few hundred steps) brings the load close to even."""
    torch.manual_seed(0)
    layer = MoELayer(dataclasses.replace(BASE, score="sigmoid", bias_update_rate=0.01, capacity_factor=0.0))
    with torch.no_grad():
        layer.gate.weight[:2] += 1.5  # experts 0 and 1 score high for most inputs
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(1)).abs()

    def imbalance():
        return layer(x)[1].imbalance

    start = imbalance()
    layer._demand = None
    for _ in range(300):
        layer(x)
        layer.update_routing_bias()
    assert start > 2.0 and imbalance() < 1.5, (start, imbalance())  # (the sign update keeps a small wobble)
    assert layer.routing_bias[:2].max() < 0 < layer.routing_bias[2:].max()


def test_bias_is_state_and_loads_from_a_checkpoint_without_it():
    cfg = dataclasses.replace(BASE, bias_update_rate=0.05)
    layer = MoELayer(cfg)
    layer(torch.randn(7, 4))
    layer.update_routing_bias()
    state = layer.state_dict()
    assert "routing_bias" in state and state["routing_bias"].abs().sum() > 0
    other = MoELayer(cfg)
    other.load_state_dict(state)
    assert torch.equal(other.routing_bias, layer.routing_bias)
    plain = MoELayer(BASE).state_dict()  # trained without the bias
    other.load_state_dict(plain)
    assert not other.routing_bias.any()
    layer.eval()
    layer(torch.randn(5, 4))
    assert layer._demand is None  # only training forwards count toward the load


@pytest.mark.parametrize("overrides, flag", [
    (dict(score="tanh"), "--moe-score"),
    (dict(bias_update_rate=-1.0), "--moe-bias-update-rate"),
    (dict(bias_update_rate=0.1, routing="dense"), "--moe-bias-update-rate"),
    (dict(expert_groups=4), "--moe-expert-groups"),  # does not divide 6
    (dict(expert_groups=3, topk_groups=4), "--moe-topk-groups"),
    (dict(expert_groups=6, topk_groups=1, top_k=2), "--moe-topk-groups"),  # one expert to choose from
    (dict(second_expert_policy="sampling", score="sigmoid"), "--moe-second-expert-policy"),
    (dict(expert_groups=2), "--moe-topk-groups"),  # groups without a limit: nothing to do
    (dict(topk_groups=1), "--moe-topk-groups"),
    (dict(expert_groups=3, topk_groups=1, top_k=2, eval_top_k=3), "--moe-topk-groups"),  # eval k too
])
def test_settings_name_their_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(BASE, **overrides).validate()


def test_bias_stays_fp32_in_a_bf16_model():
    """A bf16 model keeps its balancing bias fp32: steps of 1e-3 on a bias near 0.5 are not rounded away."""
    layer = MoELayer(dataclasses.replace(BASE, score="sigmoid", bias_update_rate=0.001)).to(torch.bfloat16)
    assert layer.routing_bias.dtype == torch.float32 and layer.gate.weight.dtype == torch.bfloat16
    with torch.no_grad():
        layer.routing_bias.fill_(0.5)
    layer._demand = torch.tensor([9.0, 0, 0, 0, 0, 3.0])  # mean 2: expert 0 and 5 over, the rest under
    layer.update_routing_bias()
    torch.testing.assert_close(layer.routing_bias, torch.tensor([0.499, 0.501, 0.501, 0.501, 0.501, 0.499]))
    layer(torch.randn(5, 4, dtype=torch.bfloat16))  # and it still routes


def test_eval_top_k_turns_the_second_choice_options_off():
    """Trained with k = 2 and second-choice options, evaluated with --moe-eval-top-k 1: no error."""
    for option in (dict(second_expert_policy="random"), dict(normalize_gate_prob_before_dropping=True)):
        layer = MoELayer(dataclasses.replace(BASE, eval_top_k=1, **option)).eval()
        _, aux = layer(torch.randn(7, 4))
        assert aux.top_k == 1
