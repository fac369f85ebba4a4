"""The options of top-k routing from fairseq's moe branch and DeepSpeed, against plain loops (the
deterministic ones) and by their statistics (the random ones, which are training-only)."""
import dataclasses

import pytest
import torch

from fairseq_moe_layer import MoEConfig
from fairseq_moe_layer.routing import route

from tests.fairseq_moe_layer.oracle import topk_oracle

BASE = MoEConfig(model_dim=4, ffn_dim=4, num_experts=5, top_k=2)


def opts(**kw):
    return dataclasses.replace(BASE, **kw).validate()


def logits_for(seed, T=17, E=5):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 1.5


def check(r, want):
    token_index, weights, counts = want
    assert r.counts.tolist() == counts.tolist()
    assert r.token_index.tolist() == token_index.tolist()
    torch.testing.assert_close(r.weights, weights.float())


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("k, capacity", [(1, 3), (2, 4), (2, None)])
def test_batch_prioritized_routing(k, capacity, training):
    """Inside each choice rank the tokens of highest probability come first (in eval too)."""
    logits = logits_for(k)
    probs = torch.softmax(logits, -1)
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t].max()))
    r = route(logits, k, capacity, cfg=opts(top_k=k, batch_prioritized_routing=True), training=training)
    check(r, topk_oracle(probs, k, capacity, order=order))
    plain = route(logits, k, capacity)
    if capacity == 3:
        assert r.token_index.tolist() != plain.token_index.tolist()  # the option changed who is dropped


@pytest.mark.parametrize("capacity", [3, None])
def test_normalize_gate_prob_before_dropping(capacity):
    logits = logits_for(7)
    r = route(logits, 2, capacity, cfg=opts(normalize_gate_prob_before_dropping=True), training=True)
    check(r, topk_oracle(torch.softmax(logits, -1), 2, capacity, before=True))


def test_second_expert_sampling_draws_from_the_rest():
    """The second expert: never the first, drawn with the softmax probabilities of the others
    (Gumbel-max); eval picks the k best."""
    T = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(T, 1)
    torch.manual_seed(0)
    r = route(logits, 2, None, cfg=opts(second_expert_policy="sampling"), training=True)
    assert bool((r.top_experts[:, 0] == 0).all()) and bool((r.top_experts[:, 1] != 0).all())
    freq = torch.bincount(r.top_experts[:, 1], minlength=5).float() / T
    want = torch.softmax(logits[0, 1:], -1)
    torch.testing.assert_close(freq[1:], want, atol=0.015, rtol=0)
    # The weights are the probabilities of the experts drawn, renormalised over the two.
    p = torch.softmax(logits[0], -1)
    t = 5
    first, second = int(r.top_experts[t, 0]), int(r.top_experts[t, 1])
    rows = {e: r.weights[r.token_index == t][i] for i, e in enumerate(sorted({first, second}))}
    assert rows[first] == pytest.approx(float(p[first] / (p[first] + p[second])), rel=1e-5)
    ev = route(logits[:10], 2, None, cfg=opts(second_expert_policy="sampling"), training=False)
    assert ev.top_experts[:, 1].tolist() == [1] * 10


@pytest.mark.parametrize("before", [False, True])
def test_second_expert_random_keeps_it_with_twice_its_weight(before):
    T = 20000
    logits = torch.tensor([[1.0, 0.6, -0.5, -1.0, -2.0]]).repeat(T, 1)
    p = torch.softmax(logits[0], -1)
    g2 = float(p[1] / (p[0] + p[1])) if before else float(p[1])
    torch.manual_seed(1)
    r = route(logits, 2, None, cfg=opts(second_expert_policy="random",
                                           normalize_gate_prob_before_dropping=before), training=True)
    assert r.counts[0] == T  # every first choice
    assert float(r.counts[1]) / T == pytest.approx(min(1.0, 2 * g2), abs=0.015)
    lone = r.token_index[:T][~torch.isin(r.token_index[:T], r.token_index[T:])]
    w = r.weights[:T][~torch.isin(r.token_index[:T], r.token_index[T:])]
    # A token whose second choice was thinned keeps the first expert alone: weight 1, or p1 / (p1 + p2)
    # when normalised before.
    assert lone.numel() > 0 and torch.allclose(w, torch.full_like(w, float(p[0] / (p[0] + p[1])) if before else 1.0))
    assert float(r.dropped) == 0.0  # thinned choices are not counted as dropped
    ev = route(logits[:10], 2, None, cfg=opts(second_expert_policy="random"), training=False)
    assert ev.counts.tolist()[:2] == [10, 10]


