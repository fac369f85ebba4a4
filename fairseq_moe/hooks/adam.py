"""fairseq's Adam step on the CPU as one pass over memory, in MoE runs: torch's fused AdamW kernel, with fairseq's
arithmetic.

fairseq's Adam (fairseq.optim.adam.Adam: what --optimizer adam runs without apex's FusedAdam) updates each
parameter with seven whole-tensor operations (two on the first moment, two on the second, sqrt and its eps into a
new tensor, the update; one more for weight decay). For a stacked expert tensor of 32 experts at d = 512, f = 2048
(134 MB) each of them streams the tensor through memory again, and the sqrt allocates its size anew: 0.14 s per
update for the 67 M expert parameters of bench_fairseq_train.py's MoE layer on one core (torch 2.13), 7% of an
fp32 update and 16% of a bf16 one (2026-12-04). torch's fused kernel (`torch._fused_adamw_`, what
torch.optim.AdamW(fused=True) runs) reads and writes each element once: 0.014 s for the same tensors.

fairseq's step is AdamW's with the bias correction of the second moment outside the eps:
    p <- p - lr * wd * p;  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
torch's kernel divides by sqrt(v) / sqrt(1 - b2^t) + eps', which is fairseq's denominator when eps' = eps /
sqrt(1 - b2^t): each call passes that (amsgrad: the running maximum of v in its place, as in both). The values are
fairseq's up to float rounding, not to the bit (the kernel fuses multiplications, and rounds a tensor's last few
elements, past its vector width, apart): the tests compare both with fairseq's own code run in float64.

Which optimizers: those holding an expert's parameter (`.expert`, which fairseq's fp32 master copies keep), so a
dense run with the plugin loaded steps exactly as without it. Which parameters: plain fp32 tensors on the CPU, with
a dense fp32 gradient and state; any other (a bf16 one of --memory-efficient-bf16, whose fp32 state is fairseq's;
a sharded DTensor of --ddp-backend fully_sharded; a sparse gradient; CUDA, where no run of this kernel has been
checked here) goes through fairseq's own step, unchanged, in the same call; so does everything on a torch whose
kernel has no CPU implementation (before 2.4). The state keeps fairseq's names and types (an int "step"), so a
checkpoint moves between either step.
"""
import functools
import math

import torch

from fairseq_moe_layer.experts import is_expert

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@functools.lru_cache(maxsize=None)
def kernel_runs():
    """Whether torch's fused AdamW kernel runs on CPU tensors here (torch >= 2.4; before, the op exists for CUDA
    only): tried once on one element."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    cpu = dict(device="cpu", dtype=torch.float32)
    param = torch.zeros(1, **cpu)
    try:
        torch._fused_adamw_([param], [torch.ones(1, **cpu)], [torch.zeros(1, **cpu)], [torch.zeros(1, **cpu)], [],
                            [torch.ones((), **cpu)],
                            lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    except (RuntimeError, NotImplementedError):
        return False
    return param.item() < 0  # (a step against a gradient of 1)


def fusable(p, state):
    """Whether p (with its Adam state so far) takes the fused step: a plain fp32 tensor on the CPU, a dense fp32
    gradient, state (if any yet) of its shape, dtype and device, all contiguous; and a kernel that runs here."""
    grad = p.grad
    tensors = [p, grad] + [state[k] for k in _MOMENTS if k in state]
    return not grad.is_sparse and all(
        type(t.data) is torch.Tensor and t.device.type == "cpu" and t.dtype == torch.float32 and t.shape == p.shape
        and t.is_contiguous() for t in tensors) and kernel_runs()  # (type: a DTensor is a subclass)


def _fused(params, state, group):
    """One group's parameters that fusable() serves, stepped by torch's kernel with fairseq's arithmetic."""
    amsgrad = group.get("amsgrad", False)
    beta1, beta2 = group["betas"]
    by_step = {}  # t -> parameters at that step (one call per t: the kernel's eps' depends on it)
    for p in params:
        s = state[p]
        if len(s) == 0:
            s["step"] = 0
            for key in _MOMENTS[:3 if amsgrad else 2]:
                s[key] = torch.zeros_like(p.data)
        by_step.setdefault(s["step"] + 1, []).append(p)
    for t, ps in by_step.items():
        torch._fused_adamw_(
            [p.data for p in ps], [p.grad.data for p in ps], [state[p]["exp_avg"] for p in ps],
            [state[p]["exp_avg_sq"] for p in ps], [state[p]["max_exp_avg_sq"] for p in ps] if amsgrad else [],
            [torch.tensor(float(t)) for _ in ps], lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"] / math.sqrt(1 - beta2 ** t), amsgrad=amsgrad,
            maximize=False)
        for p in ps:  # (counted once stepped: the kernel reads the step, it does not count it)
            state[p]["step"] = t


