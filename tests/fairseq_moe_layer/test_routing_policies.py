"""Every routing policy of routing.ROUTINGS (a new one is covered by registering it), then each against
an independent plain-loop oracle: expert choice (Zhou et al. 2022) gives every expert exactly C tokens,
dense sends every token to every expert. Gate noise, per-call settings and the eval top-k."""
import dataclasses
import math
import re

import pytest
import torch

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.gates import noisy_logits
from fairseq_moe_layer.routing import ROUTINGS, soft_weights

from tests.fairseq_moe_layer.oracle import expert_choice_oracle, policy_oracle

T, E = 13, 4


def logits_for(seed, T=T, E=E):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


@pytest.mark.parametrize("name", sorted(n for n in ROUTINGS if not ROUTINGS[n].slots))
@pytest.mark.parametrize("k, capacity", [(1, 5), (2, 4), (2, None)])
def test_policy_contract(name, k, capacity):
    policy = ROUTINGS[name]
    if not policy.dropless and capacity is None:
        capacity = 7  # MoEConfig gives a policy without a dropless form a capacity always
    logits = logits_for(k).requires_grad_()
    options = MoEConfig(model_dim=4, ffn_dim=4, num_experts=E)
    r = ROUTINGS[name](logits, k, capacity, cfg=options, token_ids=torch.arange(T) * 7)
    N = r.token_index.numel()
    assert r.token_index.shape == r.weights.shape == (N,) and r.counts.shape == r.demand.shape == (E,)
    assert int(r.counts.sum()) == N and bool((r.token_index >= 0).all()) and bool((r.token_index < T).all())
    assert bool((r.weights >= 0).all()) and r.probs.shape == (T, E)
    if r.capacity is not None:
        assert int(r.counts.max()) <= r.capacity  # never over capacity
    # Inside an expert's rows a token appears at most once.
    for rows in torch.split(r.token_index, r.counts.tolist()):
        assert rows.unique().numel() == rows.numel()
    assert 0.0 <= float(r.dropped) <= 1.0
    if not policy.learned_router:  # no router: nothing to learn
        assert not r.weights.requires_grad
    else:
        (r.weights * torch.arange(N, dtype=torch.float64)).sum().backward()
        assert logits.grad is not None and logits.grad.abs().sum() > 0  # the router learns through the weights
    again = ROUTINGS[name](logits.detach(), k, capacity, cfg=options, token_ids=torch.arange(T) * 7)
    assert torch.equal(again.token_index, r.token_index) and torch.equal(again.weights, r.weights.detach())


@pytest.mark.parametrize("capacity", [1, 3, 13, 20])
def test_expert_choice_gives_every_expert_exactly_c_tokens(capacity):
    logits = logits_for(3)
    r = ROUTINGS["expert_choice"](logits, 2, capacity)
    C = min(capacity, T)
    assert r.counts.tolist() == [C] * E
    expected = expert_choice_oracle(torch.softmax(logits.float(), -1), capacity)  # routing is fp32
    rows = torch.split(torch.arange(r.token_index.numel()), r.counts.tolist())
    for e in range(E):
        assert r.token_index[rows[e]].tolist() == [t for t, _ in expected[e]]
        assert torch.equal(r.weights[rows[e]], torch.stack([w for _, w in expected[e]]))
    per_token = torch.bincount(r.token_index, minlength=T)
    assert float(r.dropped) == pytest.approx(float((per_token == 0).double().mean()))  # 0..E experts per token


def test_dense_routes_every_token_to_every_expert():
    logits = logits_for(4)
    r = ROUTINGS["dense"](logits, 2, 3)  # k and capacity are not used
    assert r.counts.tolist() == [T] * E and float(r.dropped) == 0.0
    assert torch.equal(r.token_index, torch.arange(T).repeat(E))
    torch.testing.assert_close(r.weights.view(E, T).t(), torch.softmax(logits.float(), -1))


