"""The router: reference.router against routing.route(), and fairseq_moe_kernels/triton_router.py against
reference.router.

Triton in fp32 (the interpreter on CPU, compiled on a GPU when there is one): weights, experts,
counts, order and the logits gradient equal the reference for k in {1, 2, 4}, softmax and sigmoid,
with and without renormalisation, T spanning several token blocks and not a multiple of one, E not
a power of two, empty experts, one expert taking every first choice, T = 1, fp64 and non-contiguous
logits; NaN logits keep expert ids in range. With exactly tied logits the experts follow the
documented rule (largest first, lowest id among ties; torch.topk leaves that order unspecified) and
order/counts are the stable sort of those experts. GPU (marked gpu): bf16, fp16 and fp32 logits
against the fp32 reference with per-dtype gradient tolerances. Compiled for sm_90 without a GPU:
test_triton_grouped_mlp.py::test_kernels_compile_for_sm90.
Legend: T tokens, E experts, k choices per token.
"""
import importlib

import pytest
import torch

from fairseq_moe_layer.routing import route
from fairseq_moe_kernels.reference import router, sort_assignments

# Without a GPU, Triton runs in its interpreter on CPU tensors (tests/conftest.py); with one, the same
# fp32 tests run compiled on it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sigmoid", True)]
# E = 7 (not a power of two). Added to the logits of each layout:
BIAS = {
    "random": [0.0] * 7,
    "empty_experts": [-30.0, 0, 0, 0, 0, -30.0, 0],  # experts 0 and 5 are never chosen
    "one_expert_all": [0, 0, 30.0, 0, 0, 0, 0],  # expert 2 is everyone's first choice
}
GPU_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3),
           torch.float16: dict(rtol=2e-3, atol=2e-4)}


@pytest.fixture(scope="module")
def tr():
    pytest.importorskip("triton")
    return importlib.import_module("fairseq_moe_kernels.triton_router")


def weights_given(logits, experts, score, renormalize):
    """reference.router's weights for the given experts, with autograd (for tied logits)."""
    probs = torch.softmax(logits.float(), -1) if score == "softmax" else torch.sigmoid(logits.float())
    w = probs.gather(1, experts)
    return w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).eps) if renormalize else w


def check_against_reference(tr, logits, k, score, renormalize, tol, same_experts=True):
    """Triton router == reference router on logits: values, experts, counts, order, logits grad.

    same_experts=False (tied logits): the experts must be the lowest-id-first top-k instead of
    torch.topk's, and the gradient reference uses those experts."""
    grad_w = torch.randn(logits.shape[0], k, generator=torch.Generator().manual_seed(7)).to(logits.device)
    a = logits.detach().clone().requires_grad_()
    w, experts, counts, order = tr.router(a, k, score, renormalize)
    w.backward(grad_w)
    # The reference runs on fp32 (or fp64) logits: its gradient is not rounded to bf16/fp16.
    b = logits.detach().to(torch.promote_types(logits.dtype, torch.float32)).requires_grad_()
    ref_w, ref_experts, ref_counts, ref_order = router(b, k, score, renormalize)
    if same_experts:
        assert torch.equal(experts, ref_experts)
        assert torch.equal(counts, ref_counts) and torch.equal(order, ref_order)
    else:
        rule = torch.argsort(-logits.float(), dim=1, stable=True)[:, :k]  # largest, lowest id first
        assert torch.equal(experts, rule)
        ref_w = weights_given(b, experts, score, renormalize)
    assert w.dtype == torch.float32 and experts.dtype == counts.dtype == order.dtype == torch.long
    # Whatever experts were picked, counts and order are their stable sort in assignment order.
    sorted_counts, sorted_order = sort_assignments(experts, logits.shape[1])
    assert torch.equal(counts, sorted_counts) and torch.equal(order, sorted_order)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    ref_w.backward(grad_w)
    assert a.grad.dtype == logits.dtype
    torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_router_matches_route(k, seed):
    """No capacity: route()'s top experts, demand == counts, kept order and weights (renormalised
    for k >= 2, raw for k = 1) come out of reference.router; seed 1 has tied logits."""
    g = torch.Generator().manual_seed(seed)
    T, E = 13, 5
    logits = torch.randn(T, E, generator=g) if seed == 0 else torch.randint(0, 3, (T, E), generator=g).float()
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    r = route(a, k, capacity=None)
    weights, experts, counts, order = router(b, k, renormalize=k >= 2)
    assert torch.equal(experts, r.top_experts)
    assert torch.equal(counts, r.demand) and torch.equal(counts, r.counts)
    assert torch.equal(order % T, r.token_index)
    flat = weights.t().reshape(-1)[order]  # [k*T] in the rows' order
    torch.testing.assert_close(flat, r.weights, rtol=0, atol=0)
    grad = torch.linspace(-1, 1, flat.numel())
    (r.weights * grad).sum().backward()
    (flat * grad).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def test_reference_order_is_the_stable_expert_sort():
    """By hand: T = 3, k = 2, E = 3. Assignments a = j*T + t in order: experts [2, 0, 2, 0, 1, 0]."""
    experts = torch.tensor([[2, 0], [0, 1], [2, 0]])
    counts, order = sort_assignments(experts, 3)
    assert counts.tolist() == [3, 1, 2]
    assert order.tolist() == [1, 3, 5, 4, 0, 2]


