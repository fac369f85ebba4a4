"""MoELayer: a sparse replacement for a transformer FFN block, usable from plain PyTorch.

    layer = MoELayer(MoEConfig(model_dim=512, ffn_dim=2048, num_experts=8, top_k=2))
    y, aux = layer(x)                 # x: [T, d] or [B, T, d]; y has x's shape
    y, aux = layer(x, top_k=1, capacity_factor=2.0)   # other settings for this call only (Tutel)
    loss = task_loss + 0.01 * aux.balance_loss + 0.001 * aux.z_loss

Data path: gate -> route (the policy: top-k, expert choice, dense; capacity) -> permute ->
[all-to-all] -> grouped MLP -> [all-to-all] -> unpermute. The all-to-alls run when the experts are
spread over ranks (ep).

Letters: T tokens, d model dim, f expert FFN dim, E experts (E_local on this rank), k experts per token,
N rows routed (sorted by expert), G groups and n tokens per group (Soft MoE).
"""
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Optional

import torch
from torch import nn

from fairseq_moe_kernels import backend

from .comm import ExpertParallel, all_to_all, block_transpose_index, exchange_counts, expert_grad_hook
from .config import MoEConfig
from .experts import Experts
from .gates import GATES, noisy_logits
from .losses import balance_loss, gate_entropy, importance_loss, load_loss, router_z_loss
from .pipeline import pipelined_experts
from .routing import ROUTINGS, soft_weights


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
    dropped: object = 0.0  # Routing.dropped (a number or a 0-d tensor: read through dropped_fraction)
    # What Shazeer's losses are computed from, when asked for (top-k routing): (probs, top_experts, and
    # with Gaussian gate noise the clean and noisy logits, k and the noise std). None: they are zero.
    shazeer: Optional[tuple] = field(default=None, repr=False)

    @property
    def dropped_fraction(self):
        """Top-k: the fraction of the T*k assignments over capacity; expert choice: of the tokens taken by
        no expert (a host read, when asked for)."""
        return float(self.dropped)

    @cached_property
    def importance_loss(self):
        """Shazeer et al.'s CV(importance)^2 (top-k routing; else 0), computed on first use only."""
        return self.z_loss * 0.0 if self.shazeer is None else importance_loss(*self.shazeer[:2])

    @cached_property
    def load_loss(self):
        """Shazeer et al.'s CV(load)^2 (top-k with Gaussian gate noise; else 0), computed on first use only."""
        if self.shazeer is None or self.shazeer[2] is None:
            return self.z_loss * 0.0
        return load_loss(*self.shazeer[2:])

    @property
    def imbalance(self):
        """max / mean of the per-expert demand; 1.0 is a perfectly even load."""
        demand = self.demand.float()
        return (demand.max() / demand.mean()).item() if self.num_tokens else 1.0


