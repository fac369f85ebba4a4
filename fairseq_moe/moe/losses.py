"""Router losses, as pure functions of the routing (no state, no module globals)."""
import torch


def balance_loss(probs, top_experts):
    """GShard/Switch load-balancing loss: E^2 * mean_e(me_e * ce_e).

    me_e: mean router probability of expert e; ce_e: fraction of tokens whose FIRST choice is e.
    Equals 1 for a perfectly uniform router; the same value as fairseq's moe branch and Tutel.
    probs: [T, E] fp32; top_experts: [T, k].
    """
    T, E = probs.shape
    me = probs.mean(0)  # [E]
    ce = torch.bincount(top_experts[:, 0], minlength=E).to(probs.dtype) / T  # [E]
    return (me * ce).mean() * E * E


def router_z_loss(logits):
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2; keeps logits small."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def gate_entropy(probs):
    """Mean entropy (nats) of the router distribution; log(E) is a uniform router."""
    return -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1).mean()
