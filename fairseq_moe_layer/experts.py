"""Experts: E two-layer MLPs, stored stacked so that one grouped GEMM serves them all; EXPERT_KINDS, the kinds.

Layout (so weights copy to and from other libraries):
  ffn     w1 [E, d, f], b1 [E, f], w2 [E, f, d], b2 [E, d]; expert e computes act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]
          (act: --activation-fn), the FFN of fairseq's transformer;
  swiglu  w1 [E, d, 2f] (the gate's f columns, then the up projection's), w2 [E, f, d], no biases; expert e computes
          (silu(x @ w1[e][:, :f]) * (x @ w1[e][:, f:])) @ w2[e] (Shazeer 2020; Mixtral's, Qwen-MoE's, OLMoE's experts:
          their w1 is our gate half, w3 our up half, w2 ours, each transposed).
A new kind is a subclass of Experts here, registered by @register_experts("name") with its help; the kernels of
every backend take each kind's weights (fairseq_moe_kernels: the activation and the biases say the kind).
"""
import contextlib
import math

import torch
from torch import nn

from fairseq_moe_kernels import grad_buffers, host, reference


def is_expert(p):
    """Whether a parameter is one of routed experts (marked `expert` by Experts): each rank holds its own, so
    data-parallel reductions, ZeRO and FSDP leave it out."""
    return hasattr(p, "expert")


def autocast_dtype(device_type):
    """The dtype torch.autocast casts to on this device type now, or None where it is off (or has no autocast: a
    meta tensor's, say). torch < 2.4 has only per-device functions."""
    try:
        if hasattr(torch, "get_autocast_dtype"):
            return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except RuntimeError:  # (no autocast for this device type)
        return None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return None


