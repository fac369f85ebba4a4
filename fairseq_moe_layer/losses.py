"""Router losses, as pure functions of the routing (no state, no module globals), and MoEAux: what one
forward of a layer returns besides y (its losses and statistics)."""
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Union

import torch

from fairseq_moe_kernels.reference import count


def balance_loss(probs, top_experts):
    """GShard/Switch load-balancing loss: E^2 * mean_e(me_e * ce_e).

    me_e: mean router probability of expert e; ce_e: fraction of tokens whose FIRST choice is e.
    Equals 1 for a perfectly uniform router; the same value as fairseq's moe branch and Tutel.
    probs: [T, E] fp32; top_experts: [T, k].
    """
    T, E = probs.shape
    me = probs.mean(0)  # [E]
    ce = count(top_experts[:, 0], E).to(probs.dtype) / T  # [E] (bincount's, without its read of the device)
    return (me * ce).mean() * E * E


def router_z_loss(logits):
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2; keeps logits small."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def gate_entropy(probs):
    """Mean entropy (nats) of the router distribution; log(E) is a uniform router."""
    return -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1).mean()


def _cv_squared(v):
    """Squared coefficient of variation (unbiased variance / mean^2), 0 for fewer than 2 values."""
    return v.var() / (v.mean() ** 2 + 1e-10) if v.numel() > 1 else v.sum() * 0.0


def importance_loss(probs, top_experts):
    """Shazeer et al. 2017: CV(Importance)^2, Importance_e = sum over tokens of the gate of e, the gates
    being the softmax over each token's k chosen experts (zero elsewhere). With k = 1 every gate is 1: no
    gradient reaches the router through it. probs: [T, E] fp32; top_experts: [T, k]."""
    top_p = probs.gather(1, top_experts)
    gates = torch.zeros_like(probs).scatter(1, top_experts, top_p / top_p.sum(-1, keepdim=True))
    return _cv_squared(gates.sum(0))


def load_loss(clean, noisy, k, sigma):
    """Shazeer et al. 2017: CV(Load)^2 with the smooth load estimator of noisy top-k gating, Load_e =
    sum over tokens of P(e is among the k best under a new draw of the noise) =
    Phi((clean_e - kth_excluding(noisy, k, e)) / sigma): the k-th best noisy logit of the other experts.
    The noise here has a fixed std sigma (Gaussian gate noise), not Shazeer's learned one.
    clean, noisy: [T, E] fp32 logits without and with the noise."""
    E = clean.shape[1]
    if k >= E:  # every expert is always chosen: a perfectly even load
        return clean.sum() * 0.0
    top = noisy.topk(k + 1, dim=-1).values  # [T, k + 1]
    threshold = torch.where(noisy >= top[:, k - 1:k], top[:, k:k + 1], top[:, k - 1:k])
    load = torch.distributions.Normal(0.0, 1.0).cdf((clean - threshold) / sigma).sum(0)
    return _cv_squared(load)


@dataclass
class ShazeerInputs:
    """What Shazeer et al.'s importance and load losses are computed from (policies with a balance loss)."""

    probs: torch.Tensor  # [T, E] fp32 router probabilities
    top_experts: torch.Tensor  # [T, k] the chosen experts
    clean_logits: Optional[torch.Tensor] = None  # [T, E] without the Gaussian gate noise (None: no such noise)
    noisy_logits: Optional[torch.Tensor] = None  # [T, E] with it
    k: int = 1
    noise_std: float = 0.0


@dataclass
class MoEAux:
    """What one forward of a layer returns besides y. Losses carry grad; statistics do not."""

    balance_loss: torch.Tensor  # scalar, GShard/Switch load-balancing loss (0 where the policy balances)
    z_loss: torch.Tensor  # scalar, router z-loss
    demand: torch.Tensor  # [E] long, assignments per expert before dropping
    counts: torch.Tensor  # [E] long, assignments per expert after dropping
    num_tokens: int  # tokens routed (padding excluded)
    top_k: int
    entropy: torch.Tensor  # scalar, mean router entropy (nats)
    dropped: Union[float, torch.Tensor] = 0.0  # Routing.dropped (read through dropped_fraction)
    shazeer: Optional[ShazeerInputs] = field(default=None, repr=False)  # None: Shazeer's losses are zero
    cmr_gate_sum: Optional[torch.Tensor] = None  # --moe-cmr: the sum of its gates over the tokens (has grad)

    @property
    def dropped_fraction(self):
        """What the routing policy's Policy.dropped says (a host read, when asked for)."""
        return float(self.dropped)

    @cached_property
    def importance_loss(self):
        """Shazeer et al.'s CV(importance)^2 (policies with a balance loss; else 0), computed on first use only."""
        s = self.shazeer
        return self.z_loss * 0.0 if s is None else importance_loss(s.probs, s.top_experts)

    @cached_property
    def load_loss(self):
        """Shazeer et al.'s CV(load)^2 (with Gaussian gate noise; else 0), computed on first use only."""
        s = self.shazeer
        if s is None or s.clean_logits is None:
            return self.z_loss * 0.0
        return load_loss(s.clean_logits, s.noisy_logits, s.k, s.noise_std)

    @property
    def imbalance(self):
        """max / mean of the per-expert demand; 1.0 is a perfectly even load."""
        return self.statistics()[1].item()

    def statistics(self):
        """(dropped fraction, imbalance, entropy): fp32 0-d tensors on the device of demand, made without reading it
        (the criterion's metrics: fairseq reads them with its own, once per logged step)."""
        demand = self.demand.float()
        dropped = self.dropped.detach().float() if torch.is_tensor(self.dropped) else \
            torch.full((), float(self.dropped), device=demand.device)
        imbalance = demand.max() / demand.mean() if self.num_tokens else torch.ones((), device=demand.device)
        return dropped.to(demand.device), imbalance, self.entropy.detach().float().to(demand.device)
