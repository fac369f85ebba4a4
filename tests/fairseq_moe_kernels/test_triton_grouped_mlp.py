"""fairseq_moe_kernels/triton_grouped_mlp.py against fairseq_moe_kernels/reference.py (the ground truth).

grouped_mlp and moe_mlp: the output and the gradient of every floating input (x, the routing
weights, w1, b1, w2, b2) equal the reference's, for relu/gelu/silu and swiglu (no biases), odd sizes (T, N not multiples
of the row block, d and f not powers of two), empty experts, one expert holding every row, k in
{1, 2, 4} rows per token with tokens that keep no row, and activation dropout with a shared seed
(the mask is the reference's, bit for bit). Also: partial requires_grad with a strided x, strided
token_index and routing weights, no rows at all, the [N, f]-only saved state, bad counts and dtypes.
Without a GPU this runs in fp32 in Triton's interpreter (tests/conftest.py), and every kernel of
fairseq_moe_kernels/triton_*.py, each autotune config included, is compiled for sm_90 (H100/H200) offline; with
a GPU, the same tests run on it in fp32 ("ieee" dots), and the gpu-marked tests check bf16/fp16
against an fp32 reference, bitwise determinism, and rows whose [N, f] offsets pass 2**31.
Legend: T tokens, N rows, d model dim, f ffn dim, E experts, k rows per token.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from fairseq_moe_kernels import reference  # noqa: E402
from fairseq_moe_kernels import triton_grouped_mlp as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTS = ["relu", "gelu", "silu"]
# relu in the fast inner loop (pytest -m "not slow"); gelu and silu in the full suite
ACTS_MARKED = ["relu", *(pytest.param(a, marks=pytest.mark.slow) for a in ACTS[1:])]
TOL = dict(rtol=1e-5, atol=3e-5)
D, F = 20, 36  # odd on purpose: neither a power of two nor a multiple of a block
GROUPED_COUNTS = {  # E = 5, N = 37 rows
    "spread": [7, 3, 11, 9, 7],
    "first_and_last_empty": [0, 20, 0, 17, 0],
    "one_expert_has_all": [0, 0, 37, 0, 0],
}
MOE_ROUTES = {  # name: (T, E, k, route options)
    "k1": (23, 5, 1, dict(empty=[3])),
    "k1_one_expert_has_all": (23, 5, 1, dict(only=2)),
    "k2_capacity_drops": (21, 5, 2, dict(empty=[0], capacity=6)),  # 3 tokens keep no row
    "k4": (19, 6, 4, dict(empty=[4])),
}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def expert_weights(E, d=D, f=F, seed=0):
    g = gen(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [t.to(DEVICE) for t in (r(E, d, f) * d**-0.5, r(E, f) * 0.5, r(E, f, d) * f**-0.5, r(E, d) * 0.5)]


def routed(T, E, k, empty=(), only=None, capacity=None, seed=0):
    """(token_index [N], weights [N], counts [E]) built as fairseq_moe_layer.routing.route does: the k*T
    assignments in priority order (choice-major), stably sorted by expert, cut at the capacity."""
    logits = torch.randn(T, E, generator=gen(seed))
    logits[:, list(empty)] -= 100.0  # never chosen
    if only is not None:
        logits[:, only] += 100.0  # always chosen
    top_p, top_e = logits.softmax(-1).topk(k, dim=-1)  # [T, k]
    flat = top_e.t().reshape(-1)  # [k*T]: assignment j*T + t is token t's j-th choice
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    if capacity is not None:
        rank = torch.arange(order.numel()) - (counts.cumsum(0) - counts)[flat[order]]
        order, counts = order[rank < capacity], counts.clamp(max=capacity)
    return [t.to(DEVICE) for t in (order % T, top_p.t().reshape(-1)[order], counts)]


def run(fn, args, grad_seed=1, **kw):
    """fn(*args) and the gradients of its floating tensor args under a fixed random output gradient;
    the torch seed is reset first so that both ops draw the same dropout mask."""
    leaves = [a.detach().clone().requires_grad_(True) if a is not None and a.is_floating_point() else a for a in args]
    torch.manual_seed(7)
    out = fn(*leaves, **kw)
    out.backward(torch.randn(out.shape, generator=gen(grad_seed)).to(out))
    return out, [a.grad for a in leaves if a is not None and a.is_floating_point()]


def assert_same(ours, ref, names, **tol):
    torch.testing.assert_close(ours[0], ref[0], **(tol or TOL), msg=lambda m: f"output: {m}")
    for name, p, q in zip(names, ours[1], ref[1]):
        torch.testing.assert_close(p, q, **(tol or TOL), msg=lambda m, n=name: f"grad of {n}: {m}")


def grouped_args(counts, seed=0):
    x = torch.randn(sum(counts), D, generator=gen(seed + 1)).to(DEVICE)  # [N, d]
    return [x, torch.tensor(counts, device=DEVICE), *expert_weights(len(counts), seed=seed)]


def moe_args(route, seed=0):
    T, E, k, opts = MOE_ROUTES[route]
    token_index, weights, counts = routed(T, E, k, **opts, seed=seed)
    x = torch.randn(T, D, generator=gen(seed + 1)).to(DEVICE)  # [T, d]
    return [x, token_index, weights, counts, *expert_weights(E, seed=seed)]


@pytest.mark.parametrize("activation", ACTS_MARKED)
@pytest.mark.parametrize("layout", sorted(GROUPED_COUNTS))
def test_grouped_mlp_matches_reference(layout, activation):
    args = grouped_args(GROUPED_COUNTS[layout])
    ours = run(tri.grouped_mlp, args, activation=activation)
    assert_same(ours, run(reference.grouped_mlp, args, activation=activation), ["x", "w1", "b1", "w2", "b2"])
    for e, n in enumerate(GROUPED_COUNTS[layout]):  # experts without rows: exactly zero, not garbage
        if n == 0:
            assert all(g[e].abs().sum() == 0 for g in ours[1][1:])


@pytest.mark.parametrize("activation", ACTS_MARKED)
@pytest.mark.parametrize("route", sorted(MOE_ROUTES))
def test_moe_mlp_matches_reference(route, activation):
    args = moe_args(route)
    T, E, k, _ = MOE_ROUTES[route]
    rows_per_token = torch.bincount(args[1], minlength=T)
    assert rows_per_token.max() == k  # the route really gives tokens several rows
    ours = run(tri.moe_mlp, args, activation=activation)
    assert_same(ours, run(reference.moe_mlp, args, activation=activation),
                ["x", "weights", "w1", "b1", "w2", "b2"])
    dropped = rows_per_token == 0
    assert dropped.any() == ("capacity" in MOE_ROUTES[route][3])
    assert ours[0][dropped].abs().sum() == 0  # tokens that kept no row get zeros


def swiglu(args):
    """args with swiglu experts: w1 [E, d, 2f] (gate, then up), w2, no biases."""
    w1, _, w2, _ = args[-4:]
    return [*args[:-4], torch.cat([w1, w1.flip(0) * 0.8], 2), None, w2, None]


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_swiglu_experts_match_the_reference(p):
    """swiglu (both halves of W1 in one block, both kept; both halves of dh written), without biases, with and
    without activation dropout (the reference's mask): grouped_mlp and moe_mlp, output and every gradient."""
    args = swiglu(grouped_args(GROUPED_COUNTS["first_and_last_empty"]))
    assert_same(run(tri.grouped_mlp, args, activation="swiglu", dropout_p=p),
                run(reference.grouped_mlp, args, activation="swiglu", dropout_p=p), ["x", "w1", "w2"])
    args = swiglu(moe_args("k2_capacity_drops"))
    assert_same(run(tri.moe_mlp, args, activation="swiglu", dropout_p=p),
                run(reference.moe_mlp, args, activation="swiglu", dropout_p=p), ["x", "weights", "w1", "w2"])
    # with biases (no kind has them today; the kernels take them): b1 [E, 2f] over both halves, b2
    args[-3], args[-1] = torch.randn(5, 2 * F, generator=gen(3)).to(DEVICE), torch.randn(5, D, generator=gen(4)).to(DEVICE)
    assert_same(run(tri.moe_mlp, args, activation="swiglu", dropout_p=p),
                run(reference.moe_mlp, args, activation="swiglu", dropout_p=p),
                ["x", "weights", "w1", "b1", "w2", "b2"])


def test_moe_mlp_slots_sized_by_the_callers_bound():
    """rows_per_token (the layer's bound, known on the host: top-k's k) sizes the per-token slots without reading the
    device: at the bound and above it the result is the reference's; below it the device's assert stops it (checked
    on the CPU)."""
    from tests.host_reads import counted

    args = moe_args("k2_capacity_drops")
    ref = run(reference.moe_mlp, args)
    for bound in (None, 2, 3):
        with counted() as found:
            ours = run(tri.moe_mlp, args, rows_per_token=bound)
        reads = [where for where in found if "triton_grouped_mlp.py" in where]  # (the largest count of a token's rows)
        assert len(reads) == (bound is None), found
        assert_same(ours, ref, ["x", "weights", "w1", "b1", "w2", "b2"])
    if DEVICE == "cpu":  # (on CUDA the device assert is fatal to the process, and its message is not kept)
        with pytest.raises(RuntimeError, match="more than rows_per_token 1"):
            tri.moe_mlp(*args, rows_per_token=1)


@pytest.mark.parametrize("activation", ACTS_MARKED)
def test_dropout_draws_the_reference_mask(activation):
    """Same seed -> the same mask as reference (rand_like on the [N, f] activation, >= p)."""
    p = 0.4
    args = moe_args("k2_capacity_drops")
    ours = run(tri.moe_mlp, args, activation=activation, dropout_p=p)
    assert_same(ours, run(reference.moe_mlp, args, activation=activation, dropout_p=p),
                ["x", "weights", "w1", "b1", "w2", "b2"])
    assert not torch.allclose(ours[0], run(tri.moe_mlp, args, activation=activation)[0])  # it drops
    args = grouped_args(GROUPED_COUNTS["spread"])
    assert_same(run(tri.grouped_mlp, args, activation=activation, dropout_p=p),
                run(reference.grouped_mlp, args, activation=activation, dropout_p=p), ["x", "w1", "b1", "w2", "b2"])
    torch.manual_seed(7)
    y = tri.grouped_mlp(*[a.requires_grad_(a.is_floating_point()) for a in args], activation, p)
    (mask,) = [t for t in y.grad_fn.saved_tensors if t.dtype == torch.bool]
    torch.manual_seed(7)
    assert torch.equal(mask, torch.rand(args[0].shape[0], F, device=DEVICE) >= p)


def test_partial_requires_grad_and_strided_x():
    """x frozen and column-major (grouped), then only the routing weights and w2 need grad (moe)."""
    x, counts, w1, b1, w2, b2 = grouped_args(GROUPED_COUNTS["first_and_last_empty"])
    x = x.t().contiguous().t()
    assert not x.is_contiguous()
    outs = []
    for fn in (tri.grouped_mlp, reference.grouped_mlp):
        a1, a2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = fn(x, counts, a1, b1, a2, b2, "gelu")
        y.pow(2).sum().backward()
        outs.append((y, a1.grad, a2.grad))
    for p, q in zip(*outs):
        torch.testing.assert_close(p, q, **TOL)
    x, token_index, weights, counts, w1, b1, w2, b2 = moe_args("k4")
    outs = []
    for fn in (tri.moe_mlp, reference.moe_mlp):
        wt, a2 = weights.clone().requires_grad_(), w2.clone().requires_grad_()
        y = fn(x, token_index, wt, counts, w1, b1, a2, b2, "silu")
        y.pow(2).sum().backward()
        outs.append((y, wt.grad, a2.grad))
    for p, q in zip(*outs):
        torch.testing.assert_close(p, q, **TOL)


def test_moe_mlp_keeps_only_rows_of_width_f():
    """Backward state per row is [N, f] (the activation input, the mask) and [N] indices: no [N, d]
    permuted input or expert output is saved (d != f here, so they could not hide)."""
    x, token_index, weights, counts, *ws = moe_args("k2_capacity_drops")
    N = token_index.shape[0]
    y = tri.moe_mlp(x.requires_grad_(), token_index, weights, counts, *ws, "gelu", 0.2)
    per_row = [t.shape for t in y.grad_fn.saved_tensors if t.dim() == 2 and t.shape[0] == N]
    assert per_row and all(s == (N, F) for s in per_row), per_row


def test_strided_token_index_and_weights():
    """The kernels read token_index and the routing weights at unit stride: views with stride 2 must
    give the reference's output and weights gradient all the same."""
    x, token_index, weights, counts, *ws = moe_args("k2_capacity_drops")
    outs = []
    for fn in (tri.moe_mlp, reference.moe_mlp):
        wt = weights.clone().requires_grad_()
        strided_wt = torch.stack([wt, -wt], 1)[:, 0]  # [N] at stride 2, still differentiable
        strided_index = torch.stack([token_index, token_index.flip(0)], 1)[:, 0]
        assert not strided_wt.is_contiguous() and not strided_index.is_contiguous()
        y = fn(x, strided_index, strided_wt, counts, *ws, "gelu")
        y.pow(2).sum().backward()
        outs.append((y, wt.grad))
    for p, q in zip(*outs):
        torch.testing.assert_close(p, q, **TOL)


def test_no_rows():
    """Every token dropped: zeros out, zero weight gradients, zero x gradient."""
    x, _, _, _, *ws = moe_args("k1")
    E = ws[0].shape[0]
    empty_index = torch.zeros(0, dtype=torch.long, device=DEVICE)
    args = [x, empty_index, torch.zeros(0, device=DEVICE), torch.zeros(E, dtype=torch.long, device=DEVICE), *ws]
    out, grads = run(tri.moe_mlp, args, activation="relu")
    assert out.shape == x.shape and out.abs().sum() == 0
    assert grads[1].shape == (0,) and all(g.abs().sum() == 0 for g in grads)
    out, grads = run(tri.grouped_mlp, [x[:0], args[3], *ws], activation="relu")
    assert out.shape == (0, D) and all(g.abs().sum() == 0 for g in grads)


def test_bad_arguments():
    x, counts, *ws = grouped_args([3, 4])
    with pytest.raises(ValueError, match="counts sum to 8"):
        tri.grouped_mlp(x, counts + torch.tensor([0, 1], device=DEVICE), *ws)
    with pytest.raises(ValueError, match="unknown activation"):
        tri.grouped_mlp(x, counts, *ws, activation="tanh")
    # fp64 runs in the interpreter but tl.dot cannot compile it for a GPU: refused everywhere, clearly.
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        tri.grouped_mlp(x.double(), counts, *[w.double() for w in ws])
    args = [t.double() if t.is_floating_point() else t for t in moe_args("k1")]
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        tri.moe_mlp(*args)


# Run in a fresh interpreter without TRITON_INTERPRET: a stub driver lets JITFunction.warmup compile
# (Triton -> PTX -> cubin with Triton's own ptxas) for sm_90 without a GPU. Each launch of the real host
# code is replaced by a compile of every autotune config: a kernel that only the interpreter accepts,
# or a config over the shared memory of an H100/H200, fails here rather than on the GPU.
_COMPILE_SM90 = r'''
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.autotuner import Autotuner

class Offline(DriverBase):
    @classmethod
    def is_active(cls): return True
    def map_python_to_cpp_type(self, ty): return ty
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def get_benchmarker(self): raise RuntimeError("compile only")
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0

try:
    assert "nvidia" in triton.backends.backends, "this triton has no NVIDIA backend"
    triton.runtime.driver.set_active(Offline())
except (AssertionError, TypeError) as err:  # TypeError: abstract methods of another Triton's driver API
    print(err)
    sys.exit(3)
from fairseq_moe_kernels import triton_grouped_mlp as tri, triton_permute as tp, triton_router as tr
assert tri._TUNE
shared, every_config = {}, True

class Compile:  # stands in for a kernel: a launch compiles it (every autotune config) and runs nothing
    def __init__(self, kernel):
        tuned = isinstance(kernel, Autotuner)
        self.fn, self.configs = (kernel.fn, kernel.configs) if tuned else (kernel, [None])
        self.best_config = self.configs[0]  # what _rows reads after a launch
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for c in self.configs if every_config else self.configs[:1]:
                k = self.fn.warmup(*args, grid=(1,), **kwargs, **(c.all_kwargs() if c else {}))
                shared[self.fn.__name__] = max(shared.get(self.fn.__name__, 0), k.metadata.shared)
        return launch

for mod, names in ((tri, ["_rows_kernel", "_experts_kernel"]), (tp, ["_gather_rows", "_sum_rows"]),
                   (tr, ["_topk_kernel", "_order_kernel", "_backward_kernel"])):
    for name in names:
        setattr(mod, name, Compile(getattr(mod, name)))

def mlp(fn, dtype, activation, p):  # d, f multiples of 16 like real sizes (Triton specialises on it)
    T, d, f, counts = 48, 64, 96, torch.tensor([40, 0, 56])
    g = lambda *s: torch.randn(*s, dtype=dtype).requires_grad_()
    ws = [g(3, d, 2 * f), None, g(3, f, d), None] if activation == "swiglu" else [g(3, d, f), g(3, f), g(3, f, d), g(3, d)]
    if fn is tri.moe_mlp:
        y = fn(g(T, d), torch.arange(T).repeat(2), torch.rand(2 * T).requires_grad_(), counts, *ws, activation, p)
    else:
        y = fn(g(2 * T, d), counts, *ws, activation, p)
    y.backward(torch.ones_like(y))

mlp(tri.moe_mlp, torch.bfloat16, "gelu", 0.1)  # a training step's launches, each with every config
mlp(tri.moe_mlp, torch.bfloat16, "swiglu", 0.1)  # (GLU: two accumulators and W tiles in fc1's blocks)
every_config = False
mlp(tri.grouped_mlp, torch.bfloat16, "relu", 0.0)
mlp(tri.moe_mlp, torch.float32, "silu", 0.0)  # "ieee" dots
logits = torch.randn(100, 128, dtype=torch.bfloat16).requires_grad_()
tr.router(logits, 8, "softmax", True)[0].sum().backward()
index = torch.arange(50).repeat(2)
tp.permute(torch.randn(50, 64, dtype=torch.bfloat16).requires_grad_(), index).sum().backward()
rows = torch.randn(100, 64, dtype=torch.bfloat16).requires_grad_()
tp.unpermute(rows, index, torch.rand(100).requires_grad_(), 50).sum().backward()
print(json.dumps(shared))
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests compile and run every kernel")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run_ = subprocess.run([sys.executable, "-c", _COMPILE_SM90], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    if run_.returncode == 3:
        pytest.skip(f"cannot compile offline with this triton: {run_.stdout.strip()}")
    assert run_.returncode == 0, run_.stderr[-3000:]
    shared = json.loads(run_.stdout.strip().splitlines()[-1])  # kernel -> most shared memory of its configs
    assert set(shared) == {"_rows_gemm", "_experts_gemm", "_topk_kernel", "_order_kernel", "_backward_kernel",
                           "_gather_rows", "_sum_rows"}
    assert max(shared.values()) <= 227 * 1024, shared  # the most one block may use on an H100/H200


GPU_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # relative error (norm) of output and each gradient


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", sorted(GPU_TOL, key=str))
def test_low_precision_close_to_fp32_reference(dtype, activation):
    """bf16/fp16 inputs, fp32 accumulation: close to the fp32 reference on the same (rounded) values,
    at sizes that span many blocks and tiles (and the autotuned configs)."""
    T, E, k, d, f = 1000, 8, 2, 264, 712
    token_index, weights, counts = routed(T, E, k, empty=[5], capacity=300, seed=3)
    x = torch.randn(T, d, generator=gen(4)).to(DEVICE, dtype)
    ws = [w.to(dtype) for w in expert_weights(E, d, f, seed=5)]
    ours = run(tri.moe_mlp, [x, token_index, weights, counts, *ws], activation=activation)
    ref = run(reference.moe_mlp, [t.float() if t.is_floating_point() else t for t in
                                  (x, token_index, weights, counts, *ws)], activation=activation)
    assert ours[0].dtype == dtype and ours[1][1].dtype == torch.float32  # routing weights keep theirs
    for name, p, q in zip(["out", "x", "weights", "w1", "b1", "w2", "b2"], [ours[0], *ours[1]], [ref[0], *ref[1]]):
        assert rel_err(p, q) < GPU_TOL[dtype], (name, rel_err(p, q))
    rows = torch.randn(token_index.shape[0], d, generator=gen(6)).to(DEVICE, dtype)
    ours = run(tri.grouped_mlp, [rows, counts, *ws], activation=activation)
    ref = run(reference.grouped_mlp, [rows.float(), counts, *[w.float() for w in ws]], activation=activation)
    for name, p, q in zip(["out", "x", "w1", "b1", "w2", "b2"], [ours[0], *ours[1]], [ref[0], *ref[1]]):
        assert rel_err(p, q) < GPU_TOL[dtype], (name, rel_err(p, q))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_on_gpu():
    """No float atomics: two runs give bitwise equal outputs and gradients."""
    token_index, weights, counts = routed(777, 8, 4, seed=1)
    x = torch.randn(777, 136, generator=gen(2)).to(DEVICE, torch.bfloat16)
    args = [x, token_index, weights, counts, *[w.bfloat16() for w in expert_weights(8, 136, 360)]]
    first, second = run(tri.moe_mlp, args, activation="gelu"), run(tri.moe_mlp, args, activation="gelu")
    for p, q in zip([first[0], *first[1]], [second[0], *second[1]]):
        assert torch.equal(p, q)


def check_rows_past(T, E, k, d, f, first, dtype, tol):
    """moe_mlp against the reference (same dtype) where it touches rows n >= first: the output and x
    gradient of their tokens, their weights gradient, the weight gradients of their experts."""
    token_index, weights, counts = routed(T, E, k, seed=8)
    x = torch.randn(T, d, generator=gen(9)).to(DEVICE, dtype)
    args = [x, token_index, weights, counts, *[w.to(dtype) for w in expert_weights(E, d, f, seed=10)]]
    ours, ref = run(tri.moe_mlp, args, activation="gelu"), run(reference.moe_mlp, args, activation="gelu")
    late = token_index[first:].unique()  # tokens with a row past `first`
    experts = (counts.cumsum(0) > first).nonzero().squeeze(1)  # experts with a row past `first`
    pairs = [("out", ours[0].detach()[late], ref[0].detach()[late]), ("x", ours[1][0][late], ref[1][0][late]),
             ("weights", ours[1][1][first:], ref[1][1][first:])]
    pairs += [(n, p[experts], q[experts]) for n, p, q in zip(["w1", "b1", "w2", "b2"], ours[1][2:], ref[1][2:])]
    assert late.numel() and experts.numel()
    for name, p, q in pairs:
        assert rel_err(p, q) < tol, (name, rel_err(p, q))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offsets_past_2_31_on_gpu():
    """N * f > 2**31 (N = 280K rows, f = 8K; about 40 GB of GPU memory with the reference): the [N, f]
    activations of rows n >= 2**31 / f lie past int32 offsets, which would wrap and corrupt them."""
    f = 8192
    check_rows_past(T=140_000, E=8, k=2, d=128, f=f, first=2**31 // f, dtype=torch.bfloat16,
                    tol=GPU_TOL[torch.bfloat16])
