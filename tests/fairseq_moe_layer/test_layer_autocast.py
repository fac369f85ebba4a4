"""MoELayer under torch.autocast follows it as nn.Linear does: the expert GEMMs run in the autocast dtype (the layer
equals a copy whose expert weights are cast to that dtype, run without autocast: output and every gradient, on every
backend that runs on the CPU), while the gate's logits, the routing and the losses stay fp32."""
import copy

import pytest
import torch

from fairseq_moe_kernels import torch_grouped
from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.gates import GATES

DTYPES = [torch.bfloat16, torch.float16]


def _skip_unless_runs(backend, dtype):
    try:
        with torch.autocast("cpu", dtype):
            pass
    except (RuntimeError, ValueError) as err:  # (older torch: CPU autocast is bf16 only)
        pytest.skip(f"torch {torch.__version__} has no CPU autocast to {dtype}: {err}")
    if backend == "triton":
        pytest.importorskip("triton")
    if backend == "grouped_mm" and not torch_grouped.supported("cpu", dtype):
        pytest.skip(f"torch {torch.__version__}'s grouped_mm does not run {dtype} on the CPU")


def step(layer, x, autocast=None):
    """One forward and backward: (y, aux, {name: gradient} of x and every parameter)."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", autocast or torch.float32, enabled=autocast is not None):
        y, aux = layer(x)
        loss = (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + 0.1 * aux.balance_loss \
            + 0.01 * aux.z_loss
    loss.backward()
    return y.detach(), aux, {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared_expert"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "triton"])
def test_layer_under_autocast_equals_layer_with_low_precision_experts(backend, dtype, shared):
    _skip_unless_runs(backend, dtype)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=16, ffn_dim=32, num_experts=4, top_k=2, capacity_factor=0.0,
                               activation="gelu", shared_experts=shared, kernel_backend=backend))
    ref = copy.deepcopy(layer)  # the same layer, its experts' weights in `dtype`, no autocast
    ref.experts.to(dtype)
    if shared:
        ref.shared.to(dtype)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    y, aux, grads = step(layer, x, autocast=dtype)
    y_ref, aux_ref, grads_ref = step(ref, x)
    assert y.dtype == dtype == y_ref.dtype  # (what nn.Linear under autocast returns)
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=1e-3)
    assert aux.balance_loss.dtype == aux.z_loss.dtype == torch.float32
    torch.testing.assert_close(aux.balance_loss, aux_ref.balance_loss)
    torch.testing.assert_close(aux.z_loss, aux_ref.z_loss)
    assert torch.equal(aux.counts, aux_ref.counts)
    assert set(grads) == set(grads_ref)
    for name, g in grads.items():
        param = dict(layer.named_parameters()).get(name)
        assert g.dtype == (torch.float32 if param is None else param.dtype), name  # (the fp32 master weights')
        torch.testing.assert_close(g, grads_ref[name].float(), rtol=2e-2, atol=2e-3, msg=name)


def test_the_low_precision_experts_differ_from_fp32():
    """The comparison above can fail: the fp32 layer's output is not within its tolerance of the bf16 one."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=16, ffn_dim=32, num_experts=4, top_k=2, capacity_factor=0.0))
    ref = copy.deepcopy(layer)
    ref.experts.to(torch.bfloat16)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    y, y_ref = step(layer, x)[0], step(ref, x)[0]
    assert not torch.allclose(y, y_ref.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate", sorted(GATES))
def test_gate_logits_stay_fp32_under_autocast(gate, dtype):
    """Every gate with fp32=True (the default: --moe-gate-fp32) makes the same fp32 logits under autocast as
    without it; with fp32=False they follow autocast but are handed on as fp32."""
    _skip_unless_runs("torch", dtype)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=16, ffn_dim=32, num_experts=4, gate=gate))
    x = torch.randn(11, 16)
    want, _ = layer.router_logits(x)
    with torch.autocast("cpu", dtype):
        got, _ = layer.router_logits(x)
        layer.gate.fp32 = False
        low, _ = layer.router_logits(x)
    assert got.dtype == low.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(low, want)  # (fp32=False does follow autocast: its GEMMs ran in dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_soft_routing_under_autocast_runs_the_experts_in_that_dtype(dtype):
    """Soft MoE's slots go through the experts in the autocast dtype too (its einsums follow autocast themselves):
    the experts get rows of that dtype, and the output is the fp32 layer's within that dtype's rounding."""
    _skip_unless_runs("torch", dtype)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=16, ffn_dim=32, num_experts=4, routing="soft", soft_slots=2))
    seen, forward = [], layer.experts.forward

    def spy(rows, counts, ops, weights=None):
        out = forward(rows, counts, ops, weights=weights)
        seen.append((rows.dtype, out.dtype))
        return out
    layer.experts.forward = spy
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    want, _ = layer(x)
    seen.clear()
    with torch.autocast("cpu", dtype):
        y, _ = layer(x)
    assert seen == [(dtype, dtype)]
    torch.testing.assert_close(y.float(), want, rtol=5e-2, atol=5e-2)
    assert not torch.equal(y.float(), want)


def test_autocast_dtype_where_there_is_none():
    """A meta tensor's device has no autocast: the layer's helpers say off instead of raising (shape tracing)."""
    from fairseq_moe_layer.experts import autocast_dtype, autocast_off

    assert autocast_dtype("meta") is None and autocast_dtype("cpu") is None
    with autocast_off("meta"):
        pass
    with torch.autocast("cpu", torch.bfloat16):
        assert autocast_dtype("cpu") == torch.bfloat16
