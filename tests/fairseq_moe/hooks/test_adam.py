"""fairseq's Adam step through torch's fused kernel (hooks/adam.py) against fairseq's own code (the patch's
original) run in float64: after several steps, with weight decay, amsgrad, gradients that change scale, the fused
fp32 parameters and moments are as near the float64 run as fairseq's own fp32 step is; a group that mixes
parameters the kernel serves with ones it does not (bf16, a strided view, a tensor subclass as DTensors are, no
gradient) ends as fairseq's step leaves each of them; an optimizer without experts is fairseq's step itself."""
import pytest
import torch

from fairseq_moe import patches
from fairseq_moe.hooks import adam

SHAPES = [(3, 1001), (7,), (2, 5, 64)]


def fairseq_step():
    return patches.original("fairseq.optim.adam:Adam", "step")


def _params(seed, shapes, dtype=torch.float32, expert=True):
    """Parameters of these shapes, the first marked as an expert's (the fused step serves optimizers with experts)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)) for shape in shapes]
    if expert:
        params[0].expert = True
    return params


def _train(step, params, settings, steps=6):
    """steps steps of fairseq's Adam class with this step function; gradients the same whatever the dtype."""
    from fairseq.optim.adam import Adam

    opt = Adam(params, **settings)
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * 10.0 ** (i % 3 - 1)).to(p.dtype)
        step(opt)
    return opt


@pytest.mark.parametrize("settings", [dict(lr=0.01), dict(lr=0.01, weight_decay=0.1),
                                      dict(lr=0.003, amsgrad=True, betas=(0.8, 0.99), eps=1e-6)])
def test_fused_step_is_fairseqs_up_to_rounding(settings):
    exact = _train(fairseq_step(), _params(0, SHAPES, torch.float64), settings)
    plain = _train(fairseq_step(), _params(0, SHAPES), settings)
    fused = _train(adam.adam_step(fairseq_step()), _params(0, SHAPES), settings)
    for ref, theirs, ours in zip(*(o.param_groups[0]["params"] for o in (exact, plain, fused))):
        assert adam.fusable(ours, fused.state[ours])
        for key in ["param", *sorted(exact.state[ref])]:
            want, *got = (p.data if key == "param" else o.state[p][key]
                          for o, p in ((exact, ref), (plain, theirs), (fused, ours)))
            if key == "step":
                assert got == [want, want] == [6, 6]
                continue
            assert got[1].dtype == torch.float32
            fairseq_error = (got[0].double() - want).abs().max().item()
            fused_error = (got[1].double() - want).abs().max().item()
            assert fused_error <= 4 * fairseq_error + 1e-7 * want.abs().max().item(), (key, fused_error, fairseq_error)
            assert not torch.equal(got[1], torch.zeros_like(got[1]))


class _Sub(torch.Tensor):
    """A tensor subclass, as torch's DTensor (--ddp-backend fully_sharded's dense parameters) is."""


def test_parameters_the_kernel_does_not_serve_take_fairseqs_step():
    """A bf16 parameter, a strided one, a subclass and one without a gradient, beside fused ones in the same group:
    the bf16, strided and subclass ones are bit for bit fairseq's, the fused ones near fairseq's, the one without a
    gradient is not stepped, and the group's parameter list is whole again after the call."""
    def make():
        params = _params(1, [(10, 30), (40,), (5, 6), (9,), (4, 4), (3, 7)])
        params[1].data = params[1].data.bfloat16()
        params[2].data = params[2].data.t().contiguous().t()
        params[5] = torch.nn.Parameter(params[5].detach().as_subclass(_Sub))
        return params

    ours, theirs = make(), make()
    fused = _train(adam.adam_step(fairseq_step()), ours, dict(lr=0.01))
    _train(fairseq_step(), theirs, dict(lr=0.01))
    assert [adam.fusable(p, fused.state[p]) for p in ours] == [True, False, False, True, True, False]
    for i in (1, 2, 5):
        assert torch.equal(ours[i], theirs[i])
    for i in (0, 3, 4):
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-6, atol=1e-7)
        assert not torch.equal(ours[i], make()[i])
    assert fused.param_groups[0]["params"] == ours
    ours[4].grad = None
    before = ours[4].detach().clone()
    fused.step()
    assert torch.equal(ours[4], before) and fused.state[ours[4]]["step"] == 6


def test_the_groups_are_whole_again_when_fairseqs_step_raises():
    params = _params(2, [(8,), (3,)])
    opt = _train(adam.adam_step(fairseq_step()), params, dict(lr=0.01), steps=1)
    params[1].grad = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    with pytest.raises(RuntimeError, match="sparse"):
        adam.adam_step(fairseq_step())(opt)
    assert opt.param_groups[0]["params"] == params


def test_an_optimizer_without_experts_is_fairseqs_step_to_the_bit():
    """A dense run with the plugin loaded steps as without it (test_patches.py trains one end to end)."""
    ours, theirs = _params(3, SHAPES, expert=False), _params(3, SHAPES, expert=False)
    _train(adam.adam_step(fairseq_step()), ours, dict(lr=0.01, weight_decay=0.1))
    _train(fairseq_step(), theirs, dict(lr=0.01, weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_fairseq_trains_with_the_fused_step():
    """The patch is installed: fairseq.optim.adam.Adam.step is ours once the plugin is loaded."""
    import fairseq_moe  # noqa: F401
    from fairseq.optim.adam import Adam

    assert Adam.step is not fairseq_step() and Adam.step.__qualname__.startswith("adam_step")


def test_where_torchs_cpu_kernel_does_not_run_every_step_is_fairseqs(monkeypatch):
    """torch < 2.4 has the fused op for CUDA only (kernel_runs() probes it): fairseq's step, to the bit."""
    monkeypatch.setattr(adam, "kernel_runs", lambda: False)
    ours, theirs = _params(4, SHAPES), _params(4, SHAPES)
    opt = _train(adam.adam_step(fairseq_step()), ours, dict(lr=0.01))
    _train(fairseq_step(), theirs, dict(lr=0.01))
    assert not any(adam.fusable(p, opt.state[p]) for p in ours)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
