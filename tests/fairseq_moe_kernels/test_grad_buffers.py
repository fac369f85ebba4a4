"""fairseq_moe_kernels/grad_buffers.py: the torch backend's expert weight gradients land in last step's buffer once
nothing holds it, and never in one that a .grad, a kept reference or an accumulation still holds; the gradients
equal a plain per-expert loop's (autograd through F.linear) in every case."""
import gc

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_kernels import grad_buffers, reference

E, D, FF = 3, 4, 5
COUNTS = torch.tensor([2, 0, 3])  # expert 1 gets no rows: its slice of the kept buffer must be zeroed again


@pytest.fixture(autouse=True)
def pooled(monkeypatch):
    monkeypatch.setattr(grad_buffers, "MIN_BYTES", 0)  # the test's tiny weights are kept too
    grad_buffers.release()
    yield
    grad_buffers.release()


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((E, D, FF), (E, FF), (E, FF, D), (E, D))
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def rows(seed):
    return torch.randn(int(COUNTS.sum()), D, generator=torch.Generator().manual_seed(seed))


def loop_grads(ws, x):
    """d sum(y * upstream) / d (w1, b1, w2, b2), one expert at a time, through autograd."""
    w1, b1, w2, b2 = (w.detach().clone().requires_grad_() for w in ws)
    out, start = [], 0
    for e, n in enumerate(COUNTS.tolist()):
        h = F.relu(F.linear(x[start:start + n], w1[e].t(), b1[e]))
        out.append(F.linear(h, w2[e].t(), b2[e]))
        start += n
    (torch.cat(out) * upstream(x)).sum().backward()
    return [w1.grad, b1.grad, w2.grad, b2.grad]


def upstream(x):
    return torch.linspace(-1, 1, x.numel()).view_as(x)


def backward(ws, x):
    (reference.grouped_mlp(x, COUNTS, *ws) * upstream(x)).sum().backward()


def test_a_dropped_grad_buffer_is_taken_again_with_the_right_values():
    ws = weights()
    backward(ws, rows(1))
    first = [w.grad.data_ptr() for w in ws]
    for w, want in zip(ws, loop_grads(ws, rows(1))):
        torch.testing.assert_close(w.grad, want)
    for w in ws:
        w.grad = None  # fairseq's zero_grad, torch's set_to_none
    backward(ws, rows(2))
    assert [w.grad.data_ptr() for w in ws] == first
    kept = {t.data_ptr() for per_weight in grad_buffers._kept.values() for (key, _, _), slots in per_weight.items()
            if key[0] != "rows" for t, _ in slots}  # (the gradients' slots; the layer's [N, f] rows have their own)
    assert {w.grad.data_ptr() for w in ws} == kept  # (not malloc handing back the freed block)
    for w, want in zip(ws, loop_grads(ws, rows(2))):
        torch.testing.assert_close(w.grad, want)
    assert ws[0].grad[1].abs().sum() == 0  # the expert without rows


def test_a_buffer_still_held_is_never_overwritten():
    ws = weights()
    backward(ws, rows(1))
    held = [w.grad for w in ws]  # an optimizer's or a user's reference
    copies = [h.clone() for h in held]
    for w in ws:
        w.grad = None
    backward(ws, rows(2))
    for h, c, w in zip(held, copies, ws):
        torch.testing.assert_close(h, c)
        assert w.grad.data_ptr() != h.data_ptr()
    for w, want in zip(ws, loop_grads(ws, rows(2))):
        torch.testing.assert_close(w.grad, want)
    views = [w.grad[0] for w in ws]  # a view of .grad holds its storage too
    view_copies = [v.clone() for v in views]
    for w in ws:
        w.grad = None
    backward(ws, rows(3))
    for v, c in zip(views, view_copies):
        torch.testing.assert_close(v, c)


def test_accumulated_gradients_sum_every_backward():
    ws = weights()
    want = [torch.zeros_like(w) for w in ws]
    for seed in (1, 2, 3, 4):  # .grad kept: each backward's gradient needs a buffer of its own
        backward(ws, rows(seed))
        want = [a + b for a, b in zip(want, loop_grads(ws, rows(seed)))]
    for w, g in zip(ws, want):
        torch.testing.assert_close(w.grad, g)
    assert all(len(slots) <= grad_buffers.SLOTS for per_weight in grad_buffers._kept.values()
               for slots in per_weight.values())