def test_random_token_selection():
    """Each expert keeps min(demand, C) of the tokens that chose it, a random subset in training;
    position order at eval."""
    logits = logits_for(3, T=40)
    o = opts(random_token_selection=True)
    torch.manual_seed(0)
    a = route(logits, 2, 6, cfg=o, training=True)
    torch.manual_seed(1)
    b = route(logits, 2, 6, cfg=o, training=True)
    plain = route(logits, 2, 6)
    assert a.counts.tolist() == plain.counts.tolist() == b.counts.tolist()
    assert sorted(a.token_index.tolist()) != sorted(b.token_index.tolist())
    for r in (a, b):
        for e, rows in enumerate(torch.split(r.token_index, r.counts.tolist())):
            assert all(e in r.top_experts[t].tolist() for t in rows.tolist())
    ev = route(logits, 2, 6, cfg=o, training=False)
    assert ev.token_index.tolist() == plain.token_index.tolist()


@pytest.mark.parametrize("overrides, flag", [
    (dict(second_expert_policy="coin"), "--moe-second-expert-policy"),
    (dict(second_expert_policy="sampling", top_k=1), "--moe-second-expert-policy"),
    (dict(normalize_gate_prob_before_dropping=True, routing="dense"), "--moe-normalize-gate-prob-before-dropping"),
    (dict(batch_prioritized_routing=True, random_token_selection=True), "--moe-random-token-selection"),
    (dict(random_token_selection=True, routing="expert_choice"), "--moe-random-token-selection"),
    (dict(expert_grad_normalization="cube_root"), "--moe-normalize-expert-grad"),
    (dict(top1_weight="half"), "--moe-top1-weight"),
    (dict(top1_weight="one", routing="dense"), "--moe-top1-weight"),
    (dict(routed_scaling_factor=0.0), "--moe-routed-scaling-factor"),
    (dict(routed_scaling_factor=2.5, routing="hash", top_k=1), "--moe-routed-scaling-factor"),
    (dict(topk_renormalize=False, top_k=1), "--moe-topk-renormalize"),
    (dict(topk_renormalize=False, normalize_gate_prob_before_dropping=True), "--moe-normalize-gate-prob-before"),
])
def test_options_name_their_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(BASE, **overrides).validate()


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k, capacity", [(1, 3), (2, 4), (3, None)])
def test_routed_scaling_factor(k, capacity, score):
    """DeepSeek-V3's routed scaling factor: the weights as without it (renormalised over the kept choices; the raw
    score at k = 1), times S; the same choices and drops."""
    logits = logits_for(k + 10)
    scores = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    want = topk_oracle(scores / scores.sum(-1, keepdim=True) if score == "sigmoid" else scores, k, capacity)
    r = route(logits, k, capacity, cfg=opts(top_k=k, score=score, routed_scaling_factor=2.5))
    assert r.token_index.tolist() == want[0].tolist() and r.counts.tolist() == want[2].tolist()
    if k > 1 or score == "softmax":  # (k = 1 with sigmoid: the raw sigmoid, not the normalised scores)
        torch.testing.assert_close(r.weights, 2.5 * want[1].float())
    plain = route(logits, k, capacity, cfg=opts(top_k=k, score=score))
    torch.testing.assert_close(r.weights, 2.5 * plain.weights)


@pytest.mark.parametrize("capacity", [3, None])
def test_top1_weight_one(capacity):
    """k = 1 with top1_weight "one": the same choices and drops as Switch's, every kept row weighted 1."""
    logits = logits_for(5)
    prob = route(logits, 1, capacity, cfg=opts(top_k=1))
    one = route(logits, 1, capacity, cfg=opts(top_k=1, top1_weight="one"))
    assert one.token_index.tolist() == prob.token_index.tolist() and one.counts.tolist() == prob.counts.tolist()
    assert prob.weights.lt(1).all() and one.weights.eq(1).all()
    # At k >= 2 the weights are renormalised over the kept choices anyway: the option changes nothing.
    two = [route(logits, 2, capacity, cfg=opts(top1_weight=w)) for w in ("prob", "one")]
    torch.testing.assert_close(two[0].weights, two[1].weights)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k, capacity", [(2, 4), (3, None)])
def test_topk_without_renormalisation(k, capacity, score):
    """--no-moe-topk-renormalize (Qwen2-MoE, Qwen3-MoE, OLMoE: norm_topk_prob false): the same choices and drops,
    each kept row weighted by its token's score for that expert as it is (the raw sigmoid for sigmoid, as DeepSeek)."""
    logits = logits_for(k + 20)
    scores = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    probs = scores / scores.sum(-1, keepdim=True) if score == "sigmoid" else scores
    want = topk_oracle(probs, k, capacity)
    r = route(logits, k, capacity, cfg=opts(top_k=k, score=score, topk_renormalize=False))
    assert r.token_index.tolist() == want[0].tolist() and r.counts.tolist() == want[2].tolist()
    expert = torch.repeat_interleave(torch.arange(5), r.counts)
    torch.testing.assert_close(r.weights, scores[r.token_index, expert])