class MoELayer(nn.Module):
    """ep: None (all experts here) or comm.ExpertParallel (this rank holds ep.num_local_experts)."""

    def __init__(self, cfg: MoEConfig, ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.cfg = cfg.validate()
        self.ep = ep
        logits_per_token = cfg.num_experts * (cfg.soft_slots if cfg.routing == "soft" else 1)  # (soft: per slot)
        self.gate = None if cfg.routing == "hash" else (  # (hash routing has no learned router)
            GATES[cfg.gate](cfg.model_dim, logits_per_token, fp32=cfg.gate_fp32))
        local, first = (cfg.num_experts, 0) if ep is None else (ep.num_local_experts, ep.first_expert)
        self.experts = Experts(
            local, cfg.model_dim, cfg.ffn_dim, cfg.activation, cfg.activation_dropout, first,
            cfg.num_experts,
        )
        self.shared = Experts(cfg.shared_experts, cfg.model_dim, cfg.ffn_dim, cfg.activation, cfg.activation_dropout,
                              routed=False) if cfg.shared_experts else None
        self._load = None  # [E] assignments chosen since the last bias update (training forwards)
        if cfg.bias_update_rate:  # the aux-loss-free balancing bias: state (checkpointed), not a parameter
            self.register_buffer("routing_bias", torch.zeros(cfg.num_experts))
        self.register_load_state_dict_pre_hook(_bias_as_configured)
        if ep is not None:
            for p in self.experts.parameters():
                p.register_hook(partial(expert_grad_hook, ep=ep, normalization=cfg.expert_grad_normalization))

    def forward(self, x, padding_mask=None, top_k=None, capacity_factor=None, token_ids=None):
        """x: [..., d]; padding_mask: [...] (True or nonzero = padding, skipped by routing and losses).
        top_k, capacity_factor: other values for this call only (default: the config's; at eval the
        config's eval_top_k when set). token_ids: [...] the token id at each position (hash routing).

        Returns (y, aux): y [..., d] (zeros for padding and for fully dropped tokens), aux: MoEAux.
        """
        cfg = self.cfg
        if cfg.routing == "soft":
            if top_k is not None or capacity_factor is not None:
                raise ValueError("--moe-routing soft has no top-k and no capacity to set for a call")
            return self._soft(x, padding_mask)
        k = top_k or (cfg.eval_top_k if not self.training and cfg.eval_top_k else cfg.top_k)
        if k != cfg.top_k or capacity_factor is not None:
            cf = cfg.capacity_factor if capacity_factor is None else capacity_factor
            # With k = 1 the options of the second and later choices have nothing to act on: off.
            second = {} if k > 1 else dict(second_expert_policy="all", normalize_gate_prob_before_dropping=False)
            cfg = dataclasses.replace(cfg, top_k=k, capacity_factor=cf, **second).validate()
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T_all, d]
        keep = None
        if padding_mask is not None:
            if padding_mask.shape != shape[:-1]:
                raise ValueError(f"padding_mask {tuple(padding_mask.shape)} must match x{tuple(shape[:-1])}")
            keep = (~padding_mask.reshape(-1).bool()).nonzero().squeeze(1)  # [T]
            x = x.index_select(0, keep)
        if token_ids is not None:
            if token_ids.shape != shape[:-1]:
                raise ValueError(f"token_ids {tuple(token_ids.shape)} must match x{tuple(shape[:-1])}")
            token_ids = token_ids.reshape(-1) if keep is None else token_ids.reshape(-1).index_select(0, keep)
        T = x.shape[0]
        ops = backend.ops(backend.resolve(cfg.kernel_backend, x.device, x.dtype))

        logits, clean = (None, None) if self.gate is None else noisy_logits(
            self.gate, x, cfg.gate_noise, cfg.gate_noise_scale, self.training)  # [T, E] fp32
        router = ops.router if ops.name == "triton" else None  # torch: route() shares the softmax
        bias = getattr(self, "routing_bias", None)
        r = ROUTINGS[cfg.routing](logits, k, cfg.capacity(T, self.training), router, cfg, self.training,
                                  bias=bias, token_ids=token_ids)
        if bias is not None and self.training:
            self._load = r.demand.detach().float() + (0 if self._load is None else self._load)
        if self.ep is None:
            y = self.experts.combine(x, r.token_index, r.weights, r.counts, ops)  # [T, d]
        else:
            rows = ops.permute(x, r.token_index)  # [N, d] sorted by expert
            y = ops.unpermute(self._remote(rows, r.counts, ops), r.token_index, r.weights, T)  # [T, d]

        if self.shared is not None:
            y = y + self.shared.all_tokens(x, ops)
        if keep is not None:
            y = y.new_zeros(shape[:-1].numel(), shape[-1]).index_copy(0, keep, y)
        aux = self._aux(logits, clean, r, T, k, cfg)
        return y.view(shape), aux

    def _soft(self, x, padding_mask):
        """Soft MoE on x [G, n, d] (G groups of n tokens; [n, d]: one group): each expert's slots are
        mixtures of a group's tokens, each token a mixture of its group's slot outputs (soft_weights)."""
        cfg = self.cfg
        shape = x.shape
        if x.dim() not in (2, 3):
            raise ValueError(f"--moe-routing soft takes x [groups, tokens, d] or [tokens, d], not {tuple(shape)}")
        if padding_mask is not None and padding_mask.shape != shape[:-1]:
            raise ValueError(f"padding_mask {tuple(padding_mask.shape)} must match x{tuple(shape[:-1])}")
        x = x.reshape(shape[0] if x.dim() == 3 else 1, shape[-2], shape[-1])  # [G, n, d] (n = 0 too)
        mask = None if padding_mask is None else padding_mask.reshape(x.shape[:2]).bool()
        G, n, d = x.shape
        E, p = cfg.num_experts, cfg.soft_slots
        ops = backend.ops(backend.resolve(cfg.kernel_backend, x.device, x.dtype))
        logits, _ = noisy_logits(self.gate, x.reshape(-1, d), cfg.gate_noise, cfg.gate_noise_scale, self.training)
        logits = logits.view(G, n, E * p)
        dispatch, combine = soft_weights(logits, mask)  # [G, n, E*p], fp32
        slots = torch.einsum("gns,gnd->gsd", dispatch.to(x.dtype), x)  # [G, E*p, d]
        rows = slots.view(G, E, p, d).transpose(0, 1).reshape(E * G * p, d)  # sorted by expert
        counts = torch.full((E,), G * p, dtype=torch.long, device=x.device)
        out = self.experts(rows, counts, ops) if self.ep is None else self._remote(rows, counts, ops)
        out = out.view(E, G, p, d).transpose(0, 1).reshape(G, E * p, d)
        y = torch.einsum("gns,gsd->gnd", combine.to(x.dtype), out)
        if self.shared is not None:
            y = y + self.shared.all_tokens(x.reshape(-1, d), ops).view(G, n, d)
        if mask is not None:
            y = y.masked_fill(mask.unsqueeze(-1), 0.0)
        real = logits.reshape(G * n, E * p) if mask is None else logits[~mask]  # [T, E*p] of the real tokens
        T = real.shape[0]
        zero = self.gate.weight.sum() * 0.0
        # "demand": how much of the tokens' outputs each expert provides (the combine weights it gets).
        share = (combine.reshape(G * n, E * p) if mask is None else combine[~mask]).sum(0).view(E, p).sum(1)
        aux = MoEAux(zero, router_z_loss(real) if T else zero, share.detach(), counts, T, 1,
                     gate_entropy(torch.softmax(real.detach().float(), -1)) if T else zero.detach())
        return y.view(shape), aux

    def _apply(self, fn, *args, **kwargs):
        """.to(), .half(), .bfloat16() move the balancing bias but keep it fp32: its steps of
        bias_update_rate (1e-3) would round away in bf16 once it is around 0.5."""
        out = super()._apply(fn, *args, **kwargs)
        bias = getattr(self, "routing_bias", None)
        if bias is not None and bias.dtype != torch.float32:
            self.routing_bias = bias.float()
        return out

    def update_routing_bias(self):
        """After every optimizer step (the fairseq tasks call it; plain PyTorch: after optimizer.step()):
        move each expert's routing bias by bias_update_rate toward balance, from the load of every rank
        since the last update (an all-reduce when several processes train: call it on all of them)."""
        if not self.cfg.bias_update_rate:
            return
        load = torch.zeros_like(self.routing_bias) if self._load is None else self._load.to(self.routing_bias)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(load)
        with torch.no_grad():
            self.routing_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        self._load = None

    def _remote(self, rows, counts, ops):
        """Rows [N, d] sorted by global expert -> their experts on other ranks -> back, same order."""
        P, El = self.ep.size, self.ep.num_local_experts
        send = counts.view(P, El)  # rows for (destination rank, its local expert)
        if self.ep.overlap_degree > 1:
            return pipelined_experts(rows, send, self.experts, self.ep, self.ep.overlap_degree, ops)
        recv = exchange_counts(send, self.ep.group)  # [P source ranks, El]
        x = all_to_all(rows, send.sum(1), recv.sum(1), self.ep)  # (source, local expert) order
        order = block_transpose_index(recv)  # -> (local expert, source) order
        y = self.experts(x.index_select(0, order), recv.sum(0), ops)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (source, local expert) order
        return all_to_all(y, recv.sum(1), send.sum(1), self.ep)

    def _aux(self, logits, clean, r, T, k, cfg):
        # A zero loss that still belongs to the graph (hash routing has no router: a plain zero).
        zero = self.gate.weight.sum() * 0.0 if self.gate is not None else r.probs.new_zeros(())
        if T == 0:  # nothing routed
            return MoEAux(zero, zero, r.demand, r.counts, 0, k, zero.detach())
        noisy = clean is not None and cfg.gate_noise == "gaussian" and cfg.gate_noise_scale
        return MoEAux(
            balance_loss=zero if r.top_experts is None else balance_loss(r.probs, r.top_experts),
            z_loss=zero if logits is None else router_z_loss(logits),
            demand=r.demand.detach(),
            counts=r.counts.detach(),
            num_tokens=T,
            top_k=k,
            entropy=gate_entropy(r.probs.detach()),
            dropped=r.dropped,
            shazeer=None if r.top_experts is None else (
                r.probs, r.top_experts, *((clean, logits.float(), k, cfg.gate_noise_scale) if noisy else (None,))),
        )


def _bias_as_configured(module, state_dict, prefix, *args):
    """The balancing bias follows the layer's --moe-bias-update-rate, not the checkpoint's: a checkpoint
    trained without it loads into a layer that has one with a zero bias; one trained with it loads into a
    layer without one by leaving its bias out (the routing then follows the scores alone)."""
    bias = getattr(module, "routing_bias", None)
    if bias is not None and prefix + "routing_bias" not in state_dict:
        state_dict[prefix + "routing_bias"] = torch.zeros_like(bias)
    elif bias is None:
        state_dict.pop(prefix + "routing_bias", None)
