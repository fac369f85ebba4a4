"""Router losses against numbers worked out by hand, and the balance loss against fairseq's formula."""
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe.moe.losses import balance_loss, gate_entropy, router_z_loss


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
