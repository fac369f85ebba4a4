"""fairseq_moe_kernels/reference.py against plain loops.

grouped_mlp (hand-written backward): output and the gradients of x, w1, b1, w2, b2 equal a per-row
autograd loop (each row through its own expert's weights), for every activation, fp32/fp64, odd
sizes, empty experts and one expert holding every row; gradcheck in fp64, with and without
activation dropout (the dropout mask is made reproducible by reseeding before each call); dropout
statistics; bad counts. permute/unpermute: values and gradients against index loops.
"""
import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_kernels import grouped_mlp, permute, unpermute

ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def swiglu_row(x, gate, up, down):
    """Shazeer (2020)'s FFN_SwiGLU(x) = (Swish_1(x W) * x V) W2 on one row, W: [d, f], V: [d, f], W2: [f, d]."""
    return (F.silu(x @ gate) * (x @ up)) @ down
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}
COUNTS = {  # E = 5 experts, N = 37 rows
    "spread": [7, 3, 11, 9, 7],
    "first_and_last_empty": [0, 20, 0, 17, 0],
    "one_expert_has_all": [0, 0, 37, 0, 0],
    "only_first": [37, 0, 0, 0, 0],
}


def make(counts, d=13, f=19, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(N, d), torch.tensor(counts), r(E, d, f) * 0.5, r(E, f) * 0.5, r(E, f, d) * 0.5, r(E, d)


def loop_mlp(x, counts, w1, b1, w2, b2, activation):
    """Row i through expert e(i) with ordinary autograd; e(i) read off the counts."""
    experts = [e for e, n in enumerate(counts.tolist()) for _ in range(n)]
    if activation == "swiglu":  # (w1 [E, d, 2f]: the gate's columns, then up's)
        f = w2.shape[1]
        return torch.stack([swiglu_row(x[i], w1[e][:, :f], w1[e][:, f:], w2[e]) for i, e in enumerate(experts)])
    if b1 is None:  # (experts without biases)
        return torch.stack([ACT[activation](x[i] @ w1[e]) @ w2[e] for i, e in enumerate(experts)])
    return torch.stack(
        [ACT[activation](x[i] @ w1[e] + b1[e]) @ w2[e] + b2[e] for i, e in enumerate(experts)]
    )


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("layout", sorted(COUNTS))
def test_grouped_mlp_matches_row_loop(layout, activation, dtype):
    x, counts, w1, b1, w2, b2 = make(COUNTS[layout], dtype=dtype)
    grad_out = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    a = leaves(x, w1, b1, w2, b2)
    b = leaves(x, w1, b1, w2, b2)
    ya = grouped_mlp(a[0], counts, *a[1:], activation=activation)
    yb = loop_mlp(b[0], counts, *b[1:], activation)
    assert ya.dtype == dtype and ya.shape == x.shape
    torch.testing.assert_close(ya, yb, **TOL[dtype])
    (ya * grad_out).sum().backward()
    (yb * grad_out).sum().backward()
    for name, p, q in zip(("x", "w1", "b1", "w2", "b2"), a, b):
        torch.testing.assert_close(p.grad, q.grad, **TOL[dtype], msg=f"grad of {name}")
    # The weights of experts that got no rows get exactly zero gradient.
    for e, n in enumerate(COUNTS[layout]):
        if n == 0:
            assert a[1].grad[e].abs().sum() == 0 and a[4].grad[e].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("layout", sorted(COUNTS))
def test_experts_without_biases_match_the_row_loop(layout, activation, dtype):
    """swiglu (w1 [E, d, 2f]) and an FFN without biases: output and the gradients of x, w1, w2."""
    x, counts, w1, _, w2, _ = make(COUNTS[layout], dtype=dtype)
    if activation == "swiglu":
        w1 = torch.cat([w1, w1.flip(0) * 0.7], 2)  # (gate, up)
    grad_out = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    a, b = leaves(x, w1, w2), leaves(x, w1, w2)
    ya = grouped_mlp(a[0], counts, a[1], None, a[2], None, activation=activation)
    yb = loop_mlp(b[0], counts, b[1], None, b[2], None, activation)
    torch.testing.assert_close(ya, yb, **TOL[dtype])
    (ya * grad_out).sum().backward()
    (yb * grad_out).sum().backward()
    for name, p, q in zip(("x", "w1", "w2"), a, b):
        torch.testing.assert_close(p.grad, q.grad, **TOL[dtype], msg=f"grad of {name}")


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_swiglu_gradcheck(p):
    x, counts, w1, _, w2, _ = make([2, 0, 3], d=3, f=4)
    w1 = torch.cat([w1, w1 * -0.5], 2)
    inputs = leaves(x, w1, w2)

    def f(x, w1, w2):
        torch.manual_seed(123)
        return grouped_mlp(x, counts, w1, None, w2, None, "swiglu", p)

    assert torch.autograd.gradcheck(f, inputs)


def test_expert_weights_of_another_kind_are_one_line():
    x, counts, w1, b1, w2, b2 = make([2, 3])
    with pytest.raises(ValueError, match=r"w2 is \(2, 19, 13\), expected \(2, 9, 13\).*swiglu"):
        grouped_mlp(x, counts, w1[..., :18], None, w2, None, "swiglu")
    with pytest.raises(ValueError, match="odd width 19"):
        grouped_mlp(x, counts, w1, None, w2, None, "swiglu")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        grouped_mlp(x, counts, w1, b1, w2, b2, "tanh")


def test_grouped_mlp_partial_requires_grad_and_noncontiguous_x():
    """Only some inputs need grad (x frozen), and x is a transposed view."""
    x, counts, w1, b1, w2, b2 = make(COUNTS["first_and_last_empty"])
    x = x.t().contiguous().t()  # same values, column-major strides
    assert not x.is_contiguous()
    a = leaves(w1, w2)
    b = leaves(w1, w2)
    ya = grouped_mlp(x, counts, a[0], b1, a[1], b2, "gelu")
    yb = loop_mlp(x, counts, b[0], b1, b[1], b2, "gelu")
    ya.pow(2).sum().backward()
    yb.pow(2).sum().backward()
    torch.testing.assert_close(ya, yb)
    torch.testing.assert_close(a[0].grad, b[0].grad)
    torch.testing.assert_close(a[1].grad, b[1].grad)


def seeded(counts, activation, p, seed=123):
    """grouped_mlp as a function of its float inputs, with a fixed dropout mask."""

    def f(x, w1, b1, w2, b2):
        torch.manual_seed(seed)
        return grouped_mlp(x, counts, w1, b1, w2, b2, activation, p)

    return f


@pytest.mark.parametrize("activation,p", [("relu", 0.0), ("silu", 0.0), ("gelu", 0.4), ("silu", 0.5)])
def test_grouped_mlp_gradcheck(activation, p):
    x, counts, w1, b1, w2, b2 = make([2, 0, 3], d=3, f=4)
    inputs = leaves(x, w1, b1, w2, b2)
    assert torch.autograd.gradcheck(seeded(counts, activation, p), inputs)


def test_grouped_mlp_dropout_mask_applied_in_backward():
    """Same seed: same output; the gradient is that of the very mask the forward used."""
    x, counts, w1, b1, w2, b2 = make([5, 4], d=6, f=8)
    f = seeded(counts, "relu", 0.5)
    torch.testing.assert_close(f(x, w1, b1, w2, b2), f(x, w1, b1, w2, b2), rtol=0, atol=0)
    dropless = grouped_mlp(x, counts, w1, b1, w2, b2, "relu", 0.0)
    assert not torch.allclose(f(x, w1, b1, w2, b2), dropless)


def test_grouped_mlp_dropout_statistics():
    """With w1 = 0, b1 = 1, w2 = I, b2 = 0 the output is the scaled mask itself."""
    N, f, p = 512, 64, 0.3
    counts = torch.tensor([200, 0, 312])
    w1, b1 = torch.zeros(3, f, f), torch.ones(3, f)
    w2, b2 = torch.eye(f).expand(3, f, f).contiguous(), torch.zeros(3, f)
    torch.manual_seed(0)
    y = grouped_mlp(torch.randn(N, f), counts, w1, b1, w2, b2, "relu", p)
    dropped = y == 0
    assert torch.allclose(y[~dropped], torch.full_like(y[~dropped], 1 / (1 - p)))
    # 32768 Bernoulli(p) draws: std of the fraction is ~0.0025.
    assert abs(dropped.double().mean().item() - p) < 0.015
    assert abs(y.mean().item() - 1.0) < 0.03  # E[y] equals the dropout-free output (1.0)
    assert not dropped.all(0).any() and not dropped.all(1).any()  # mask is not shared per row/col


def test_grouped_mlp_counts_must_sum_to_rows():
    x, _, w1, b1, w2, b2 = make([3, 4])
    with pytest.raises(ValueError):
        grouped_mlp(x, torch.tensor([3, 3]), w1, b1, w2, b2)
    with pytest.raises(ValueError):
        grouped_mlp(x, torch.tensor([4, 4]), w1, b1, w2, b2)


def test_permute_matches_index_loop_and_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64, generator=g)
    token_index = torch.tensor([3, 0, 3, 6, 1, 3, 0])  # repeats, and tokens 2, 4, 5 absent
    a, b = leaves(x, x)
    rows = permute(a, token_index)
    loop = torch.stack([b[int(t)] for t in token_index])
    assert torch.equal(rows, loop)
    w = torch.randn(rows.shape, dtype=torch.float64, generator=g)
    (rows * w).sum().backward()
    (loop * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert a.grad[[2, 4, 5]].abs().sum() == 0


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.float64])
def test_unpermute_matches_index_loop_and_gradient(rows_dtype):
    g = torch.Generator().manual_seed(0)
    T, d = 6, 4
    token_index = torch.tensor([2, 0, 2, 5, 0])  # tokens 1, 3, 4 get nothing -> zeros
    rows = torch.randn(5, d, dtype=rows_dtype, generator=g)
    weights = torch.rand(5, generator=g)  # fp32 like the routing weights
    ra, wa = leaves(rows, weights)
    rb, wb = leaves(rows, weights)
    out = unpermute(ra, token_index, wa, T)
    loop = [torch.zeros(d, dtype=rows_dtype) for _ in range(T)]
    for n, t in enumerate(token_index.tolist()):
        loop[t] = loop[t] + wb[n].to(rows_dtype) * rb[n]
    loop = torch.stack(loop)
    assert out.dtype == rows_dtype and out.shape == (T, d)
    torch.testing.assert_close(out, loop)
    assert out[[1, 3, 4]].abs().sum() == 0
    grad = torch.randn(T, d, dtype=rows_dtype, generator=g)
    (out * grad).sum().backward()
    (loop * grad).sum().backward()
    torch.testing.assert_close(ra.grad, rb.grad)
    torch.testing.assert_close(wa.grad, wb.grad)
    # By hand: d out / d weights[n] = rows[n] . grad[token[n]].
    hand = (rows * grad[token_index]).sum(1).float()
    torch.testing.assert_close(wa.grad, hand)
