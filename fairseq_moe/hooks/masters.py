"""The experts' fp32 master gradients in fairseq's FP16Optimizer (--fp16, --bf16): not zeroed only to be overwritten.

FP16Optimizer keeps an fp32 master copy of every half-precision parameter. Its zero_grad zeroes every master
gradient, and the sync after the backward then writes each one whole (a copy of the half gradient, or zeros where
there is none): with experts these are the model's largest tensors (E times an FFN's), and the zeroing took 6 of
the 110 ms by which a bf16 update of 4,096 tokens exceeded the dense model's at E = 32, d = 512, f = 2048 on one
CPU core (torch's profiler, benchmarks/README.md).

ExpertMasters (mixed into the non-flat ExpertFP16Optimizer here and the flat ExpertFlatFP16Optimizer, optim.py):
zero_grad leaves the experts' master gradients as they are, and the sync writes them (fairseq's copy); a sync with
no backward since zero_grad (a clip or a step without gradients) zeroes them then, as fairseq's zero_grad would
have. Everything else is fairseq's, bit for bit. (Multiplying by the factor as the sync copies, to save the
unscale's pass, measured slower: torch.mul of a bf16 tensor by an fp32 one into an fp32 output ran at a fifth of a
copy's speed on this CPU, 36 against 4.4 + 3.7 ms for copy then multiply, 2026-12-04.)

bf16 experts under fairseq's Adam on the CPU go further: one pass (adam.one_pass_step, the compiled kernel of
fairseq_moe_kernels.cpu_adam) reads each expert's bf16 gradient, multiplies it by the factor, steps Adam on the fp32
master and writes the bf16 weight, where fairseq makes five passes (copy, unscale, the step, the copy back, and no
master gradient is kept at all). The sync leaves such a master without a gradient and hands it the half one as
`.half_grad` (hooks/optim.clip_grad_norm checks that one is finite, as it checks the masters'); step() steps those
first, then fairseq's step does the rest (its Adam skips a master without a gradient) and copies every other master
back. Where the kernel is not built here, or for any other optimizer, dtype or layout (adam.one_pass_serves):
fairseq's path above. The values are fairseq's up to float rounding, not to the bit (the tests compare both).
"""
import functools

import torch

from fairseq_moe_layer.experts import is_expert

from . import adam


class ExpertMasters:
    """FP16Optimizer's zero_grad and sync with the experts' masters zeroed only where no backward writes them. A class
    mixing it in gives _expert_pairs() [(half parameter, fp32 master)], _zero_dense_grads() and _sync_dense_grads()
    (fairseq's, for the other masters), and skips the half parameters in _written when it copies the masters back."""

    _unzeroed = False  # the experts' master gradients are last update's: zero_grad left them
    _written = frozenset()  # ids of the half parameters that one_pass_step wrote in this step

    def zero_grad(self):
        for p in self.fp16_params:
            p.grad = None
        for _, p32 in self._expert_pairs():
            p32.half_grad = None
        self._zero_dense_grads()
        self._unzeroed, self._needs_sync = True, False
        if self.scaler is not None:
            self._multiply_factor = 1.0 / float(self.scaler.loss_scale)

    def _sync_fp16_grads_to_fp32(self):
        if not self._needs_sync:
            if self._unzeroed:  # (no backward since zero_grad: what fairseq's zero_grad left)
                for _, p32 in self._expert_pairs():
                    if p32.grad is None:  # (the one pass left none)
                        p32.grad = torch.zeros_like(p32.data)
                    else:
                        p32.grad.data.zero_()
                self._unzeroed = False
            return
        self._sync_dense_grads()
        optimizer = self.fp32_optimizer.optimizer
        for p, p32 in self._expert_pairs():
            p32.half_grad = None
            if adam.one_pass_serves(optimizer, p, p32):  # (stepped from the half gradient by step(): none kept)
                p32.grad, p32.half_grad = None, p.grad.data
            elif p32.grad is None:
                p32.grad = torch.zeros_like(p32.data) if p.grad is None else p.grad.data.float()
            elif p.grad is None:
                p32.grad.data.zero_()
            else:
                p32.grad.data.copy_(p.grad.data)
        self._unzeroed = self._needs_sync = False

    def step(self, closure=None, groups=None):
        """The masters that the sync handed a half gradient stepped in one pass, then fairseq's step of the rest."""
        self._sync_fp16_grads_to_fp32()
        pairs = [(p, p32) for p, p32 in self._expert_pairs() if getattr(p32, "half_grad", None) is not None]
        try:
            if pairs:
                adam.one_pass_step(self.fp32_optimizer.optimizer, pairs, self._multiply_factor)
            self._written = frozenset(id(p) for p, _ in pairs)
            super().step(closure, groups)
        finally:
            self._written = frozenset()
            for _, p32 in pairs:
                p32.half_grad = None


@functools.lru_cache(maxsize=None)
def expert_fp16_class():
    """fairseq's FP16Optimizer without the flat copy (--bf16, --fp16-no-flatten-grads) with ExpertMasters."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    class ExpertFP16Optimizer(ExpertMasters, FP16Optimizer):
        """FP16Optimizer (non-flat) in an optimizer with experts: the experts' masters as masters.py says."""

        def _pairs(self):
            return [(p, p32) for p, p32 in zip(self.fp16_params, self.fp32_params) if p.requires_grad]

        def _expert_pairs(self):
            return [(p, p32) for p, p32 in self._pairs() if is_expert(p32)]

        def _zero_dense_grads(self):
            for p, p32 in zip(self.fp16_params, self.fp32_params):
                if p32.grad is not None and not (p.requires_grad and is_expert(p32)):
                    p32.grad.zero_()

        def _sync_fp32_params_to_fp16(self):  # (fairseq's, but for those one_pass_step wrote)
            for p, p32 in zip(self.fp16_params, self.fp32_params):
                if p.requires_grad and id(p) not in self._written:
                    p.data.copy_(p32.data)

        def _sync_dense_grads(self):  # (fairseq's, for the others)
            for p, p32 in self._pairs():
                if is_expert(p32):
                    continue
                if p.grad is not None:
                    if p32.grad is None:
                        p32.grad = p.grad.data.float()
                    else:
                        p32.grad.data.copy_(p.grad.data)
                else:
                    p32.grad = torch.zeros_like(p.data, dtype=torch.float)

    # fairseq's resume compares the optimizer's class name with the saved one: the state is FP16Optimizer's
    ExpertFP16Optimizer.__name__ = ExpertFP16Optimizer.__qualname__ = FP16Optimizer.__name__
    return ExpertFP16Optimizer
