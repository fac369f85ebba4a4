"""The ladder: MoELayer against ever less trivial references.

1. one expert, k=1 == a dense FFN with the same weights (outputs and gradients);
2. dropless == capacity mode with a capacity nothing overflows (train and eval);
3. == the per-token loop oracle (tests/fairseq_moe_layer/oracle.py) for k in {1, 2, 4}, fp32/fp64, odd T, empty
   experts, dropless and dropping: outputs and the gradients of x, gate weight, w1, b1, w2, b2; and so for each
   expert kind (swiglu: w1, w2, no biases);
4. [B, T, d] with padding: pads give zeros, change nothing else, stay out of the losses;
   all-padding works end to end.
Also: activation dropout is off in eval; fairseq_moe_layer imports without fairseq.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.fairseq_moe_layer.oracle import expert_mlp, moe_oracle

from fairseq_moe_layer import MoEConfig, MoELayer

PARAMS = ("gate.weight", "experts.w1", "experts.b1", "experts.w2", "experts.b2")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}
# The router runs in fp32 whatever the model dtype, so gradients through it are fp32-accurate.
ROUTER_TOL = dict(rtol=1e-5, atol=1e-6)


def make_layer(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(model_dim=12, ffn_dim=20, num_experts=8, top_k=2, capacity_factor=0.0)
    cfg.update(kw)
    return MoELayer(MoEConfig(**cfg)).to(dtype)


def run(layer, x, grad_out, padding_mask=None, aux_weight=0.0):
    """Forward + backward; returns y, aux, and the gradients of x and every parameter."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y, aux = layer(x, padding_mask)
    ((y * grad_out).sum() + aux_weight * (aux.balance_loss + aux.z_loss)).backward()
    params = dict(layer.named_parameters())
    return y.detach(), aux, {"x": x.grad, **{n: params[n].grad for n in PARAMS}}


def assert_grads_close(ga, gb, router_tol=None, **tol):
    assert ga.keys() == gb.keys()
    for name in ga:
        t = router_tol if router_tol and name in ("x", "gate.weight") else tol
        torch.testing.assert_close(ga[name], gb[name], **t, msg=f"grad of {name}")


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_one_expert_top1_is_dense_ffn(activation):
    layer = make_layer(num_experts=1, top_k=1, capacity_factor=1.0, activation=activation)
    fc1, fc2 = torch.nn.Linear(12, 20).double(), torch.nn.Linear(20, 12).double()
    with torch.no_grad():
        fc1.weight.copy_(layer.experts.w1[0].t()), fc1.bias.copy_(layer.experts.b1[0])
        fc2.weight.copy_(layer.experts.w2[0].t()), fc2.bias.copy_(layer.experts.b2[0])
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    g = torch.randn_like(x)
    y, aux, grads = run(layer, x, g)
    xd = x.clone().requires_grad_(True)
    yd = fc2(F.__dict__[activation](fc1(xd)))
    (yd * g).sum().backward()
    torch.testing.assert_close(y, yd.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads["x"], xd.grad)
    torch.testing.assert_close(grads["experts.w1"][0], fc1.weight.grad.t())
    torch.testing.assert_close(grads["experts.b1"][0], fc1.bias.grad)
    torch.testing.assert_close(grads["experts.w2"][0], fc2.weight.grad.t())
    torch.testing.assert_close(grads["experts.b2"][0], fc2.bias.grad)
    assert grads["gate.weight"].abs().max() == 0  # p = 1.0 whatever the logits
    assert aux.counts.tolist() == [15]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("training", [True, False])
def test_dropless_equals_capacity_nothing_overflows(k, training):
    x = torch.randn(29, 12, dtype=torch.float64)
    g = torch.randn_like(x)
    # training: C = ceil(8 * k * T / 8) = k * T; eval: C = ceil(1.0 * T) = T; no expert can overflow.
    big = make_layer(top_k=k, capacity_factor=8.0, eval_capacity_token_fraction=1.0).train(training)
    dropless = make_layer(top_k=k, capacity_factor=0.0, eval_capacity_token_fraction=0.0).train(training)
    ya, auxa, ga = run(big, x, g, aux_weight=1.0)
    yb, auxb, gb = run(dropless, x, g, aux_weight=1.0)
    assert auxa.counts.tolist() == auxa.demand.tolist() == auxb.counts.tolist()
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    assert_grads_close(ga, gb, rtol=0, atol=0)
    torch.testing.assert_close(auxa.balance_loss, auxb.balance_loss, rtol=0, atol=0)