@pytest.mark.parametrize("routing, k, cf, training", [
    ("expert_choice", 1, 1.0, True), ("expert_choice", 2, 1.5, True), ("expert_choice", 2, 1.0, False),
    ("dense", 2, 0.0, True),
])
def test_layer_matches_plain_loop(routing, k, cf, training):
    """Output and every gradient of the layer equal a token-by-token loop (fp64)."""
    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=E, top_k=k, capacity_factor=cf, routing=routing,
                    eval_capacity_token_fraction=0.0, activation="gelu")
    torch.manual_seed(0)
    layer = MoELayer(cfg).double().train(training)
    x = torch.randn(T, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = layer(x1)
    ex = layer.experts
    params = [layer.gate.weight, ex.w1, ex.b1, ex.w2, ex.b2]
    copies = [p.detach().clone().requires_grad_() for p in params]
    capacity = math.ceil(cf * k * T / E) if routing == "expert_choice" else None  # eval fraction 0: as training
    want = policy_oracle(x2, *copies, routing, capacity, activation="gelu")
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert float(aux.balance_loss.detach()) == 0.0 and aux.imbalance == 1.0
    weight = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)
    (y * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("routing", ["expert_choice", "dense"])
def test_policies_with_padding_and_no_tokens(routing):
    layer = MoELayer(MoEConfig(model_dim=4, ffn_dim=6, num_experts=3, routing=routing))
    y, aux = layer(torch.randn(0, 4))
    assert y.shape == (0, 4) and aux.num_tokens == 0
    x = torch.randn(2, 5, 4)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    y, aux = layer(x, mask)
    assert aux.num_tokens == 8 and bool((y[0, 3:] == 0).all())
    alone, _ = layer(x[1:], mask[1:])  # a sentence's output does not depend on padding
    if routing == "dense":
        torch.testing.assert_close(alone, y[1:])


@pytest.mark.parametrize("noise", ["jitter", "gaussian"])
def test_gate_noise_is_training_only_and_seeded(noise):
    cfg = MoEConfig(model_dim=8, ffn_dim=6, num_experts=4, gate_noise=noise, gate_noise_scale=0.3)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    torch.manual_seed(0)
    clean = MoELayer(dataclasses.replace(cfg, gate_noise="none"))
    x = torch.randn(10, 8)
    layer.eval(), clean.eval()
    assert torch.equal(layer(x)[0], clean(x)[0])  # eval: noise-free
    layer.train(), clean.train()
    torch.manual_seed(1)
    a, clean = noisy_logits(layer.gate, x, noise, 0.3, True)
    torch.manual_seed(1)
    b, _ = noisy_logits(layer.gate, x, noise, 0.3, True)
    assert torch.equal(a, b) and not torch.equal(a, layer.gate(x))  # seeded, and noisy
    if noise == "gaussian":
        assert 0.2 < float((a - layer.gate(x)).std().detach()) < 0.4 and torch.equal(clean, layer.gate(x))
    else:  # the gate sees x scaled element-wise by a factor in [0.7, 1.3]
        torch.manual_seed(1)
        factor = torch.empty_like(x).uniform_(0.7, 1.3)
        torch.testing.assert_close(a, layer.gate(x * factor))
        assert bool(((factor >= 0.7) & (factor <= 1.3)).all())


def test_per_call_settings_and_eval_top_k():
    """forward(x, top_k=, capacity_factor=) equals a layer built with those settings (same weights);
    eval_top_k is the k of eval only."""
    base = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, capacity_factor=1.0,
                     eval_capacity_token_fraction=-1)
    x = torch.randn(9, 6)

    def layer(**overrides):
        torch.manual_seed(0)
        return MoELayer(dataclasses.replace(base, **overrides))

    two = layer()
    y, aux = two(x, top_k=1, capacity_factor=2.0)
    y1, aux1 = layer(top_k=1, capacity_factor=2.0)(x)
    assert torch.equal(y, y1) and aux.top_k == 1 and torch.equal(aux.counts, aux1.counts)
    assert torch.equal(two(x)[0], layer()(x)[0])  # the call's settings did not stay
    eval_one = layer(eval_top_k=1)
    assert torch.equal(eval_one(x)[0], two(x)[0])  # training: top_k
    eval_one.eval()
    top1 = layer(top_k=1).eval()
    assert torch.equal(eval_one(x)[0], top1(x)[0]) and eval_one(x)[1].top_k == 1
    with pytest.raises(ValueError, match="--moe-top-k"):
        two(x, top_k=5)


@pytest.mark.parametrize("routing", ["topk", "dense"])
def test_shared_experts_are_always_on(routing):
    """y = the routed experts' output + the sum of every shared expert on every token (DeepSeekMoE); the
    shared experts are plain parameters (data-parallel under expert parallelism)."""
    from tests.fairseq_moe_layer.oracle import expert_mlp

    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=4, top_k=2, routing=routing, shared_experts=2,
                    capacity_factor=0.0, activation="silu")
    torch.manual_seed(0)
    layer = MoELayer(cfg).double()
    assert not any(getattr(p, "expert", False) for p in layer.shared.parameters())
    assert all(getattr(p, "expert", False) for p in layer.experts.parameters())
    x = torch.randn(2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 5:] = True
    y, _ = layer(x, mask)
    routed_only = MoELayer(dataclasses.replace(cfg, shared_experts=0)).double()
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")})
    want, _ = routed_only(x, mask)
    s = layer.shared
    for b in range(2):
        for t in range(7):
            if not mask[b, t]:
                want[b, t] += sum(expert_mlp(x[b, t], e, s.w1, s.b1, s.w2, s.b2, "silu") for e in range(2))
    torch.testing.assert_close(y, want)
    assert bool((y[0, 5:] == 0).all())
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in s.parameters())


