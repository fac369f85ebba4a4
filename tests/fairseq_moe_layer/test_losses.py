"""Router losses against numbers worked out by hand, and the balance loss against fairseq's formula."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.losses import (balance_loss, gate_entropy, global_balance_share, importance_loss, load_loss,
                                     router_z_loss, sequence_balance_loss)


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


def deepseek_sequence_loss(scores, top_experts, B, S):
    """DeepSeek-V2/V3's sequence-wise loss as their MoEGate writes it (B sequences of S tokens, no padding):
    ce = zeros(B, E).scatter_add_(1, idx.view(B, -1), ones(B, S k)) / (S k / E); (ce * mean_s scores).sum(1).mean()."""
    E, k = scores.shape[1], top_experts.shape[1]
    ce = torch.zeros(B, E, dtype=scores.dtype).scatter_add_(1, top_experts.view(B, -1),
                                                            torch.ones(B, S * k, dtype=scores.dtype)) / (S * k / E)
    return (ce * scores.view(B, S, E).mean(1)).sum(1).mean()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sequence_balance_loss_equals_deepseeks(k):
    """Equal-length sequences: DeepSeek's gate's formula; and its gradient (through the probabilities only)."""
    g = torch.Generator().manual_seed(k)
    B, S, E = 3, 7, 5
    probs = torch.softmax(torch.randn(B * S, E, generator=g, dtype=torch.float64), -1).requires_grad_(True)
    top = probs.detach().topk(k, -1).indices
    sequence = torch.arange(B).repeat_interleave(S)
    got, want = sequence_balance_loss(probs, top, sequence, B), deepseek_sequence_loss(probs, top, B, S)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(*(torch.autograd.grad(v, probs)[0] for v in (got, want)))


def test_sequence_balance_loss_is_the_mean_of_each_sequence_alone():
    """Sequences of different lengths, interleaved (time-major order), one of them empty: the mean over the sequences
    that have tokens of each one's loss computed alone (by a loop of the paper's formula)."""
    g = torch.Generator().manual_seed(3)
    E, k = 4, 2
    sequence = torch.tensor([0, 2, 3, 0, 2, 0, 3, 0, 0, 2])  # sequence 1 has no token
    probs = torch.softmax(torch.randn(len(sequence), E, generator=g, dtype=torch.float64), -1)
    top = probs.topk(k, -1).indices
    alone = []
    for b in (0, 2, 3):
        p, t = probs[sequence == b], top[sequence == b]
        T = p.shape[0]
        f = [E / (k * T) * sum(int(e in t[i].tolist()) for i in range(T)) for e in range(E)]
        P = [float(p[:, e].mean()) for e in range(E)]
        alone.append(sum(fe * pe for fe, pe in zip(f, P)))
    assert float(sequence_balance_loss(probs, top, sequence, 4)) == pytest.approx(sum(alone) / 3)
    uniform = torch.full((6, 3), 1 / 3, dtype=torch.float64)
    spread = torch.tensor([[0], [1], [2], [0], [1], [2]])
    assert float(sequence_balance_loss(uniform, spread, torch.tensor([0, 0, 0, 1, 1, 1]), 2)) == pytest.approx(1.0)


def test_global_balance_share_on_one_rank():
    """One rank holding every token: the share is the whole loss, sum_e f_e P_e with every choice counted; at k = 1 it
    is the GShard/Switch loss (first choices: the only ones), E^2 mean(me ce)."""
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(13, 6, generator=g, dtype=torch.float64), -1)
    top = probs.topk(2, -1).indices
    counts = torch.bincount(top.reshape(-1), minlength=6)
    want = sum(6 * counts[e] / (2 * 13) * probs[:, e].mean() for e in range(6))
    torch.testing.assert_close(global_balance_share(probs, top, counts, 13), want)
    one = top[:, :1]
    torch.testing.assert_close(global_balance_share(probs, one, torch.bincount(one[:, 0], minlength=6), 13),
                               balance_loss(probs, top))


@pytest.mark.parametrize("time_major", [False, True])
def test_layer_sequence_scope_reads_the_sequences_of_x(time_major):
    """--moe-balance-loss-scope sequence: x [B, T, d] (or time-major [T, B, d]) with padding gives the loss of its
    sequences, their padding left out; batch-major and time-major agree; a sequence's loss does not depend on the
    others in the batch. scope batch is the GShard loss of the same routing."""
    cfg = MoEConfig(model_dim=6, ffn_dim=4, num_experts=4, top_k=2, balance_loss_scope="sequence", capacity_factor=0)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x = torch.randn(3, 5, 6)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    args = (x.transpose(0, 1), pad.t()) if time_major else (x, pad)
    _, aux = layer(*args, time_major=time_major)
    each = [layer(x[b, :5 - 2 * (b == 1)])[1].balance_loss for b in range(3)]
    torch.testing.assert_close(aux.balance_loss, torch.stack(each).mean())
    layer.cfg = dataclasses.replace(cfg, balance_loss_scope="batch")
    _, batch = layer(x, pad)
    real = x[~pad]
    probs = torch.softmax(F.linear(real, layer.gate.weight), -1)
    torch.testing.assert_close(batch.balance_loss, balance_loss(probs, probs.topk(2, -1).indices))


def test_scope_needs_a_balance_loss():
    with pytest.raises(ValueError, match="--moe-balance-loss-scope"):
        MoEConfig(model_dim=6, ffn_dim=4, num_experts=4, top_k=1, routing="hash", balance_loss_scope="sequence"
                  ).validate()


def test_global_scope_pools_the_micro_batches_of_an_update():
    """--moe-balance-loss-scope global over --update-freq: micro-batch m's f_e counts the choices of micro-batches
    1..m (add_global_counts after each; Megatron-Core's running sum), its P_e its own tokens; reset_global_counts
    starts an update; evaluation pools nothing."""
    cfg = MoEConfig(model_dim=6, ffn_dim=4, num_experts=4, top_k=2, capacity_factor=0.0,
                    balance_loss_scope="global")
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, 6, generator=g), torch.randn(5, 6, generator=g)

    def by_hand(counted, x):
        probs = torch.softmax(layer.router_logits(x)[0], -1)
        counts = sum(torch.bincount(torch.softmax(layer.router_logits(y)[0], -1).topk(2, -1).indices.reshape(-1),
                                    minlength=4).double() for y in counted)
        T = sum(len(y) for y in counted)
        return sum(4 * counts[e] / (2 * T) * probs[:, e].mean() for e in range(4))

    layer(a)
    layer.add_global_counts()
    _, aux = layer(b)
    torch.testing.assert_close(aux.balance_loss.double(), by_hand([a, b], b).double())
    layer.add_global_counts()
    _, aux = layer(a)  # a third micro-batch
    torch.testing.assert_close(aux.balance_loss.double(), by_hand([a, b, a], a).double())
    layer.reset_global_counts()
    _, aux = layer(b)
    torch.testing.assert_close(aux.balance_loss.double(), by_hand([b], b).double())
    layer.add_global_counts()
    layer.eval()
    _, aux = layer(a)
    torch.testing.assert_close(aux.balance_loss.double(), by_hand([a], a).double())
    assert layer.last_global_counts is None  # (evaluation leaves the update's sum alone)