def autocast_off(device_type):
    """A context with autocast off for this device type (nothing to turn off where it has none)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


EXPERT_KINDS = {}


def register_experts(name, help):
    """@register_experts("name", help) on an Experts subclass: EXPERT_KINDS[name] is it (--moe-expert-kind)."""
    def wrap(cls):
        cls.kind, cls.help = name, help
        EXPERT_KINDS[name] = cls
        return cls

    return wrap


@register_experts("ffn", "act(x W1 + b1) W2 + b2 with --activation-fn (fairseq's transformer FFN)")
class Experts(nn.Module):
    """The experts this rank holds: global experts first_expert .. first_expert + num_experts - 1."""

    def __init__(self, num_experts, model_dim, ffn_dim, activation="relu", activation_dropout=0.0,
                 first_expert=0, total_experts=None, routed=True):
        super().__init__()
        E, d, f = num_experts, model_dim, ffn_dim
        self.first_expert = first_expert
        self.total_experts = total_experts or num_experts
        self.register_load_state_dict_pre_hook(_take_local_slice)
        self.activation = self.fixed_activation or activation
        self.activation_dropout = activation_dropout
        self.w1 = nn.Parameter(torch.empty(E, d, f * self.fc1_halves))
        self.b1 = nn.Parameter(torch.empty(E, f)) if self.biases else None
        self.w2 = nn.Parameter(torch.empty(E, f, d))
        self.b2 = nn.Parameter(torch.empty(E, d)) if self.biases else None
        for p in self.parameters() if routed else ():  # (shared, always-on experts are plain parameters)
            # fairseq's data-parallel all-reduce (legacy_ddp) and grad-norm skip parameters marked so:
            # each rank holds different experts. Marked on one rank too, so that --clip-norm measures
            # the same (shared) parameters whatever the world size.
            p.expert = True
        self.reset_parameters()

    fixed_activation = None  # (a kind whose activation is its own: not --activation-fn)
    fc1_halves = 1  # (swiglu: w1 holds the gate and the up projection)
    biases = True

    def reset_parameters(self):
        """Each expert starts like a fresh nn.Linear pair (the dense FFN of fairseq's transformer; swiglu: W1's
        gate and up halves each as an nn.Linear of d inputs).

        Expert e draws from its own generator seeded by (one draw of the global RNG) + e, so that
        its weights are the same whichever rank holds it and however many ranks share the experts:
        a model built on W ranks starts from the very weights of the same model on one rank.
        """
        d, f = self.w1.shape[1], self.w2.shape[1]
        base = int(torch.randint(0, 2**62, (), device="cpu"))  # (the global CPU generator, also under a meta device)
        if self.w1.is_meta:  # shapes only (torch.device("meta")): nothing to fill
            return
        with torch.no_grad():
            for e in range(self.num_experts):
                g = torch.Generator().manual_seed(base + self.first_expert + e)
                for w, b, fan_in in ((self.w1, self.b1, d), (self.w2, self.b2, f)):
                    bound = 1 / math.sqrt(fan_in)
                    for p in (w[e],) if b is None else (w[e], b[e]):
                        p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 * bound - bound)

    @property
    def num_experts(self):
        return self.w1.shape[0]

    def dropout_p(self):
        """Activation dropout in force now (0 at eval)."""
        return self.activation_dropout if self.training else 0.0

    def compute_dtype(self, x):
        """The dtype the experts compute tokens x in: autocast's where it is on for x's device (as nn.Linear follows
        it: fp32 weights cast, fp64 ones not), else the weights' (x is cast to it)."""
        dtype = autocast_dtype(x.device.type)
        if dtype is not None and self.w1.dtype != torch.float64:
            return dtype
        return self.w1.dtype

    def _run(self, op, x, *args, ops=reference, weights=None, **kwargs):
        """ops.op on x and the weights (weights: (w1, b1, w2, b2), these experts' by default), all cast to
        compute_dtype(x), with autocast off: every backend then gets one dtype and computes in it natively (its
        custom autograd Functions and their backward too); the casts carry the gradients back to the weights'
        dtype, as autocast's own casts do."""
        dtype = self.compute_dtype(x)
        w1, b1, w2, b2 = (None if w is None else grad_buffers.cast(w, dtype)
                          for w in weights or (self.w1, self.b1, self.w2, self.b2))
        with autocast_off(x.device.type):
            return getattr(ops, op)(x.to(dtype), *args, w1, b1, w2, b2, self.activation, self.dropout_p(), **kwargs)

    def forward(self, rows, counts, ops=reference, weights=None):
        """rows: [N, d] sorted by expert, counts: [E] -> [N, d] in compute_dtype(rows). ops: the kernels
        (fairseq_moe_kernels.backend.ops); weights: (w1, b1, w2, b2) in place of these experts' (pipeline.py)."""
        return self._run("grouped_mlp", rows, counts, ops=ops, weights=weights)

    def all_tokens(self, x, ops=reference):
        """sum over these experts of expert(x): x [T, d] -> [T, d] (shared, always-on experts)."""
        E, T = self.num_experts, x.shape[0]
        counts = host.full(E, T, x.device)  # (known on the host: no device read)
        return self(x.repeat(E, 1), counts, ops).view(E, T, x.shape[1]).sum(0)

    def combine(self, x, token_index, weights, counts, ops=reference, rows_per_token=None):
        """sum over each token's rows of weight * expert(x[token]): x [T, d] -> [T, d] in compute_dtype(x), fused
        (the weighted sum in that dtype, as the experts' outputs are). rows_per_token: the most rows of a token,
        where known on the host (ops.moe_mlp's)."""
        return self._run("moe_mlp", x, token_index, weights, counts, ops=ops, rows_per_token=rows_per_token)


@register_experts("swiglu", "(silu(x W1_gate) * x W1_up) W2, no biases (Mixtral, Qwen-MoE, OLMoE, DeepSeek)")
class SwiGLUExperts(Experts):
    """Experts of a gated linear unit with silu: w1 [E, d, 2f] (gate, then up), w2 [E, f, d], no biases."""

    fixed_activation = "swiglu"
    fc1_halves = 2
    biases = False


def _take_local_slice(module, state_dict, prefix, *args):
    """Loading all E experts (a consolidated checkpoint) into a rank that holds E_l of them."""
    lo, hi = module.first_expert, module.first_expert + module.num_experts
    for name in ("w1", "b1", "w2", "b2"):
        full = state_dict.get(prefix + name)
        if full is not None and full.shape[0] == module.total_experts != module.num_experts:
            state_dict[prefix + name] = full[lo:hi]
