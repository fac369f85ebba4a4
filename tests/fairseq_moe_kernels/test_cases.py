"""Every op of backend.OPS, through the shared case factory (fairseq_moe_kernels/cases.py, which the benchmarks use
too): the Triton op equals the reference, output and every gradient, in fp32 (Triton's interpreter on
CPU), on tiny odd shapes with an empty expert and k in {1, 2, 3}. A new kernel gets this test by its
entry in backend.OPS and its case; its own test file adds the edge cases that are its alone."""
import pytest
import torch

from fairseq_moe_kernels import backend, reference
from fairseq_moe_kernels.cases import CASES, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def outputs_and_grads(call, ops, I, diff, activation):
    out = call(ops, I, activation)
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)]
    g = torch.Generator(device=DEVICE).manual_seed(7)
    loss = sum((t * torch.randn(t.shape, generator=g, device=DEVICE)).sum() for t in outs
               if t.is_floating_point() and t.requires_grad)
    present = [n for n in diff if I[n] is not None]  # (swiglu experts have no biases)
    got = dict(zip(present, torch.autograd.grad(loss, [I[n] for n in present], allow_unused=True)))
    return outs, [got.get(n) for n in diff]


def fresh(I):
    return {n: (v.detach().clone().requires_grad_(v.requires_grad) if torch.is_tensor(v) else v) for n, v in I.items()}


def test_every_op_has_a_reference_and_a_case():
    assert set(CASES) == set(backend.OPS)
    for op in backend.OPS:
        assert callable(getattr(reference, op))


CALLS = [(op, k, "gelu") for op in sorted(backend.OPS) for k in (1, 2, 3)] + [
    (op, k, "swiglu") for op in ("grouped_mlp", "moe_mlp") for k in (1, 2)]  # (swiglu experts: no biases)


@pytest.mark.parametrize("op,k,activation", CALLS)
def test_triton_op_equals_the_reference(op, k, activation):
    pytest.importorskip("triton")
    triton_ops = backend.ops("triton")
    I = make_inputs(reference, E=5, T=11, d=7, k=k, dtype=torch.float32, device=DEVICE, seed=k,
                    empty_expert=True, f=9, activation=activation)
    call, diff = CASES[op]
    want_out, want_grads = outputs_and_grads(call, reference, fresh(I), diff, activation)
    got_out, got_grads = outputs_and_grads(call, triton_ops, fresh(I), diff, activation)
    assert len(got_out) == len(want_out)
    for got, want in zip(got_out, want_out):  # expert ids, counts and row order exactly; values to rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5) if want.is_floating_point() else \
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, got, want in zip(diff, got_grads, want_grads):
        if want is None:
            assert got is None or not got.abs().any(), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
