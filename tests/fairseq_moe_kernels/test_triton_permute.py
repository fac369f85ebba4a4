"""fairseq_moe_kernels/triton_permute.py against reference.permute / reference.unpermute.

In fp32 (the interpreter on CPU, compiled on a GPU when there is one), and fp64 rows with fp32
weights: the permuted rows, the unpermuted sum, and the gradients of x, rows and weights equal the
reference, for the token_index a router makes (k in {1, 2, 4}, empty experts, one expert holding
every row, capacity drops that leave tokens with no row), T spanning two token blocks and not a
multiple of one, d not a power of two and wider than one d chunk, no rows at all, one token holding
many rows, non-contiguous inputs; the unpermute is bitwise repeatable. GPU (marked gpu): bf16/fp16
against an fp32 reference. Compiled for sm_90 without a GPU:
test_triton_grouped_mlp.py::test_kernels_compile_for_sm90.
Legend: T tokens, N rows, d model dim, E experts, k choices per token.
"""
import importlib

import pytest
import torch

from fairseq_moe_kernels import reference

# Without a GPU, Triton runs in its interpreter on CPU tensors (tests/conftest.py); with one, the same
# fp32 tests run compiled on it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = {  # E = 5 bias added to the router logits
    "random": [0.0] * 5,
    "empty_experts": [-30.0, 0, 0, -30.0, 0],
    "one_expert_all": [0, 0, 30.0, 0, 0],
}
GPU_TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.fixture(scope="module")
def tp():
    pytest.importorskip("triton")
    return importlib.import_module("fairseq_moe_kernels.triton_permute")


def routed_index(T, k, layout, keep=1.0, seed=0):
    """token_index of a router's expert-sorted rows; keep < 1 drops a random subset (capacity)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 5, generator=g) + torch.tensor(LAYOUTS[layout])
    order = reference.router(logits, k)[3]
    kept = torch.rand(order.numel(), generator=g) < keep
    return (order[kept] % T).to(DEVICE)


def check(tp, x, token_index, weights, rows, tol, ref_dtype=None):
    """Triton permute/unpermute == reference: values, then grads of x, rows, weights.

    ref_dtype: run the reference on inputs cast to it (an fp32 reference for bf16/fp16)."""
    T, N = x.shape[0], token_index.numel()
    g = torch.Generator().manual_seed(1)
    grad_rows = torch.randn(N, x.shape[1], generator=g).to(x)
    grad_out = torch.randn(T, x.shape[1], generator=g).to(rows)
    cast = (lambda t: t.to(ref_dtype)) if ref_dtype else (lambda t: t)  # noqa: E731
    results = []
    for impl, conv in ((tp, lambda t: t), (reference, cast)):
        xa, ra, wa = (conv(t.detach()).requires_grad_() for t in (x, rows, weights))
        perm = impl.permute(xa, token_index)
        out = impl.unpermute(ra, token_index, wa, T)
        torch.autograd.backward((perm, out), (conv(grad_rows), conv(grad_out)))
        results.append((perm, out, xa.grad, ra.grad, wa.grad))
    names = ("permute", "unpermute", "grad x", "grad rows", "grad weights")
    dtypes = (x.dtype, rows.dtype, x.dtype, rows.dtype, weights.dtype)  # the reference's, uncast
    for name, dtype, a, b in zip(names, dtypes, *results):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.to(b.dtype), b, **tol, msg=name)
    return results[0]


def tensors(T, N, d, x_dtype=torch.float32, rows_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=torch.float64).to(x_dtype)
    rows = torch.randn(N, d, generator=g, dtype=torch.float64).to(rows_dtype)
    weights = torch.rand(N, generator=g)  # fp32 like the routing weights
    return x.to(DEVICE), rows.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("keep", [1.0, 0.6])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_reference_on_routed_rows(tp, k, layout, keep):
    T, d = 37, 20  # T: one full token block of 32 and a partial one
    token_index = routed_index(T, k, layout, keep, seed=k)
    x, rows, weights = tensors(T, token_index.numel(), d)
    perm, out, *_ = check(tp, x, token_index, weights, rows, dict(rtol=1e-6, atol=1e-6))
    assert torch.equal(perm, x[token_index])  # a gather is exact
    if keep < 1:  # dropped tokens get exact zeros
        missing = torch.ones(T, dtype=torch.bool, device=DEVICE)
        missing[token_index] = False
        assert missing.any() and out[missing].abs().sum() == 0


@pytest.mark.parametrize("case", ["wide_d", "no_rows", "busy_token", "fp64_rows"])
def test_matches_reference_edge_cases(tp, case):
    T, d = 13, {"wide_d": 72, "fp64_rows": 9}.get(case, 20)  # 72: two d chunks of 64
    if case == "no_rows":
        token_index = torch.empty(0, dtype=torch.long, device=DEVICE)
    elif case == "busy_token":
        token_index = torch.tensor([4, 0, 4, 4, 12, 4, 4, 0, 4, 4], device=DEVICE)  # token 4: 7 rows
    else:
        token_index = routed_index(T, 2, "random", keep=0.8)
    rows_dtype = torch.float64 if case == "fp64_rows" else torch.float32
    x, rows, weights = tensors(T, token_index.numel(), d, rows_dtype=rows_dtype)
    _, out, gx, *_ = check(tp, x, token_index, weights, rows, dict(rtol=1e-6, atol=1e-6))
    if case == "no_rows":
        assert out.abs().sum() == 0 and gx.abs().sum() == 0


def test_noncontiguous_inputs_and_repeatable(tp):
    token_index = routed_index(37, 2, "random")
    x, rows, weights = tensors(37, token_index.numel(), 24)
    x, rows = x.t().contiguous().t(), rows.t().contiguous().t()  # column-major views
    assert not x.is_contiguous() and not rows.is_contiguous()
    check(tp, x, token_index, weights, rows, dict(rtol=1e-6, atol=1e-6))
    outs = [tp.unpermute(rows, token_index, weights, 37) for _ in range(2)]
    assert torch.equal(*outs)


def test_only_weights_need_grad(tp):
    token_index = routed_index(13, 2, "random")
    _, rows, weights = tensors(13, token_index.numel(), 20)
    wa, wb = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    tp.unpermute(rows, token_index, wa, 13).pow(2).sum().backward()
    reference.unpermute(rows, token_index, wb, 13).pow(2).sum().backward()
    torch.testing.assert_close(wa.grad, wb.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpu_matches_fp32_reference(tp, dtype, k):
    T, d = 4099, 1000
    token_index = routed_index(T, k, "random", keep=0.9)
    x, rows, weights = tensors(T, token_index.numel(), d, dtype, dtype)
    check(tp, x, token_index, weights, rows, GPU_TOL[dtype], ref_dtype=torch.float32)
    outs = [tp.unpermute(rows, token_index, weights, T) for _ in range(2)]
    assert torch.equal(*outs)  # no atomics: bitwise repeatable