def adam_step(original):
    """fairseq.optim.adam.Adam.step with the fused kernel for the parameters fusable() serves, where the optimizer
    holds an expert's parameter; the others are stepped by fairseq's own code (original), in the same call."""
    if getattr(original, "hooked", False):  # (torch's hook wrapper, there if an Adam was built before the patch)
        original = original.__wrapped__

    def step(self, closure=None):
        if not any(is_expert(p) for group in self.param_groups for p in group["params"]):
            return original(self, closure)
        loss = closure() if closure is not None else None
        others = []
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            fused = [p for p in with_grad if fusable(p, self.state[p])]
            _fused(fused, self.state, group)
            done = {id(p) for p in fused}
            others.append([p for p in with_grad if id(p) not in done])
        if any(others):  # fairseq's step over those alone: each group's params narrowed for the call
            kept = [group["params"] for group in self.param_groups]
            try:
                for group, rest in zip(self.param_groups, others):
                    group["params"] = rest
                original(self)
            finally:
                for group, params in zip(self.param_groups, kept):
                    group["params"] = params
        return loss

    return step


def one_pass_serves(optimizer, p, p32):
    """Whether the master p32 of the half parameter p takes one_pass_step: optimizer is fairseq's Adam (no amsgrad
    in p32's group), p and its gradient are contiguous bf16 CPU tensors of p32's shape, p32 and its state (if any
    yet) plain contiguous fp32 ones, and the kernel runs here (fairseq_moe_kernels.cpu_adam)."""
    from fairseq.optim.adam import Adam

    from fairseq_moe_kernels import cpu_adam

    if type(optimizer) is not Adam or p.grad is None or p.grad.is_sparse:
        return False
    state = optimizer.state.get(p32, {})
    group = next((g for g in optimizer.param_groups if any(q is p32 for q in g["params"])), None)
    if group is None or group.get("amsgrad", False):
        return False
    half = [p.data, p.grad.data]
    full = [p32.data] + [state[k] for k in _MOMENTS[:2] if k in state]
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and t.shape == p32.shape
               for t in half + full) and all(t.dtype == torch.bfloat16 for t in half) and all(
        t.dtype == torch.float32 for t in full) and (not state or "exp_avg_sq" in state) and cpu_adam.available()


def one_pass_step(optimizer, pairs, factor):
    """fairseq's Adam step (fairseq.optim.adam.Adam.step's arithmetic and state) of each master p32 in pairs [(p,
    p32)] from the bf16 gradient the sync handed it (p32.half_grad, the one the finite check read) times factor
    (FP16Optimizer's multiply factor), p set to p32 rounded: one pass of cpu_adam.adam_bf16_ over each, where
    fairseq's FP16Optimizer makes five (the gradient copied into an fp32 master gradient, unscaled, Adam, the master
    copied back; the finite check stays the caller's)."""
    from fairseq_moe_kernels import cpu_adam

    group_of = {id(q): g for g in optimizer.param_groups for q in g["params"]}
    factor = float(factor)  # (a tensor after clipping: one value, on the CPU)
    for p, p32 in pairs:
        group, state = group_of[id(p32)], optimizer.state[p32]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p32.data)
            state["exp_avg_sq"] = torch.zeros_like(p32.data)
        beta1, beta2 = group["betas"]
        cpu_adam.adam_bf16_(p32.data, p.data, p32.half_grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            step=state["step"] + 1, grad_scale=factor)
        state["step"] += 1
