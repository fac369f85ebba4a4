"""Capacity and dropping: route() against a worked example and the Python GShard rule (oracle.py),
dropped tokens pass through MoELayer as zeros, the capacity formula, renormalisation after drops."""
import math
from fractions import Fraction

import pytest
import torch
from tests.fairseq_moe_layer.oracle import expected_routing

from fairseq_moe_layer import MoEConfig, MoELayer, route

# T=6 tokens, E=3 experts, k=2; each row's (first, second) choice is in the comment.
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.0],  # t0: (0, 1)
        [2.0, 0.0, 1.0],  # t1: (0, 2)
        [1.5, 0.5, 0.0],  # t2: (0, 1)
        [1.0, 2.0, 0.0],  # t3: (1, 0)
        [1.0, 0.0, 2.0],  # t4: (2, 0)
        [3.0, 0.0, 1.0],  # t5: (0, 2)
    ]
)


def test_worked_example_capacity_2():
    """By hand, C=2. First choices in token order: e0 takes t0, t1 (full; t2, t5 dropped),
    e1 takes t3, e2 takes t4. Second choices: t0 -> e1 kept, t1 -> e2 kept, the rest overflow.
    Rows by expert, priority order inside: e0 [t0, t1], e1 [t3, t0], e2 [t4, t1].
    Weights: t0 and t1 keep both choices, renormalised: e/(e+1) and 1/(e+1);
    t3, t4 keep only their first choice: 1.0. t2 and t5 lose both choices."""
    r = route(LOGITS, top_k=2, capacity=2)
    assert r.token_index.tolist() == [0, 1, 3, 0, 4, 1]
    assert r.counts.tolist() == [2, 2, 2]
    assert r.demand.tolist() == [6, 3, 3]  # e0: 4 first + 2 second choices
    hi, lo = math.e / (math.e + 1), 1 / (math.e + 1)
    torch.testing.assert_close(r.weights, torch.tensor([hi, hi, 1.0, lo, 1.0, lo]))
    assert r.weights.dtype == torch.float32


@pytest.mark.parametrize("k,capacity", [(1, 1), (1, 3), (2, 1), (2, 2), (2, None), (3, 2)])
def test_worked_logits_match_python_rule(k, capacity):
    r = route(LOGITS, top_k=k, capacity=capacity)
    token_index, weights, counts = expected_routing(LOGITS, k, capacity)
    assert r.token_index.tolist() == token_index.tolist()
    assert r.counts.tolist() == counts.tolist()
    torch.testing.assert_close(r.weights, weights)


@pytest.mark.parametrize("seed", range(6))
def test_random_logits_match_python_rule(seed):
    g = torch.Generator().manual_seed(seed)
    T, E = [(1, 2), (9, 4), (17, 5), (31, 8), (40, 3), (25, 16)][seed]
    logits = torch.randn(T, E, generator=g) * 2
    logits[:, 0] += 1.0  # a popular expert, so capacity bites
    for k in sorted({1, 2, min(4, E)}):
        for capacity in (None, 1, math.ceil(k * T / E), math.ceil(1.5 * k * T / E)):
            r = route(logits, top_k=k, capacity=capacity)
            token_index, weights, counts = expected_routing(logits, k, capacity)
            assert r.token_index.tolist() == token_index.tolist(), (k, capacity)
            assert r.counts.tolist() == counts.tolist(), (k, capacity)
            torch.testing.assert_close(r.weights, weights)


@pytest.mark.parametrize("k", [1, 2])
def test_fully_dropped_tokens_pass_through(k):
    """Through MoELayer: with logits = LOGITS (x = LOGITS, gate = identity), training capacity
    C = ceil(cf * k * 6 / 3) = 2 for cf = 1/k. Tokens that lose every choice get y == 0 exactly."""
    layer = MoELayer(MoEConfig(model_dim=3, ffn_dim=5, num_experts=3, top_k=k, capacity_factor=1 / k))
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(3))
    assert layer.cfg.capacity(6, training=True) == 2
    y, aux = layer(LOGITS.clone())
    # k=1: e0 takes t0, t1 and drops t2, t5. k=2: see test_worked_example_capacity_2.
    dropped = [2, 5]
    assert y[dropped].abs().max() == 0
    assert (LOGITS + y)[dropped].equal(LOGITS[dropped])  # the residual passes them unchanged
    assert y[[0, 1, 3, 4]].abs().sum(1).min() > 0
    # Kept assignments: k=1: 4 of 6; k=2: 6 of 12 (the worked example).
    assert aux.dropped_fraction == pytest.approx({1: 2 / 6, 2: 6 / 12}[k])


