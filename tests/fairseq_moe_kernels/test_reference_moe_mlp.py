"""moe_mlp (gather -> grouped MLP -> weighted scatter in one op) equals its three-op composition
permute -> grouped_mlp -> unpermute, which test_reference.py checks against per-row loops:
output and the gradients of x, weights, w1, b1, w2, b2 (swiglu: without biases)."""
import pytest
import torch

from fairseq_moe_kernels import grouped_mlp, moe_mlp, permute, unpermute


def inputs(counts, T=11, d=7, f=9, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    x = torch.randn(T, d, generator=g, dtype=dtype)
    token_index = torch.randint(0, T - 1, (N,), generator=g)  # token T-1 gets no row
    weights = torch.rand(N, generator=g, dtype=dtype)
    w1, b1 = torch.randn(E, d, f, generator=g, dtype=dtype), torch.randn(E, f, generator=g, dtype=dtype)
    w2, b2 = torch.randn(E, f, d, generator=g, dtype=dtype), torch.randn(E, d, generator=g, dtype=dtype)
    return x, token_index, weights, torch.tensor(counts), w1, b1, w2, b2


def composed(x, token_index, weights, counts, w1, b1, w2, b2, activation, p):
    rows = grouped_mlp(permute(x, token_index), counts, w1, b1, w2, b2, activation, p)
    return unpermute(rows, token_index, weights, x.shape[0])


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [4, 1, 0, 0]])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_equals_composition(counts, activation, p):
    args = inputs(counts)
    if activation == "swiglu":  # (w1 [E, d, 2f], no biases)
        x, ti, w, c, w1, b1, w2, b2 = args
        args = (x, ti, w, c, torch.cat([w1, w1.flip(2)], 2), None, w2, None)
    grads = []
    outs = []
    for fn in (moe_mlp, composed):
        leaves = [a if a is None else a.clone().requires_grad_(a.is_floating_point()) for a in args]
        torch.manual_seed(5)  # the same dropout mask in both
        out = fn(*leaves, activation, p)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([a.grad for a in leaves if a is not None and a.is_floating_point()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    assert outs[0][-1].abs().sum() == 0  # the token with no row
    for ga, gb in zip(*grads):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    x, ti, w, counts, w1, b1, w2, b2 = inputs([2, 0, 3], T=5, d=3, f=4)
    leaves = [t.requires_grad_() for t in (x, w, w1, b1, w2, b2)]
    fn = lambda x, w, w1, b1, w2, b2: moe_mlp(x, ti, w, counts, w1, b1, w2, b2, "gelu")  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 513, 600])
def test_row_dots_are_the_whole_products_sums(n):
    """The routing weights' gradient's row dot products, taken 256 rows at a time: the same bits as (x * y).sum(1)."""
    from fairseq_moe_kernels.reference import _row_dots

    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 300, generator=g), torch.randn(n, 300, generator=g)
    assert torch.equal(_row_dots(x, y), (x * y).sum(1))