def test_only_leaf_cpu_weights_over_the_threshold_are_kept(monkeypatch):
    ws = weights()
    cast = [w * 1 for w in ws]  # autocast's casts: temporaries, a new object every step
    (reference.grouped_mlp(rows(1), COUNTS, *cast) * upstream(rows(1))).sum().backward()
    assert len(grad_buffers._kept) == 0
    for w, want in zip(ws, loop_grads(ws, rows(1))):
        torch.testing.assert_close(w.grad, want)
    monkeypatch.setattr(grad_buffers, "MIN_BYTES", 10**9)
    fresh = weights()
    backward(fresh, rows(1))
    assert len(grad_buffers._kept) == 0


def test_the_buffers_die_with_their_weight():
    ws = weights()
    backward(ws, rows(1))
    assert len(grad_buffers._kept) == 2  # w1 and w2 (each with its bias's buffer)
    del ws
    gc.collect()
    assert len(grad_buffers._kept) == 0


def plain_forward(ws, x, counts):
    w1, b1, w2, b2 = ws
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(F.linear(F.relu(F.linear(x[start:start + n], w1[e].t(), b1[e])), w2[e].t(), b2[e]))
        start += n
    return torch.cat(out)


def row_buffers():
    """The addresses of the kept [N, f] rows: each weight's (fc1's output) and the shared ones (fc2's input
    gradient)."""
    pools = [*grad_buffers._kept.values(), grad_buffers._shared]
    return {t.data_ptr() for pool in pools for (key, _, _), slots in pool.items() if key[0] == "rows" for t, _ in slots}


def test_the_layers_rows_are_never_shared_by_two_pending_steps():
    """fc1's output is kept for backward: two forwards before either backward (two micro-batches' graphs) each get
    their own, and both backwards give the loop's gradients; after them the rows' buffers are taken again."""
    ws = weights()
    x1, x2 = rows(1), rows(2)
    y1, y2 = (reference.grouped_mlp(x, COUNTS, *ws) for x in (x1, x2))
    ((y1 + y2) * upstream(x1)).sum().backward()
    for w, a, b in zip(ws, loop_grads(ws, x1), loop_grads(ws, x2)):
        torch.testing.assert_close(w.grad, a + b)
    kept = row_buffers()
    assert len(kept) == 3  # fc1's output twice (two graphs at once), fc2's input gradient once (one at a time)
    for w in ws:
        w.grad = None
    backward(ws, rows(3))
    assert row_buffers() == kept


def test_rows_that_change_in_number_keep_at_most_the_slots():
    """A capacity makes N change every step: the rows' buffers stay at most SLOTS per weight, each grown to the
    largest N, and every step's output is the plain loop's."""
    ws = weights()
    for counts in ([1, 0, 1], [4, 2, 3], [2, 2, 0], [5, 5, 5], [1, 1, 1]):
        counts = torch.tensor(counts)
        x = torch.randn(int(counts.sum()), D, generator=torch.Generator().manual_seed(int(counts.sum())))
        y = reference.grouped_mlp(x, counts, *ws)
        torch.testing.assert_close(y, plain_forward(ws, x, counts))
        y.sum().backward()
    for pool in [*grad_buffers._kept.values(), grad_buffers._shared]:
        for (key, _, _), slots in pool.items():
            assert len(slots) <= grad_buffers.SLOTS
            if key[0] == "rows":
                assert max(t.numel() for t, _ in slots) == 15 * key[1]


def test_nothing_is_kept_under_inference_mode():
    """A buffer made under torch.inference_mode would be an inference tensor, which no later training step could
    write: none is kept there, and a training step after one runs and keeps its own."""
    ws = weights()
    with torch.inference_mode():
        y = reference.grouped_mlp(rows(1), COUNTS, *ws)
    assert len(grad_buffers._kept) == 0 and len(grad_buffers._shared) == 0
    torch.testing.assert_close(y, plain_forward(ws, rows(1), COUNTS))
    backward(ws, rows(2))
    for w, want in zip(ws, loop_grads(ws, rows(2))):
        torch.testing.assert_close(w.grad, want)
    assert len(grad_buffers._kept) == 2


