"""Router losses against numbers worked out by hand, and the balance loss against fairseq's formula."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.losses import balance_loss, gate_entropy, importance_loss, load_loss, router_z_loss


def test_balance_loss_uniform_router_is_one():
    probs = torch.full((6, 4), 0.25)
    top = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    assert balance_loss(probs, top).item() == pytest.approx(1.0)


def test_balance_loss_two_tokens_by_hand():
    """probs [[.8, .2], [.7, .3]], both first choices expert 0: me = [.75, .25], ce = [1, 0],
    mean(me * ce) = .375, times E^2 = 4: 1.5. Only me carries gradient: dL/dprobs[t, e] =
    E^2 / E * ce_e / T = [[1, 0], [1, 0]]."""
    probs = torch.tensor([[0.8, 0.2], [0.7, 0.3]], requires_grad=True)
    loss = balance_loss(probs, torch.tensor([[0, 1], [0, 1]]))
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(probs.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def test_balance_loss_uses_first_choice_only():
    """Same probs, second choices swapped around: unchanged. First choice moved: changes."""
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    a = balance_loss(probs, torch.tensor([[0, 1], [1, 2], [2, 0]]))
    b = balance_loss(probs, torch.tensor([[0, 2], [1, 0], [2, 1]]))
    c = balance_loss(probs, torch.tensor([[0, 1], [1, 2], [0, 2]]))
    assert a.item() == b.item()
    # By hand: me = [.8, 1.1, 1.1] / 3; ce = [1, 1, 1] / 3 for a; [2, 1, 0] / 3 for c.
    assert a.item() == pytest.approx(9 * (0.8 + 1.1 + 1.1) / 9 / 3)
    assert c.item() == pytest.approx(9 * (1.6 + 1.1) / 9 / 3)


def test_balance_loss_equals_fairseq_moe_branch():
    """fairseq moe branch top1/top2gating: me = mean(gates, 0); ce = mean(one_hot(argmax), 0);
    l_aux = mean(me * ce) * E * E."""
    g = torch.Generator().manual_seed(0)
    for T, E in [(5, 2), (16, 8), (33, 7)]:
        probs = torch.softmax(torch.randn(T, E, generator=g), -1)
        mask1 = F.one_hot(probs.argmax(-1), E).float()
        expected = (probs.mean(0) * mask1.mean(0)).mean() * E * E
        torch.testing.assert_close(balance_loss(probs, probs.topk(2, -1).indices), expected)


def test_router_z_loss_by_hand():
    """logsumexp([0, 0]) = ln 2, logsumexp([ln 3, 0]) = ln 4 = 2 ln 2: mean of squares = 2.5 ln(2)^2."""
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2) ** 2)
    # Shifting every logit by c shifts logsumexp by c: [[5, 5]] -> (5 + ln 2)^2.
    assert router_z_loss(torch.tensor([[5.0, 5.0]])).item() == pytest.approx((5 + math.log(2)) ** 2)
    # Computed in fp32 from half-precision logits, no overflow.
    assert router_z_loss(torch.tensor([[60.0, 60.0]], dtype=torch.float16)).item() == pytest.approx(
        (60 + math.log(2)) ** 2, rel=1e-4
    )


def test_gate_entropy_by_hand():
    """Rows: uniform over 2 (ln 2) and one-hot (0, no NaN from 0 * log 0): mean ln(2) / 2."""
    assert gate_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]])).item() == pytest.approx(math.log(2) / 2)
    assert gate_entropy(torch.full((3, 4), 0.25)).item() == pytest.approx(math.log(4))
    # [.5, .25, .25]: .5 ln 2 + 2 * .25 ln 4 = 1.5 ln 2.
    assert gate_entropy(torch.tensor([[0.5, 0.25, 0.25]])).item() == pytest.approx(1.5 * math.log(2))


def _cv2(values):
    v = torch.stack(values)
    mean = v.mean()
    return sum((x - mean) ** 2 for x in values) / (len(values) - 1) / (mean ** 2 + 1e-10)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_importance_loss_matches_a_loop(k):
    """Shazeer et al. 2017: the gates are the softmax over each token's k chosen experts."""
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(k), dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(logits, -1)
    top = probs.topk(k, -1).indices
    importance = [sum(probs[t, e] / probs[t, top[t]].sum() if e in top[t].tolist() else probs[t, e] * 0
                      for t in range(9)) for e in range(4)]
    want = _cv2(importance)
    got = importance_loss(probs, top)
    torch.testing.assert_close(got, want)
    g1, = torch.autograd.grad(got, logits, retain_graph=True)
    g2, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g1, g2)
    assert (g1.abs().sum() > 1e-9) == (k > 1)  # with k = 1 every gate is 1 (rounding only)


@pytest.mark.parametrize("k", [1, 2])
def test_load_loss_matches_a_loop(k):
    """P(expert e among the k best under a new noise draw) = Phi((clean_e - kth best noisy of the others) / sigma)."""
    g = torch.Generator().manual_seed(10 + k)
    clean = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    noisy = (clean + 0.7 * torch.randn(7, 5, generator=g, dtype=torch.float64)).detach()
    normal = torch.distributions.Normal(0.0, 1.0)
    load = []
    for e in range(5):
        total = clean.sum() * 0
        for t in range(7):
            others = sorted((float(noisy[t, i]) for i in range(5) if i != e), reverse=True)
            total = total + normal.cdf((clean[t, e] - others[k - 1]) / 0.7)
        load.append(total)
    want = _cv2(load)
    got = load_loss(clean, noisy, k, 0.7)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(*(torch.autograd.grad(v, clean, retain_graph=True)[0] for v in (got, want)))
    assert float(load_loss(clean, noisy, 5, 0.7).detach()) == 0.0  # k = E: every expert always chosen


def test_layer_reports_shazeer_losses():
    cfg = MoEConfig(model_dim=6, ffn_dim=4, num_experts=4, top_k=2, gate_noise="gaussian", gate_noise_scale=0.5)
    layer = MoELayer(cfg)
    _, aux = layer(torch.randn(11, 6))
    assert aux.importance_loss > 0 and aux.load_loss > 0 and aux.load_loss.requires_grad
    _, aux = MoELayer(dataclasses.replace(cfg, gate_noise="none"))(torch.randn(11, 6))
    assert aux.importance_loss > 0 and float(aux.load_loss.detach()) == 0.0  # no noise: no load estimator
