"""Gates: a gate maps tokens x[T, d] to router logits[T, E], nothing more.

Softmax, top-k, capacity and the losses live once in routing.py and losses.py, so no gate can
compute them differently. A new gate is one class here with its `help` (shown with --moe-gate's choices),
registered by @register_gate("name"); the contract tests in tests/fairseq_moe_layer/test_gates.py run every
registered gate.
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .experts import autocast_off


def registrar(table):
    """The decorator factory of a registry: @register(name) puts the class or function in table."""
    def register(name):
        def wrap(obj):
            table[name] = obj
            return obj
        return wrap

    return register


GATES = {}


def register_gate(name, help=None):
    """@register_gate("name") on a gate class (Gate(model_dim, num_logits, fp32=...)): GATES[name] is it. Its
    help (help=, or the class's `help`) says what it does in --moe-gate's help and the flag table; a gate
    without one is refused."""
    def wrap(cls):
        if help is not None:
            cls.help = help
        if not isinstance(getattr(cls, "help", None), str) or not cls.help.strip():
            raise ValueError(f"gate {name!r} has no help: give it a class attribute help = \"what it does\" (or "
                             f"register_gate({name!r}, help=...)); --moe-gate's help shows it")
        return registrar(GATES)(name)(cls)
    return wrap


NOISES = ("none", "jitter", "gaussian")  # --moe-gate-noise


def _precision(x, fp32):
    """(dtype, context) of a gate's GEMMs: fp32 with autocast off (--moe-gate-fp32: the router's logits in fp32
    whatever the autocast), or x's dtype with autocast as it is."""
    if fp32:
        return torch.float32, autocast_off(x.device.type)
    return x.dtype, contextlib.nullcontext()


@register_gate("linear")
class LinearGate(nn.Module):
    """logits = x @ weight.T, weight [E, d] kept in fp32 (GShard, Switch, fairseq's moe branch)."""

    help = "a linear map (GShard, Switch)"

    def __init__(self, model_dim, num_experts, fp32=True):
        super().__init__()
        self.fp32 = fp32
        self.weight = nn.Parameter(torch.empty(num_experts, model_dim, dtype=torch.float32))
        # Same init as nn.Linear(d, E, bias=False), the gate of fairseq's moe branch.
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x):  # x: [T, d] -> logits [T, E] fp32
        dtype, precision = _precision(x, self.fp32)
        with precision:
            return F.linear(x.to(dtype), self.weight.to(dtype)).float()


@register_gate("cosine")
class CosineGate(nn.Module):
    """logits = cos(x W_proj + b_proj, e_i) / t: the cosine router of X-MoE and Tutel, stable when E is large.
    The temperature is learned, as log(1 / t), and clamped at t >= 0.01 (Tutel's CosineTopKGate: init
    t = 0.5, a 256-d projection with a bias)."""

    help = ("cosine similarity in a 256-d projection over a learned temperature (init 0.5, clamped at >= 0.01: "
            "Tutel's; checkpoints from before it load with the fixed 0.07 they were trained with)")
    MIN_TEMPERATURE = 0.01
    FIXED_TEMPERATURE = 0.07  # what checkpoints of fairseq-moe before the learned temperature were trained with

    def __init__(self, model_dim, num_experts, fp32=True, proj_dim=256, temperature=0.5):
        super().__init__()
        self.fp32 = fp32
        self.proj = nn.Linear(model_dim, proj_dim)
        # weight [E, proj_dim]: one learned direction per expert.
        self.weight = nn.Parameter(torch.empty(num_experts, proj_dim, dtype=torch.float32))
        nn.init.orthogonal_(self.weight, gain=0.32)
        self.log_inv_temperature = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        self.register_load_state_dict_pre_hook(_fixed_temperature_if_missing)

    def forward(self, x):  # x: [T, d] -> logits [T, E] fp32
        dtype, precision = _precision(x, self.fp32)
        with precision:
            h = F.linear(x.to(dtype), self.proj.weight.to(dtype), self.proj.bias.to(dtype))  # [T, 256]
        h = F.normalize(h.float(), dim=-1)
        scale = self.log_inv_temperature.float().clamp(max=math.log(1.0 / self.MIN_TEMPERATURE)).exp()
        with autocast_off(x.device.type):  # (the cosines in fp32 either way)
            return F.linear(h, F.normalize(self.weight.float(), dim=-1)) * scale


def _fixed_temperature_if_missing(module, state_dict, prefix, *args):
    """A cosine gate saved before the temperature was learned (and before the projection had a bias) loads
    as the gate it was: t = 0.07, no bias."""
    if prefix + "weight" in state_dict and prefix + "log_inv_temperature" not in state_dict:
        state_dict[prefix + "log_inv_temperature"] = torch.tensor(math.log(1.0 / module.FIXED_TEMPERATURE))
        state_dict.setdefault(prefix + "proj.bias", torch.zeros_like(module.proj.bias))


@register_gate("scaled_cosine")
class ScaledCosineGate(nn.Module):
    """logits = scale * cos(x, phi_i): Soft MoE's normalised router (Puigcerver et al. 2023, sec. 2.3): x and
    each row of weight [E, d] l2-normalised, times one learned scalar (init 1), so that the logits do not
    grow with the model's width. With --moe-routing soft, the rows are the slots' parameters."""

    help = "`scale x cos(x, phi_e)` with one learned scale (Soft MoE's normalised router, for any routing)"

    def __init__(self, model_dim, num_experts, fp32=True):
        super().__init__()
        self.fp32 = fp32
        self.weight = nn.Parameter(torch.empty(num_experts, model_dim, dtype=torch.float32))
        nn.init.normal_(self.weight, std=model_dim ** -0.5)  # (LeCun normal; the norm is divided out anyway)
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float32))

    def forward(self, x):  # x: [T, d] -> logits [T, E] fp32
        dtype, precision = _precision(x, self.fp32)
        with precision:
            cos = F.linear(F.normalize(x.to(dtype), dim=-1), F.normalize(self.weight.to(dtype), dim=-1)).float()
        return self.scale.float() * cos


def noisy_logits(gate, x, noise="none", scale=0.0, training=False):
    """(logits, clean): gate(x) with the training-only noise of --moe-gate-noise, and the logits without
    it where they are known (None under jitter). jitter multiplies x by U(1 - scale, 1 + scale)
    element-wise (Switch, DeepSpeed); gaussian adds N(0, scale^2) to the logits (Tutel's gate noise,
    Shazeer's noisy top-k with a fixed std). The draws come from torch's global generator; at eval the
    logits are gate(x)."""
    if training and noise == "jitter" and scale:
        return gate(x * torch.empty_like(x).uniform_(1.0 - scale, 1.0 + scale)), None
    clean = gate(x)
    if training and noise == "gaussian" and scale:
        return clean + torch.randn_like(clean) * scale, clean
    return clean, clean