def test_hash_routing_maps_token_ids_to_experts():
    """Roller et al.: token id i goes to expert i mod E with weight 1, whatever the input; over capacity
    the later positions are dropped; no router parameters."""
    from tests.fairseq_moe_layer.oracle import expert_mlp

    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=3, top_k=1, routing="hash", capacity_factor=0.0)
    torch.manual_seed(0)
    layer = MoELayer(cfg).double()
    assert layer.gate is None and not [n for n, _ in layer.named_parameters() if n.startswith("gate")]
    ids = torch.tensor([[5, 2, 9, 4], [7, 7, 1, 0]])
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    y, aux = layer(x, token_ids=ids)
    ex = layer.experts
    for b in range(2):
        for t in range(4):
            want = expert_mlp(x[b, t], int(ids[b, t]) % 3, ex.w1, ex.b1, ex.w2, ex.b2)
            torch.testing.assert_close(y[b, t], want)
    assert aux.counts.tolist() == [2, 4, 2] and float(aux.balance_loss.detach()) == 0.0 and float(aux.z_loss.detach()) == 0.0
    capped = MoELayer(dataclasses.replace(cfg, capacity_factor=1.0)).double()  # C = ceil(8 / 3) = 3
    capped.load_state_dict(layer.state_dict())
    y2, aux2 = capped(x, token_ids=ids)
    assert aux2.counts.tolist() == [2, 3, 2]
    assert bool((y2[1, 2] == 0).all()) and torch.equal(y2[0], y[0])  # expert 1's 4th token (by position) dropped
    with pytest.raises(ValueError, match="token_ids"):
        layer(x)
    with pytest.raises(ValueError, match="--moe-top-k"):
        dataclasses.replace(cfg, top_k=2).validate()


def test_soft_weights_are_softmaxes_over_the_right_axes():
    logits = torch.randn(2, 5, 6, dtype=torch.float64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    dispatch, combine = soft_weights(logits, mask)
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 6, dtype=torch.float32))  # over the tokens
    assert bool((dispatch[1, 3:] == 0).all())  # padding is in no slot
    torch.testing.assert_close(combine[~mask].sum(-1), torch.ones(8, dtype=torch.float32))  # over the slots
    d_all, _ = soft_weights(logits, torch.ones(2, 5, dtype=torch.bool))
    assert not d_all.isnan().any() and not d_all.any()


@pytest.mark.parametrize("slots, padded", [(1, False), (2, True)])
def test_soft_moe_matches_plain_loop(slots, padded):
    from tests.fairseq_moe_layer.oracle import soft_oracle

    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=3, routing="soft", soft_slots=slots, activation="gelu")
    torch.manual_seed(0)
    layer = MoELayer(cfg).double()
    assert layer.gate.weight.shape == (3 * slots, 6)
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    mask = torch.zeros(3, 5, dtype=torch.bool)
    if padded:
        mask[1, 2:] = True
        mask[2, :] = True  # a group of padding only
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = layer(x1, mask if padded else None)
    ex = layer.experts
    params = [layer.gate.weight, ex.w1, ex.b1, ex.w2, ex.b2]
    copies = [p.detach().clone().requires_grad_() for p in params]
    want = soft_oracle(x2, *copies, slots, mask if padded else None, activation="gelu")
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-7)  # (the mixing weights are fp32, as the router's)
    assert aux.num_tokens == int((~mask).sum()) if padded else 15
    assert float(aux.demand.sum()) == pytest.approx(aux.num_tokens)  # every token's combine weights sum to 1
    weight = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)
    (y * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-7)
    for p, c in zip(params, copies):  # the slot router and the experts
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no top-k"):
        layer(x, top_k=1)


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_every_policy_takes_zero_tokens(name, shape):
    """A rank whose batch has no token (or only padding) still runs the layer: an empty output, losses that
    are zero and differentiable, as with tokens."""
    soft = ROUTINGS[name].slots
    cfg = MoEConfig(model_dim=8, ffn_dim=8, num_experts=E, routing=name, shared_experts=1,
                    top_k=ROUTINGS[name].only_top_k or 2, gate="scaled_cosine" if soft else "linear",
                    capacity_factor=1.0)
    layer = MoELayer(cfg)
    x = torch.zeros(*shape, requires_grad=True)
    kwargs = {"token_ids": torch.zeros(shape[:-1], dtype=torch.long)} if ROUTINGS[name].needs_token_ids else {}
    y, aux = layer(x, padding_mask=torch.zeros(shape[:-1], dtype=torch.bool), **kwargs)
    assert y.shape == shape and aux.num_tokens == 0
    (y.sum() + aux.balance_loss + aux.z_loss).backward()
    assert float(aux.balance_loss.detach()) == float(aux.z_loss.detach()) == 0.0


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_the_capacity_settings_follow_the_policys_properties(name):
    """--moe-capacity-counts-padding is refused exactly for the policies that have no capacity (Policy.has_capacity
    False: dense, soft); a policy that sends every token to every expert drops nothing."""
    policy = ROUTINGS[name]
    cfg = MoEConfig(model_dim=4, ffn_dim=4, num_experts=E, routing=name, top_k=policy.only_top_k or 2,
                    capacity_counts_padding=True)
    if policy.has_capacity:
        assert cfg.validate() is cfg
    else:
        with pytest.raises(ValueError, match=re.escape("--moe-capacity-counts-padding (capacity_counts_padding) "
                                                       f"has no capacity to set with --moe-routing {name}")):
            cfg.validate()
    if policy.every_expert:
        assert not policy.has_capacity and not policy.slots
        r = policy(logits_for(3).float(), 2, capacity=1, cfg=cfg)
        assert r.counts.tolist() == [T] * E and float(r.dropped) == 0


