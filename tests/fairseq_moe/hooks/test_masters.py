"""hooks/masters.py: FP16Optimizer with the experts' master gradients zeroed only where no backward writes them,
against fairseq's own FP16Optimizer (the patch's original build) over the same parameters and gradients: bit for bit
in bf16 and in fp16 with its loss scaler (an overflow's skipped update included), clipping or not, with a step that
had no backward since zero_grad and one where an expert tensor got no gradient; the flat copy (--fp16) the same.
Those with torch's ops (the kernel off); with the one-pass kernel (bf16 experts under Adam), fairseq's values up to
float rounding, the dense parameters still to the bit, and no expert master gradient kept."""
import pytest
import torch
from omegaconf import OmegaConf

from fairseq_moe import patches
from fairseq_moe.hooks import masters
from fairseq_moe_kernels import cpu_adam

from ...fairseq_moe_kernels.test_cpu_adam import built

BUILD = ("fairseq.optim.fp16_optimizer:FP16Optimizer", "build_optimizer")


def cfg(half, flat=False):
    return OmegaConf.create({
        "optimizer": {"_name": "adam", "lr": [0.01], "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-8,
                      "weight_decay": 0.01, "use_old_adam": False, "fp16_adam_stats": False, "tpu": False},
        "common": {"bf16": half == torch.bfloat16, "fp16": half == torch.float16, "fp16_no_flatten_grads": not flat,
                   "fp16_scale_window": 2, "fp16_init_scale": 2.0 ** 7, "fp16_scale_tolerance": 0.0,
                   "threshold_loss_scale": None, "min_loss_scale": 1e-4, "model_parallel_size": 1},
        "optimization": {"update_freq": [1]},
        "distributed_training": {"distributed_world_size": 1},
    })


def params(half, frozen=True):
    """A dense weight, two expert tensors (one frozen: fairseq's path; fairseq's Trainer passes none such, and its
    flat copy steps them where the non-flat one does not), an expert bias."""
    g = torch.Generator().manual_seed(0)
    shapes = {"dense": (6, 5), "w1": (3, 5, 7), **({"frozen": (3, 4)} if frozen else {}), "b1": (3, 7)}
    ps = {k: torch.nn.Parameter(torch.randn(s, generator=g).to(half)) for k, s in shapes.items()}
    for k in ("w1", "frozen", "b1"):
        if k in ps:
            ps[k].expert = True
    if frozen:
        ps["frozen"].requires_grad_(False)
    return list(ps.values())


def build(ours, half, flat=False, frozen=True):
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    fairseq_build = patches.original(*BUILD).__func__
    build_ = FP16Optimizer.build_optimizer if ours else (lambda c, ps: fairseq_build(FP16Optimizer, c, ps))
    ps = params(half, frozen)
    return build_(cfg(half, flat), ps), ps


def train(opt, ps, steps, clip, overflow_at=(), skip_backward_at=()):
    """steps updates as fairseq's Trainer drives them: zero_grad, backward (the loss scaled for fp16), the 1 /
    sample size multiply, clip_grad_norm, step (an fp16 overflow skips it, as the Trainer does). -> (the half
    parameters, the fp32 masters, the updates skipped)."""
    skipped = []
    for i in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 + i)
        if i not in skip_backward_at:
            targets = [torch.randn(p.shape, generator=g) * 10.0 ** (i % 3 - 1) for p in ps]
            if i in overflow_at:
                targets[1][0, 0, 0] = float("inf")
            if i == 3:  # (an expert tensor that gets no gradient in this backward: its master gradient is zeros)
                targets[-1] = None
            opt.backward(sum((p.float() * t).sum() for p, t in zip(ps, targets) if p.requires_grad and t is not None))
        opt.multiply_grads(1 / (17.0 + i))
        try:
            opt.clip_grad_norm(clip)
        except OverflowError:  # (fp16's scaler saw the overflow: fairseq's Trainer skips the update)
            skipped.append(i)
            continue
        opt.step()
    return [p.detach().clone() for p in ps], [p.detach().clone() for p in opt.fp32_params], skipped


@pytest.fixture
def torch_ops(monkeypatch):
    """The one-pass kernel off: fairseq's path with torch's ops for every master."""
    monkeypatch.setattr(cpu_adam, "available", lambda: False)


