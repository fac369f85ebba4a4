"""Contract of every registered gate (fairseq_moe_layer.GATES): logits [T, E] in fp32 for fp32, fp64
and bf16 input, with either gate_fp32 setting; gradient reaches every gate parameter; the gate
works inside MoELayer(gate=name), including the all-padding path; each has a help, shown with --moe-gate's
choices, and one without is refused."""
import dataclasses
import re

import pytest
import torch
from torch import nn

from fairseq_moe_layer import GATES, MoEConfig, MoELayer, register_gate
from fairseq_moe_layer.options import full_help

d, E = 16, 6


@pytest.mark.parametrize("fp32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(GATES))
def test_gate_contract(name, dtype, fp32):
    torch.manual_seed(0)
    gate = GATES[name](d, E, fp32=fp32)
    x = torch.randn(11, d).to(dtype).requires_grad_(True)
    logits = gate(x)
    assert logits.shape == (11, E) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    (logits * torch.randn(11, E)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for pname, p in gate.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    # Rows are independent: a token's logits do not depend on the other tokens.
    torch.testing.assert_close(gate(x[3:4]), logits[3:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(GATES))
def test_gate_inside_layer(name):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=d, ffn_dim=8, num_experts=E, top_k=2, gate=name))
    assert isinstance(layer.gate, GATES[name])
    x = torch.randn(2, 5, d, requires_grad=True)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    y, aux = layer(x, pad)
    assert y.shape == x.shape and torch.isfinite(y).all()
    (y.pow(2).sum() + aux.balance_loss + aux.z_loss).backward()
    for pname, p in layer.gate.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    # Every token padded: zero output and losses, backward still runs.
    y, aux = layer(x, torch.ones(2, 5, dtype=torch.bool))
    (y.sum() + aux.balance_loss + aux.z_loss).backward()
    assert y.abs().sum() == 0 and aux.balance_loss.item() == 0


def test_bf16_layer_with_fp32_gate():
    """A bf16 model: the experts run in bf16, the router in fp32."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=d, ffn_dim=8, num_experts=E, top_k=2)).to(torch.bfloat16)
    x = torch.randn(7, d, dtype=torch.bfloat16)
    assert layer.gate(x).dtype == torch.float32
    y, aux = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert aux.balance_loss.dtype == torch.float32


def test_scaled_cosine_is_soft_moes_normalised_router():
    """scale * <x / |x|, phi_i / |phi_i|>: invariant to the size of x and of each phi_i; bounded by |scale|;
    the scale is learned (init 1)."""
    torch.manual_seed(0)
    gate = GATES["scaled_cosine"](d, E)
    x = torch.randn(9, d)
    want = torch.nn.functional.cosine_similarity(x[:, None, :], gate.weight[None, :, :], dim=-1)
    torch.testing.assert_close(gate(x), want)
    torch.testing.assert_close(gate(x * 1e3), want)
    with torch.no_grad():
        gate.weight.mul_(torch.arange(1, E + 1, dtype=torch.float32)[:, None])
        gate.scale.fill_(4.0)
    torch.testing.assert_close(gate(x), 4 * want)
    assert gate(x).abs().max() <= 4.0 + 1e-5


def test_cosine_gate_learns_a_clamped_temperature():
    """Tutel's cosine router: cos(x W + b, e_i) * exp(log_inv_temperature), the scale clamped at 1 / 0.01."""
    torch.manual_seed(0)
    gate = GATES["cosine"](d, E)
    x = torch.randn(9, d)
    h = gate.proj(x)
    cos = torch.nn.functional.cosine_similarity(h[:, None, :], gate.weight[None, :, :], dim=-1)
    torch.testing.assert_close(gate(x), cos / 0.5)  # init t = 0.5
    with torch.no_grad():
        gate.log_inv_temperature.fill_(10.0)  # t = e^-10 asked for: clamped at 0.01
    logits = gate(x)
    torch.testing.assert_close(logits, cos / 0.01)
    logits.sum().backward()
    assert gate.log_inv_temperature.grad == 0  # (beyond the clamp, like Tutel's)


def test_cosine_gate_checkpoint_from_before_the_learned_temperature():
    """A gate saved with the fixed t = 0.07 and no projection bias computes what it computed then."""
    torch.manual_seed(0)
    gate = GATES["cosine"](d, E)
    old = {"proj.weight": gate.proj.weight.detach().clone(), "weight": gate.weight.detach().clone()}
    gate.load_state_dict(old)
    x = torch.randn(5, d)
    want = torch.nn.functional.cosine_similarity(
        torch.nn.functional.linear(x, old["proj.weight"])[:, None, :], old["weight"][None, :, :], dim=-1) / 0.07
    torch.testing.assert_close(gate(x), want)


@pytest.mark.parametrize("name", sorted(GATES))
def test_every_gate_has_a_help_that_the_flag_shows(name):
    """--moe-gate's help (and the flag table) names each gate with its help, as --moe-routing's does each policy."""
    help = GATES[name].help
    assert isinstance(help, str) and help.strip(), name
    gate = next(f for f in dataclasses.fields(MoEConfig) if f.name == "gate")
    assert f"{name}: {help}" in full_help(gate)


def test_a_gate_without_help_is_refused_at_registration():
    class Helpless(nn.Module):
        def forward(self, x):
            return x

    for how in (register_gate("helpless"), register_gate("helpless", help="  ")):
        with pytest.raises(ValueError, match=re.escape("gate 'helpless' has no help")):
            how(Helpless)
        assert "helpless" not in GATES
    try:  # help= gives it one
        assert register_gate("helpless", help="says nothing")(Helpless).help == "says nothing"
        assert "helpless: says nothing" in full_help(next(f for f in dataclasses.fields(MoEConfig) if f.name == "gate"))
    finally:
        GATES.pop("helpless", None)
