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


def sequence_balance_loss(probs, top_experts, sequence, num_sequences):
    """DeepSeek-V2/V3's sequence-wise balance loss, averaged over the sequences: for each sequence b of T_b tokens,
    sum_e f_be P_be with f_be = E c_be / (k T_b), c_be the times e is among its tokens' k choices (every choice
    counted), P_be the mean over its tokens of the probability of e. 1 for a perfectly even router in every sequence.
    probs: [T, E] fp32 (the normalised scores s'); top_experts: [T, k]; sequence: [T] long, each token's sequence
    (0 .. num_sequences - 1; sequences without a token, all padding, are left out of the mean)."""
    T, E = probs.shape
    k, B = top_experts.shape[1], num_sequences
    tokens = torch.zeros(B, dtype=probs.dtype, device=probs.device).index_add_(
        0, sequence, torch.ones(T, dtype=probs.dtype, device=probs.device))  # [B]
    counts = torch.zeros(B * E, dtype=probs.dtype, device=probs.device).index_add_(
        0, (sequence[:, None] * E + top_experts).reshape(-1), torch.ones(T * k, dtype=probs.dtype,
                                                                          device=probs.device)).view(B, E)
    mass = torch.zeros(B, E, dtype=probs.dtype, device=probs.device).index_add_(0, sequence, probs)  # [B, E]
    present = tokens > 0
    per_sequence = (counts * mass).sum(-1) * E / (k * tokens.clamp(min=1) ** 2)  # [B]
    return (per_sequence * present).sum() / present.sum().clamp(min=1)


def global_balance_share(probs, top_experts, counts, total_tokens, batch_tokens=None):
    """This rank's share of the global-batch balance loss sum_e f_e P_e over the tokens of every data-parallel rank
    (f_e = E C_e / (k T), C_e the choices of e on every rank, every one of the k counted; P_e the mean probability of e
    over all T tokens): sum_e f_e (sum of this rank's probabilities of e) / T. The ranks' shares add up to the loss.
    probs: [T_r, E] fp32; top_experts: [T_r, k]; counts: [E] every rank's choices (no grad); total_tokens: T.
    batch_tokens: the tokens of this micro-batch on every rank, where counts and total_tokens also hold the update's
    earlier micro-batches (f from all of them, P from this one; default total_tokens)."""
    E, k = probs.shape[1], top_experts.shape[1]

    def positive(n):
        return n.clamp(min=1).to(probs.dtype) if torch.is_tensor(n) else max(n, 1)

    f = counts.to(probs.dtype) * E / (k * positive(total_tokens))
    return (f * probs.sum(0)).sum() / positive(total_tokens if batch_tokens is None else batch_tokens)


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

    balance_loss: torch.Tensor  # scalar, the load-balancing loss of --moe-balance-loss-scope (0 where the policy
    # balances); global: this rank's share (balance_share_of_global)
    z_loss: torch.Tensor  # scalar, router z-loss
    demand: torch.Tensor  # [E] long, assignments per expert before dropping
    counts: torch.Tensor  # [E] long, assignments per expert after dropping
    num_tokens: int  # tokens routed (padding excluded)
    top_k: int
    entropy: torch.Tensor  # scalar, mean router entropy (nats)
    dropped: Union[float, torch.Tensor] = 0.0  # Routing.dropped (read through dropped_fraction)
    shazeer: Optional[ShazeerInputs] = field(default=None, repr=False)  # None: Shazeer's losses are zero
    cmr_gate_sum: Optional[torch.Tensor] = None  # --moe-cmr: the sum of its gates over the tokens (has grad)
    balance_share_of_global: bool = False  # balance_loss is this rank's share of a loss over every data-parallel
    # rank's tokens (the ranks' shares add up to it): the criterion weights it by the global sample size

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