def test_no_module_of_the_layer_but_routing_names_a_policy():
    """Behaviour follows the policies' properties: no module of fairseq_moe_layer but routing.py spells a policy's
    name as a string (the default of --moe-routing is TopK.name)."""
    from pathlib import Path

    folder = Path(__file__).parents[2] / "fairseq_moe_layer"
    for path in sorted(folder.glob("*.py")):
        if path.name == "routing.py":
            continue
        text = path.read_text()
        for name in ROUTINGS:
            assert f'"{name}"' not in text and f"'{name}'" not in text, (path.name, name)


@pytest.mark.parametrize("name", sorted(n for n in ROUTINGS if ROUTINGS[n].learned_router))
def test_the_logits_are_made_once_per_forward_for_every_policy(name):
    """The layer makes the logits (MoELayer.router_logits: the gate and its noise) and hands them to the policy,
    whichever it is: the gate runs once per forward, under a policy of slots too."""
    policy = ROUTINGS[name]
    cfg = MoEConfig(model_dim=8, ffn_dim=6, num_experts=E, routing=name, top_k=policy.only_top_k or 2,
                    gate_noise="gaussian", gate_noise_scale=0.5, capacity_factor=1.0)
    layer = MoELayer(cfg).train()
    calls = []
    layer.gate.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0].shape))
    x = torch.randn(2, 5, 8)
    layer(x, token_ids=torch.arange(10).view(2, 5)) if policy.needs_token_ids else layer(x)
    assert calls == [torch.Size([10, 8])]


def test_gate_noise_acts_under_soft_routing():
    """--moe-gate-noise acts on the logits the soft policy mixes with: in training the output is the plain loop's
    with the same noise added to each token's logits, and the z-loss that of the noisy logits; at eval none."""
    from fairseq_moe_layer.losses import router_z_loss

    from tests.fairseq_moe_layer.oracle import soft_oracle

    slots, scale = 2, 0.7
    cfg = MoEConfig(model_dim=6, ffn_dim=5, num_experts=3, routing="soft", soft_slots=slots, gate_noise="gaussian",
                    gate_noise_scale=scale)
    torch.manual_seed(0)
    layer = MoELayer(cfg).double().train()
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    torch.manual_seed(4)
    y, aux = layer(x, mask)
    torch.manual_seed(4)
    noise = torch.randn(15, 3 * slots) * scale  # (what noisy_logits draws: randn_like of the fp32 logits)
    ex = layer.experts
    params = [p.detach() for p in (layer.gate.weight, ex.w1, ex.b1, ex.w2, ex.b2)]
    want = soft_oracle(x, *params, slots, mask, noise=noise.view(3, 5, -1))
    clean = soft_oracle(x, *params, slots, mask)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(y, clean, rtol=1e-3, atol=1e-4)  # the noise changed the output
    logits = torch.nn.functional.linear(x.reshape(15, 6).float(), params[0].float()) + noise
    torch.testing.assert_close(aux.z_loss, router_z_loss(logits[~mask.reshape(-1)]))
    layer.eval()
    y_eval, _ = layer(x, mask)
    torch.testing.assert_close(y_eval, clean, rtol=1e-5, atol=1e-7)