@pytest.mark.parametrize("layout", sorted(BIAS))
@pytest.mark.parametrize("score,renormalize", CASES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_triton_router_matches_reference(tr, k, score, renormalize, layout):
    E = len(BIAS[layout])
    T = 2 * tr.block_t(E) + 5  # three token blocks, the last one partial
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(k)) + torch.tensor(BIAS[layout])
    check_against_reference(tr, logits.to(DEVICE), k, score, renormalize, dict(rtol=1e-5, atol=1e-6))
    if layout != "random":
        counts = router(logits, k)[2]
        assert (counts == 0).any() if layout == "empty_experts" else counts[2] == T


@pytest.mark.parametrize("T,E,k", [(1, 5, 2), (13, 5, 4), (9, 3, 3), (20, 33, 4)])
def test_triton_router_small_and_odd_sizes(tr, T, E, k):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)) * 3
    check_against_reference(tr, logits.to(DEVICE), k, "softmax", True, dict(rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_triton_router_ties(tr, k):
    """Integer logits tie often: lowest id first; weights, counts, order and grads still agree."""
    logits = torch.randint(0, 3, (40, 6), generator=torch.Generator().manual_seed(k)).float()
    for score, renormalize in CASES:
        check_against_reference(tr, logits.to(DEVICE), k, score, renormalize, dict(rtol=1e-5, atol=1e-6),
                                same_experts=False)


def test_triton_router_fp64_noncontiguous_logits(tr):
    logits = torch.randn(6, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(DEVICE).t()
    assert not logits.is_contiguous()
    check_against_reference(tr, logits, 2, "softmax", False, dict(rtol=1e-5, atol=1e-7))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy on NaN
def test_triton_router_nan_logits_keep_ids_in_range(tr):
    """A NaN row is garbage in, but must not send rows out of range: k distinct experts, counts
    summing to k*T and order a permutation of the assignments."""
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    logits[2] = float("nan")
    logits[3, 1] = float("nan")
    _, experts, counts, order = tr.router(logits.to(DEVICE), 3)
    assert experts.min() >= 0 and experts.max() < 6
    assert all(len(set(row)) == 3 for row in experts.tolist())
    assert counts.sum() == 15 and torch.equal(order.sort().values.cpu(), torch.arange(15))


def test_triton_router_rejects_bad_arguments(tr):
    with pytest.raises(ValueError, match="score"):
        tr.router(torch.randn(4, 3), 1, "relu")
    with pytest.raises(AssertionError):
        tr.router(torch.randn(4, 3), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_triton_router_gpu(tr, dtype, k):
    """Low-precision logits tie often, so experts follow the lowest-id rule; the reference is fp32
    (scores are fp32 from the logits whatever their dtype, so only the logits grad is rounded)."""
    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(3001, 64, generator=g) * 2).to(dtype).cuda()
    for score, renormalize in CASES:
        check_against_reference(tr, logits, k, score, renormalize, GPU_TOL[dtype],
                                same_experts=dtype == torch.float32)