@pytest.mark.parametrize("activation,p", [("relu", 0.0), ("gelu", 0.0), ("relu", 0.3)])
def test_moe_mlp_with_kept_rows_is_the_run_without_them(activation, p, monkeypatch):
    """The layer's fused op (gather, experts, weighted scatter) over steps whose number of rows changes, with every
    buffer kept against every buffer new: the same output and the same gradients of x, the routing weights and the
    expert weights, to the bit."""
    def steps():
        ws = weights()
        got = []
        for seed, counts in enumerate(([2, 0, 3], [4, 1, 2], [1, 1, 0], [3, 3, 3])):
            g = torch.Generator().manual_seed(seed)
            counts = torch.tensor(counts)
            x = torch.randn(6, D, generator=g, requires_grad=True)
            token_index = torch.randint(0, 6, (int(counts.sum()),), generator=g)
            weights_ = torch.rand(int(counts.sum()), generator=g, requires_grad=True)
            torch.manual_seed(seed)  # (the same dropout mask in both runs)
            out = reference.moe_mlp(x, token_index, weights_, counts, *ws, activation, p)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            got.append([out.detach(), x.grad, weights_.grad, *(w.grad.clone() for w in ws)])
            for w in ws:
                w.grad = None
        return got, len(grad_buffers._kept), len(grad_buffers._shared)

    kept, weights_kept, shared = steps()
    assert (weights_kept, shared) == (2, 1)  # (w1 and w2 each with its own slots; fc2's input gradient shared)
    monkeypatch.setattr(grad_buffers, "MIN_BYTES", 10**12)
    grad_buffers.release()
    fresh, weights_kept, shared = steps()
    assert (weights_kept, shared) == (0, 0)
    for a, b in zip(kept, fresh):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def cast_steps(cast, pending=1, steps=3, accumulate=False):
    """`steps` steps of grouped_mlp over weights cast to bf16 by cast(w, dtype), `pending` forwards before each
    backward; the weights change in place between steps (an optimizer's step) -> (per step [outputs, .grads], the
    dtypes of the buffers kept for the weights)."""
    ws = weights()
    got = []
    for step in range(steps):
        xs = [rows(10 * step + i).bfloat16() for i in range(pending)]
        outs = [reference.grouped_mlp(x, COUNTS, *(cast(w, torch.bfloat16) for w in ws)) for x in xs]
        (sum(outs).float() * upstream(xs[0])).sum().backward()
        got.append([*(y.detach() for y in outs), *(w.grad.clone() for w in ws)])
        with torch.no_grad():
            for w in ws:
                w.mul_(0.5).add_(w.grad)
                if not accumulate:
                    w.grad = None
    return got, {dtype for per_weight in grad_buffers._kept.values() for (_, dtype, _) in per_weight}


@pytest.mark.parametrize("pending,accumulate", [(1, False), (2, False), (1, True)])
def test_a_kept_cast_is_the_plain_cast_in_value_and_gradient(pending, accumulate):
    """cast() (autocast's casts of the experts' weights, into kept buffers) against Tensor.to: the same outputs and
    fp32 gradients to the bit over steps that change the weights, with two graphs pending at once, and with
    gradients accumulated over steps."""
    kept, dtypes = cast_steps(grad_buffers.cast, pending, accumulate=accumulate)
    assert dtypes == {torch.bfloat16, torch.float32}  # (the casts and rows; the fp32 gradients of w1 and w2)
    plain, dtypes = cast_steps(lambda w, dtype: w.to(dtype), pending, accumulate=accumulate)
    assert dtypes == set()
    for a, b in zip(kept, plain):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_a_kept_cast_is_taken_again_only_when_free():
    ws = weights()
    w1 = ws[0]
    first = grad_buffers.cast(w1, torch.bfloat16)
    held = grad_buffers.cast(w1, torch.bfloat16)  # (first still held: a second buffer)
    assert first.data_ptr() != held.data_ptr() and torch.equal(first, w1.to(torch.bfloat16))
    ptr = first.data_ptr()
    del first
    with torch.no_grad():
        w1.add_(1)
    again = grad_buffers.cast(w1, torch.bfloat16)
    assert again.data_ptr() == ptr and torch.equal(again, w1.to(torch.bfloat16))
    # the cast's gradient (fp32, the weight's dtype) comes from the weight's own kept slots
    again.float().sum().backward()
    assert torch.equal(w1.grad, torch.ones_like(w1))


def test_what_is_not_kept_is_cast_plainly(monkeypatch):
    w = weights()[0]
    assert grad_buffers.cast(w, torch.float32) is w
    assert type(grad_buffers.cast(w * 1, torch.bfloat16).grad_fn).__name__ == "ToCopyBackward0"  # (not a leaf)
    with torch.inference_mode():
        assert grad_buffers.cast(w, torch.bfloat16).grad_fn is None and len(grad_buffers._kept) == 0
    monkeypatch.setattr(grad_buffers, "MIN_BYTES", 10**9)
    assert type(grad_buffers.cast(w, torch.bfloat16).grad_fn).__name__ == "ToCopyBackward0"
    assert len(grad_buffers._kept) == 0