def test_k2_one_choice_dropped_gets_weight_one():
    """t0: (e0, e1), t1: (e0, e2), C=1: t1 loses e0 to t0, so its e2 row must carry weight 1.0."""
    logits = torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.0, 1.5]])
    r = route(logits, top_k=2, capacity=1)
    assert r.token_index.tolist() == [0, 0, 1]
    assert r.weights[2].item() == 1.0
    p0 = torch.softmax(logits[0], -1)
    torch.testing.assert_close(r.weights[:2], p0[:2] / p0[:2].sum())


def test_k1_weight_is_raw_probability_and_not_renormalised():
    r = route(LOGITS, top_k=1, capacity=None)
    probs = torch.softmax(LOGITS, -1)
    torch.testing.assert_close(r.weights, probs[r.token_index, probs.argmax(-1)[r.token_index]])
    assert (r.weights < 1).all()


def cfg(**kw):
    base = dict(model_dim=4, ffn_dim=4, num_experts=4, top_k=2, capacity_factor=1.25)
    base.update(kw)
    return MoEConfig(**base).validate()


@pytest.mark.parametrize(
    "E,k,cf,T,C",
    [(4, 2, 1.25, 8, 5), (3, 1, 1.0, 10, 4), (8, 2, 1.0, 9, 3), (8, 4, 2.0, 1, 1), (2, 2, 0.5, 7, 4)],
)
def test_training_capacity_by_hand(E, k, cf, T, C):
    c = cfg(num_experts=E, top_k=k, capacity_factor=cf)
    assert c.capacity(T, training=True) == C
    assert cfg(num_experts=E, top_k=k, capacity_factor=0.0).capacity(T, training=True) is None


def test_training_capacity_formula_is_exact():
    """C = ceil(cf * k * T / E) in exact arithmetic: a decimal cf such as 1.1 must not round up
    one more (1.1 * 2 * 45 / 3 is 33.00000000000001 in floats; the capacity is 33, not 34)."""
    wrong = []
    for cf in (0.5, 1.0, 1.1, 1.25, 2.2):
        for k, E in ((1, 1), (1, 4), (2, 2), (2, 3), (4, 4), (2, 8)):
            c = cfg(num_experts=E, top_k=k, capacity_factor=cf)
            for T in range(1, 61):
                exact = math.ceil(Fraction(str(cf)) * k * T / E)
                if c.capacity(T, training=True) != exact:
                    wrong.append(f"cf={cf} k={k} T={T} E={E}: {c.capacity(T, training=True)} != {exact}")
    assert not wrong, f"{len(wrong)} wrong capacities, e.g. " + "; ".join(wrong[:4])


def test_eval_capacity_fraction_semantics():
    train_c = cfg().capacity(10, training=True)  # ceil(1.25 * 2 * 10 / 4) = 7
    assert train_c == 7
    assert cfg(eval_capacity_token_fraction=-1.0).capacity(10, training=False) == 7  # as training
    assert cfg(eval_capacity_token_fraction=0.0).capacity(10, training=False) is None  # dropless
    assert cfg(eval_capacity_token_fraction=0.25).capacity(10, training=False) == 3  # ceil(2.5)
    assert cfg(eval_capacity_token_fraction=0.1).capacity(30, training=False) == 3
    assert cfg(eval_capacity_token_fraction=1.0).capacity(7, training=False) == 7
    # The fraction is for eval only: training still uses the capacity factor.
    assert cfg(eval_capacity_token_fraction=0.0).capacity(10, training=True) == 7


def test_layer_uses_eval_capacity_in_eval_mode():
    layer = MoELayer(cfg(model_dim=3, num_experts=3, capacity_factor=0.5, eval_capacity_token_fraction=0.5))
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(3))
    _, aux = layer.train()(LOGITS.clone())
    assert aux.counts.max().item() == 2  # ceil(0.5 * 2 * 6 / 3)
    _, aux = layer.eval()(LOGITS.clone())
    assert aux.counts.max().item() == 3  # ceil(0.5 * 6)
