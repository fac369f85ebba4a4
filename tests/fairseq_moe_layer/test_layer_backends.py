"""The whole MoELayer with the Triton kernels (in the interpreter on CPU, fp32) and with torch's grouped GEMM
(backend grouped_mm) equals the layer with the torch kernels: output, auxiliary losses, and the gradients of the
input, the gate and the experts. Each kernel is checked against its reference in tests/fairseq_moe_kernels; this checks how
the layer uses them."""
import pytest
import torch

from fairseq_moe_layer import MoEConfig, MoELayer


def run(backend, cfg, x, mask, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**cfg, kernel_backend=backend))
    torch.manual_seed(seed + 1)  # the same draws for the options that draw (training)
    x = x.clone().requires_grad_()
    ids = torch.arange(mask.numel()).view(mask.shape) * 7 if cfg.get("routing") == "hash" else None
    y, aux = layer(x, mask, token_ids=ids)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + 0.1 * aux.balance_loss + 0.01 * aux.z_loss
    loss.backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return y.detach(), aux, grads


@pytest.mark.parametrize("top_k, capacity_factor, routing", [
    (1, 0.0, "topk"), (2, 1.0, "topk"), pytest.param(4, 0.0, "topk", marks=pytest.mark.slow),
    (2, 0.5, "expert_choice"), (2, 0.0, "dense"), (2, 1.0, "batch_prioritized_routing"),
    (2, 1.0, "second_expert_policy=sampling"), (2, 1.0, "score=sigmoid"), (1, 1.0, "hash"), (2, 0.0, "soft"),
    (1, 1.0, "top1_weight=one")])
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_layer_on_each_backend_equals_torch_layer(backend, top_k, capacity_factor, routing):
    """Every routing policy through the backend's expert MLP (Triton: options of top-k routing skip its fused router,
    the rest of its path stays)."""
    if backend == "triton":
        pytest.importorskip("triton")
    option = {"batch_prioritized_routing": dict(batch_prioritized_routing=True),
              "second_expert_policy=sampling": dict(second_expert_policy="sampling"),
              "score=sigmoid": dict(score="sigmoid"),  # (the fused router's sigmoid)
              "top1_weight=one": dict(top1_weight="one")}.get(routing)
    cfg = dict(model_dim=20, ffn_dim=36, num_experts=5, top_k=top_k, capacity_factor=capacity_factor,
               activation="gelu", **(option or dict(routing=routing)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 20, generator=g)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:] = True  # padding, kept out of routing
    y_t, aux_t, g_t = run("torch", cfg, x, mask)
    y_k, aux_k, g_k = run(backend, cfg, x, mask)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux_k.counts, aux_t.counts) and torch.equal(aux_k.demand, aux_t.demand)
    if capacity_factor:
        assert aux_t.dropped_fraction > 0  # the capacity path is exercised (expert choice: untaken tokens)
    torch.testing.assert_close(aux_k.balance_loss, aux_t.balance_loss)
    assert set(g_k) == set(g_t)
    for name in g_t:
        torch.testing.assert_close(g_k[name], g_t[name], rtol=1e-5, atol=1e-6, msg=name)


def test_triton_without_interpreter_on_cpu_is_an_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = MoELayer(MoEConfig(model_dim=4, ffn_dim=6, num_experts=2, kernel_backend="triton"))
    with pytest.raises(ValueError, match="--moe-kernel-backend triton cannot run on cpu"):
        layer(torch.randn(3, 4))