@pytest.mark.parametrize("half,clip", [(torch.bfloat16, 0.0), (torch.bfloat16, 0.05), (torch.float16, 0.0)])
def test_bit_for_bit_fairseqs(half, clip, torch_ops):
    overflow = (2,) if half == torch.float16 else ()
    ours, ps = build(True, half)
    assert type(ours).__mro__[1] is masters.ExpertMasters
    got = train(ours, ps, 6, clip, overflow, skip_backward_at=(4,))
    theirs, qs = build(False, half)
    assert not isinstance(theirs, masters.ExpertMasters)
    want = train(theirs, qs, 6, clip, overflow, skip_backward_at=(4,))
    assert got[2] == want[2] == list(overflow)  # (fp16: the inf in an expert's gradient skipped that update)
    for a, b in zip(got[:2], want[:2]):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_flat_copy_is_the_non_flat_one_bit_for_bit(torch_ops):
    flat, ps = build(True, torch.float16, flat=True, frozen=False)
    assert type(flat).__name__ == "FP16Optimizer" and hasattr(flat, "flat")
    got = train(flat, ps, 6, 0.0, overflow_at=(2,))
    theirs, qs = build(False, torch.float16, frozen=False)
    want = train(theirs, qs, 6, 0.0, overflow_at=(2,))
    assert got[2] == want[2] == [2]
    for x, y in zip(got[0], want[0]):
        assert torch.equal(x, y)


def test_a_step_without_any_backward_since_zero_grad_has_zero_expert_gradients(torch_ops):
    """zero_grad leaves the experts' masters as they were: a clip or a step before any backward must still see
    zeros there (fairseq's zero_grad zeroed them)."""
    ours, ps = build(True, torch.bfloat16)
    train(ours, ps, 1, 0.0)
    assert any(p32.grad.abs().sum() > 0 for p32 in ours.fp32_params[1:])
    ours.zero_grad()
    ours.clip_grad_norm(0.0)
    for p, p32 in zip(ps, ours.fp32_params):
        assert torch.equal(p32.grad, torch.zeros_like(p32)), p.shape


def test_without_experts_it_is_fairseqs_class():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    ps = [torch.nn.Parameter(torch.randn(4, 4).bfloat16())]
    assert type(FP16Optimizer.build_optimizer(cfg(torch.bfloat16), ps)) is FP16Optimizer


@built
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_the_one_pass_is_fairseqs_up_to_rounding(clip):
    """bf16 experts under Adam: the kernel steps them (no master gradient kept), fairseq's path the rest; against
    fairseq's own FP16Optimizer over the same gradients (a step without backward and an expert without a gradient
    included): the dense parameters and masters to the bit, the experts' masters within float rounding, each half
    expert its master rounded."""
    ours, ps = build(True, torch.bfloat16)
    got = train(ours, ps, 6, clip, skip_backward_at=(4,))
    theirs, qs = build(False, torch.bfloat16)
    want = train(theirs, qs, 6, clip, skip_backward_at=(4,))
    experts = [i for i, p in enumerate(ps) if getattr(p, "expert", False) and p.requires_grad]
    assert experts == [1, 3]
    for i, (x, y) in enumerate(zip(got[1], want[1])):
        if i in experts:
            assert (x - y).abs().max() <= 1e-6 * y.abs().max(), i
            assert torch.equal(got[0][i], x.bfloat16())
        else:
            assert torch.equal(x, y) and torch.equal(got[0][i], want[0][i]), i
    ours.zero_grad()
    opt = ours.fp32_optimizer.optimizer
    train(ours, ps, 1, clip)
    assert [ours.fp32_params[i].grad for i in experts] == [None, None]  # (stepped from the bf16 gradients)
    assert [opt.state[ours.fp32_params[i]]["step"] for i in experts] == [7, 7]


@built
def test_an_inf_in_a_bf16_expert_gradient_makes_the_norm_inf_before_any_step():
    ours, ps = build(True, torch.bfloat16)
    train(ours, ps, 1, 0.0)
    before = [p.detach().clone() for p in ours.fp32_params]
    ours.zero_grad()
    targets = [torch.ones(p.shape) for p in ps]
    targets[3][0, 0] = float("inf")
    ours.backward(sum((p.float() * t).sum() for p, t in zip(ps, targets) if p.requires_grad))
    assert getattr(ours.fp32_params[3], "half_grad", None) is None  # (handed over by the sync, in the clip)
    norm = ours.clip_grad_norm(0.0)
    assert ours.fp32_params[3].grad is None and ours.fp32_params[3].half_grad.data_ptr() == ps[3].grad.data_ptr()
    assert torch.isinf(norm)  # (fairseq's Trainer stops there: FloatingPointError, no step)
    for p, b in zip(ours.fp32_params, before):
        assert torch.equal(p, b)