def test_activation_dropout_only_in_training():
    x = torch.randn(19, 12, dtype=torch.float64)
    g = torch.randn_like(x)
    ref, _, gref = run(make_layer(activation_dropout=0.0).eval(), x, g)
    drop = make_layer(activation_dropout=0.5)
    y, _, grads = run(drop.eval(), x, g)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert_grads_close(grads, gref, rtol=0, atol=0)
    assert not torch.allclose(run(drop.train(), x, g)[0], ref)


def biased_inputs(layer, T, dtype, empty=(0, 7), seed=1):
    """x with a constant feature 0 and a gate that pushes experts `empty` far down: they get nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 12, dtype=dtype, generator=g)
    x[:, 0] = 1.0
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(layer.gate.weight.shape, generator=g))
        layer.gate.weight[list(empty), 0] = -30.0
    return x, torch.randn(T, 12, dtype=dtype, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_layer_matches_token_loop_oracle(k, capacity_factor, dtype):
    layer = make_layer(dtype, top_k=k, capacity_factor=capacity_factor, activation="gelu")
    x, g = biased_inputs(layer, 23, dtype)
    y, aux, grads = run(layer, x, g)
    assert aux.demand[0] == 0 and aux.demand[7] == 0
    if capacity_factor:  # the dropping case really drops
        assert (aux.counts < aux.demand).any()
    else:
        assert aux.counts.sum() == 23 * k

    p = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    xo = x.clone().requires_grad_(True)
    C = layer.cfg.capacity(23, training=True)
    e = "experts."
    yo = moe_oracle(xo, p["gate.weight"], p[e + "w1"], p[e + "b1"], p[e + "w2"], p[e + "b2"], k, "gelu", C)
    (yo * g).sum().backward()
    assert y.dtype == dtype
    torch.testing.assert_close(y, yo.detach(), **TOL[dtype])
    grads_o = {"x": xo.grad, **{n: p[n].grad for n in PARAMS}}
    assert_grads_close(grads, grads_o, router_tol=ROUTER_TOL, **TOL[dtype])


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.parametrize("k, qwen2", [(1, False), (2, False), (2, True)])
def test_swiglu_experts_match_the_token_loop_oracle(k, qwen2, capacity_factor):
    """--moe-expert-kind swiglu (and a swiglu shared expert): w1 [E, d, 2f], w2 [E, f, d], no biases, against the
    oracle's per-token loop of Shazeer's FFN_SwiGLU; outputs and every gradient. qwen2: Qwen2-MoE's sparse block,
    top-2 weights that are the softmax's probabilities as they are (--no-moe-topk-renormalize), and a wider shared
    expert whose output is scaled by sigmoid(x . g) (--moe-shared-expert-ffn-dim, --moe-shared-expert-gate)."""
    qwen = dict(shared_expert_ffn_dim=28, shared_expert_gate=True, topk_renormalize=False) if qwen2 else {}
    layer = make_layer(top_k=k, capacity_factor=capacity_factor, expert_kind="swiglu", shared_experts=1, **qwen)
    assert layer.experts.w1.shape == (8, 12, 40) and layer.experts.w2.shape == (8, 20, 12)
    assert layer.experts.b1 is None and layer.experts.b2 is None and layer.shared.b1 is None
    assert layer.shared.w1.shape == (1, 12, 56 if qwen2 else 40) and (layer.shared_gate is not None) == qwen2
    T = 23
    x, g = biased_inputs(layer, T, torch.float64)
    layer.zero_grad()
    xl = x.clone().requires_grad_(True)
    y, aux = layer(xl)
    (y * g).sum().backward()
    p = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    xo = x.clone().requires_grad_(True)
    C = layer.cfg.capacity(T, training=True)
    e = "experts."
    yo = moe_oracle(xo, p["gate.weight"], p[e + "w1"], None, p[e + "w2"], None, k, "swiglu", C, renormalize=not qwen2)
    gate = [torch.sigmoid(xo[t] @ p["shared_gate.weight"][0]) if qwen2 else 1.0 for t in range(T)]
    yo = yo + torch.stack([gate[t] * expert_mlp(xo[t], 0, p["shared.w1"], None, p["shared.w2"], None, "swiglu")
                           for t in range(T)])
    (yo * g).sum().backward()
    torch.testing.assert_close(y, yo.detach(), **TOL[torch.float64])
    torch.testing.assert_close(xl.grad, xo.grad, **ROUTER_TOL)
    for name, t in layer.named_parameters():
        torch.testing.assert_close(t.grad, p[name].grad, **(ROUTER_TOL if name == "gate.weight" else
                                                            TOL[torch.float64]), msg=name)


def test_padding_is_skipped():
    """[B, T, d] with a padding mask == the layer on the non-pad tokens alone."""
    layer = make_layer(top_k=2, capacity_factor=1.0)  # capacity on: T must count non-pad tokens only
    B, T = 3, 7
    x = torch.randn(B, T, 12, dtype=torch.float64)
    g = torch.randn_like(x)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 5:] = True
    pad[2, 1:] = True
    pad[1, 0] = True
    y, aux, grads = run(layer, x, g, pad, aux_weight=1.0)
    assert y.shape == x.shape
    assert y[pad].abs().max() == 0
    assert grads["x"][pad].abs().max() == 0

    # Pads with other (huge) content change nothing.
    x2 = x.clone()
    x2[pad] = 1e4
    y2, aux2, grads2 = run(layer, x2, g, pad, aux_weight=1.0)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    assert_grads_close(grads2, grads, rtol=0, atol=0)

    # Same as routing only the non-pad tokens, losses included.
    yn, auxn, gradsn = run(layer, x[~pad], g[~pad], aux_weight=1.0)
    torch.testing.assert_close(y[~pad], yn)
    torch.testing.assert_close(grads["x"][~pad], gradsn["x"])
    assert_grads_close({n: grads[n] for n in PARAMS}, {n: gradsn[n] for n in PARAMS})
    assert aux.num_tokens == auxn.num_tokens == int((~pad).sum())
    assert aux.demand.tolist() == auxn.demand.tolist() and aux.counts.tolist() == auxn.counts.tolist()
    torch.testing.assert_close(aux.balance_loss, auxn.balance_loss)
    torch.testing.assert_close(aux.z_loss, auxn.z_loss)
    torch.testing.assert_close(aux.entropy, auxn.entropy)


def test_the_capacity_can_count_the_padding():
    """capacity_counts_padding (NLLB-MoE's capacity with its pad mask): the padding still goes nowhere, but the
    capacity is the one of all B x T positions: the oracle on the real tokens alone at that capacity."""
    layer = make_layer(top_k=2, capacity_factor=1.0, capacity_counts_padding=True)
    B, T = 3, 7
    x = torch.randn(B, T, 12, dtype=torch.float64)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3:], pad[2, 2:] = True, True
    y, aux = layer(x, pad)
    assert y[pad].abs().max() == 0 and aux.num_tokens == int((~pad).sum())
    e = {n: t.detach() for n, t in layer.named_parameters()}
    C = layer.cfg.capacity(B * T, training=True)
    assert C > layer.cfg.capacity(int((~pad).sum()), training=True)
    expected = moe_oracle(x[~pad], e["gate.weight"], e["experts.w1"], e["experts.b1"], e["experts.w2"],
                          e["experts.b2"], 2, capacity=C)
    torch.testing.assert_close(y[~pad], expected.detach())
    counted_real = make_layer(top_k=2, capacity_factor=1.0)(x, pad)[0]  # (the default: only the real tokens count)
    assert not torch.allclose(counted_real, y)


@pytest.mark.parametrize("training", [True, False])
def test_all_padding(training):
    layer = make_layer(top_k=2, capacity_factor=1.0).train(training)
    x = torch.randn(2, 4, 12, dtype=torch.float64)
    y, aux, grads = run(layer, x, torch.randn_like(x), torch.ones(2, 4, dtype=torch.bool), aux_weight=1.0)
    assert y.shape == x.shape and y.abs().max() == 0
    assert aux.balance_loss.item() == 0 and aux.z_loss.item() == 0 and aux.num_tokens == 0
    assert aux.dropped_fraction == 0.0 and aux.imbalance == 1.0
    for name, grad in grads.items():
        assert grad is not None and grad.abs().max() == 0, name


def test_padding_mask_shape_is_checked():
    layer = make_layer()
    with pytest.raises(ValueError):
        layer(torch.randn(2, 4, 12, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.bool))


@pytest.mark.slow
def test_moe_package_imports_without_fairseq():
    """fairseq_moe/__init__.py says fairseq_moe_layer is usable without fairseq."""
    code = "import sys; sys.modules['fairseq'] = None; import fairseq_moe_layer"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _contributions(layer, x):
    """[T, k] expert outputs w_j * FFN_j(x) of each token's choices (top-k, weights renormalised for k >= 2, dropless),
    token by token."""
    p = dict(layer.named_parameters())
    k = layer.cfg.top_k
    probs = torch.softmax(x.float() @ p["gate.weight"].float().t(), -1)
    out = torch.zeros(x.shape[0], k, x.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        top_p, top_e = probs[t].topk(k)
        for j in range(k):
            e = int(top_e[j])
            h = torch.relu(x[t] @ p["experts.w1"][e] + p["experts.b1"][e])
            w = top_p[j] if k == 1 else top_p[j] / top_p.sum()
            out[t, j] = w.to(x.dtype) * (h @ p["experts.w2"][e] + p["experts.b2"][e])
    return out.detach()


@pytest.mark.parametrize("k", [1, 2])
def test_output_masking_as_nllb(k):
    """NLLB-MoE's --moe-eom and --moe-fom (fairseq's nllb branch: MOELayer's tok_dropout, the layers' moe_fom). At
    evaluation every expert output, then every token's output, is scaled by 1 - p. In training each expert output
    (one token at one of its experts) is kept whole or zeroed with probability p, then each token's whole output
    the same way; nothing is rescaled."""
    T, eom, fom = 2000, 0.2, 0.3
    x = torch.randn(T, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = make_layer(top_k=k)
    parts = _contributions(plain, x)  # [T, k, d]
    with torch.no_grad():
        torch.testing.assert_close(plain(x)[0], parts.sum(1), **TOL[torch.float64])
        masked = make_layer(top_k=k, expert_output_masking=eom, final_output_masking=fom,
                            eval_capacity_token_fraction=0.0).eval()
        # (the weights are fp32: scaled there)
        torch.testing.assert_close(masked(x)[0], (1 - fom) * (1 - eom) * parts.sum(1), rtol=1e-6, atol=1e-7)

        y = make_layer(top_k=k, expert_output_masking=eom).train()(x)[0]
        subsets = torch.tensor([[(m >> j) & 1 for j in range(k)] for m in range(2 ** k)], dtype=x.dtype)  # [2^k, k]
        sums = torch.einsum("mk,tkd->tmd", subsets, parts)  # every sum of kept expert outputs, per token
        miss = (sums - y[:, None]).abs().amax(-1)  # [T, 2^k]
        assert (miss.min(1).values < 1e-9).all()  # each token's output: some of its expert outputs, whole
        kept = subsets.sum(1)[miss.argmin(1)].sum() / (T * k)
        assert abs(float(kept) - (1 - eom)) < 0.03

        y = make_layer(top_k=k, final_output_masking=fom).train()(x)[0]
        zero, whole = y.abs().amax(-1) == 0, (y - parts.sum(1)).abs().amax(-1) < 1e-9
        assert (zero | whole).all() and abs(float(zero.double().mean()) - fom) < 0.03


def test_output_masking_has_no_slots_to_mask():
    with pytest.raises(ValueError, match=r"--moe-eom \(expert_output_masking\) applies to routed tokens"):
        MoEConfig(model_dim=4, ffn_dim=4, num_experts=2, routing="soft", expert_output_masking=0.2).validate()


def test_cmr_mixes_the_dense_ffn_and_the_experts_as_nllb():
    """--moe-cmr (NLLB's CMRLayer): y = (1 - g) FFN(x) + g MoE(x), g = sigmoid(w . x + b) per token, the FFN being
    the one shared expert; in training g goes through dropout (zeroed, or scaled by 1 / (1 - p)); the aux carries
    the sum of the gates (NLLB's cmr_gate_loss_num)."""
    x = torch.randn(300, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer = make_layer(top_k=2, shared_experts=1, cmr=True, cmr_gate_drop=0.25, eval_capacity_token_fraction=0.0)
    routed = _contributions(layer, x).sum(1)
    s = dict(layer.named_parameters())
    ffn = torch.relu(x @ s["shared.w1"][0] + s["shared.b1"][0]) @ s["shared.w2"][0] + s["shared.b2"][0]
    g = torch.sigmoid(x @ s["cmr_gate.weight"][0] + s["cmr_gate.bias"][0])
    with torch.no_grad():
        y, aux = layer.eval()(x)
        torch.testing.assert_close(y, (1 - g)[:, None] * ffn + g[:, None] * routed, **TOL[torch.float64])
        assert aux.cmr_gate_sum.item() == pytest.approx(g.sum().item())
        y, aux = layer.train()(x)
    # each token: the gate dropped (the FFN alone) or kept and scaled by 1 / (1 - 0.25)
    kept = g / 0.75
    dropped = (y - ffn).abs().amax(-1) < 1e-9
    whole = (y - ((1 - kept)[:, None] * ffn + kept[:, None] * routed)).abs().amax(-1) < 1e-9
    assert (dropped | whole).all() and 0.15 < dropped.double().mean() < 0.35
    with pytest.raises(ValueError, match=r"--moe-cmr \(cmr\) mixes one dense FFN"):
        MoEConfig(model_dim=4, ffn_dim=4, num_experts=2, cmr=True).validate()
