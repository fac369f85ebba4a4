"""fairseq_moe_kernels/torch_grouped.py (backend grouped_mm: the expert MLP on torch.nn.functional.grouped_mm) against the
reference (one GEMM per expert): output and every gradient, every activation (swiglu: the experts without biases),
activation dropout (the same mask),
an empty expert, odd sizes (fp32), no rows at all; fp32 and bf16 on the CPU."""
import pytest
import torch

from fairseq_moe_kernels import backend, reference, torch_grouped
from fairseq_moe_kernels.cases import CASES, make_inputs

from tests.fairseq_moe_kernels.test_cases import fresh, outputs_and_grads

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("op", ["grouped_mlp", "moe_mlp"])
@pytest.mark.parametrize("k", [1, 2])
def test_grouped_mm_equals_the_reference(op, activation, dtype, k):
    ops = backend.ops("grouped_mm")
    # fp32: odd widths (padded to 16-byte rows for the GEMMs); bf16: aligned ones (on odd ones padded in both d and
    # f, torch 2.13's CPU grouped_mm loses ~10x the reference's bf16 precision in the fc1 gradients)
    d, f = (7, 9) if dtype == torch.float32 else (8, 16)
    I = make_inputs(reference, E=5, T=11, d=d, k=k, dtype=dtype, device="cpu", seed=k, empty_expert=True, f=f,
                    activation=activation)  # (swiglu: no biases, each half of W1 padded apart)
    call, diff = CASES[op]
    want_out, want_grads = outputs_and_grads(call, reference, fresh(I), diff, activation)
    got_out, got_grads = outputs_and_grads(call, ops, fresh(I), diff, activation)
    if dtype == torch.float32:
        for got, want in zip(got_out, want_out):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, got, want in zip(diff, got_grads, want_grads):
            assert (got is None) == (want is None), name
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    else:  # bf16: as close to the fp32 result as the reference's bf16 result is (within 3x, or 0.01)
        exact = {n: (v.detach().float().requires_grad_(v.requires_grad) if torch.is_tensor(v) and v.is_floating_point()
                     else v) for n, v in I.items()}
        true_out, true_grads = outputs_and_grads(call, reference, exact, diff, activation)
        for name, got, want, true in zip(["out"] * len(got_out) + list(diff), [*got_out, *got_grads],
                                         [*want_out, *want_grads], [*true_out, *true_grads]):
            if true is None:  # (swiglu: no biases)
                assert got is None and want is None, name
                continue
            ours, theirs = ((t.float() - true).abs().max().item() for t in (got, want))
            assert ours <= 3 * theirs + 0.01, (name, ours, theirs)
    assert int(I["counts"][0]) == 0  # (an empty expert: its weight gradients are zero in both)


def test_activation_dropout_draws_the_reference_mask():
    I = make_inputs(reference, E=3, T=9, d=5, k=2, dtype=torch.float32, device="cpu", seed=3, f=6)
    args = (I["rows"], I["counts"], I["w1"], I["b1"], I["w2"], I["b2"], "gelu", 0.3)
    torch.manual_seed(11)
    want = reference.grouped_mlp(*args)
    torch.manual_seed(11)
    got = torch_grouped.grouped_mlp(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.manual_seed(12)
    assert not torch.allclose(torch_grouped.grouped_mlp(*args), want)  # (dropout on: another mask, another output)


def test_no_rows():
    w1, b1 = torch.randn(2, 4, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    w2, b2 = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    y = torch_grouped.grouped_mlp(torch.randn(0, 4), torch.zeros(2, dtype=torch.long), w1, b1, w2, b2)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in (w1, b1, w2, b2))


def test_the_probe():
    torch_grouped._supported.cache_clear()
    with torch.no_grad():  # (first asked under no_grad, as in generation: it still probes forward and backward)
        assert torch_grouped.supported(torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        assert torch_grouped.supported(torch.device("cpu"), torch.bfloat16)
    assert not torch_grouped.supported(torch.device("cuda"), torch.float32) or torch.cuda.is_available()


GPU_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # relative (norm) error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_grouped_mm_on_the_gpu_close_to_the_fp32_reference(dtype):
    """On the device (benchmarks/gpu_check.sh runs it): where torch's grouped GEMM runs the dtype, the expert
    MLP (output and every gradient) is close to the fp32 reference at sizes of many tiles; auto takes it only where
    PyTorch runs its own kernel (bf16 on Hopper and Blackwell)."""
    device = torch.device("cuda")
    assert backend.resolve("auto", device, dtype) == ("grouped_mm" if torch_grouped.fast(device, dtype) else "torch")
    if not torch_grouped.supported(device, dtype):
        pytest.skip(f"torch {torch.__version__}'s grouped_mm does not run {dtype} on this device")
    I = make_inputs(reference, E=8, T=1000, d=264, k=2, dtype=dtype, device="cuda", seed=3, empty_expert=True, f=712)
    exact = {n: (v.detach().float().requires_grad_(v.requires_grad) if torch.is_tensor(v) and v.is_floating_point()
                 else v) for n, v in I.items()}
    for op in ("grouped_mlp", "moe_mlp"):
        call, diff = CASES[op]
        got_out, got_grads = outputs_and_grads(call, backend.ops("grouped_mm"), fresh(I), diff, "gelu")
        true_out, true_grads = outputs_and_grads(call, reference, fresh(exact), diff, "gelu")
        for name, got, true in zip(["out"] * len(got_out) + list(diff), [*got_out, *got_grads],
                                   [*true_out, *true_grads]):
            err = float((got.float() - true).norm() / true.norm().clamp(min=1e-30))
            assert err < GPU_TOL[dtype], (op, name, err)


def test_no_rows_keep_the_input_in_the_graph():
    """A rank whose experts got no rows still runs the backward of what brought them (the all-to-all): the output's
    graph reaches x, as the reference's does."""
    x = torch.randn(0, 4, requires_grad=True)
    ws = [torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 8), torch.randn(2, 8, 4), torch.randn(2, 4)]
    for fn in (torch_grouped.grouped_mlp, reference.grouped_mlp):
        (gx,) = torch.autograd.grad(fn(x, torch.zeros(2, dtype=torch.long), *ws).sum(), [x])
        assert gx.shape == (0, 4)


def test_the_probe_draws_no_random_number_and_saves_no_tensor():
    """It may first run inside a checkpointed forward, whose recompute would not run it again."""
    torch_grouped._supported.cache_clear()
    state = torch.random.get_rng_state()

    def saved(t):
        raise AssertionError("the probe saved a tensor for a backward")

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
        assert torch_grouped.supported("cpu", torch.float32)
    assert torch.equal(torch.random.get_rng_state(), state)
