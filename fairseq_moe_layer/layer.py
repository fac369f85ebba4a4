"""MoELayer: a sparse replacement for a transformer FFN block, usable from plain PyTorch.

    layer = MoELayer(MoEConfig(model_dim=512, ffn_dim=2048, num_experts=8, top_k=2))
    y, aux = layer(x)                 # x: [T, d] or [B, T, d]; y has x's shape
    y, aux = layer(x, top_k=1, capacity_factor=2.0)   # other settings for this call only (Tutel)
    loss = task_loss + 0.01 * aux.balance_loss + 0.001 * aux.z_loss
    # (balance_loss_scope "global" on W processes: aux.balance_loss is this rank's share of the loss over every
    # rank's tokens; the shares' gradients add up to its gradient: times W under DDP's mean of the gradients)

Data path: gate -> route (the routing policy, routing.py; capacity) -> permute ->
[all-to-all] -> grouped MLP -> [all-to-all] -> unpermute. The all-to-alls run when the experts are
spread over ranks (ep). A policy that mixes tokens into slots (Policy.slots) has its own data path
(its forward()). The logits are made once, here (router_logits: the gate and the noise), for every policy.

Letters: T tokens, d model dim, f expert FFN dim, E experts (E_local on this rank), k experts per token,
N rows routed (sorted by expert), G groups and n tokens per group (Soft MoE).
"""
import contextlib
import dataclasses
from functools import partial
from typing import Optional

import torch
from torch import nn

from fairseq_moe_kernels import backend, host
from fairseq_moe_kernels.reference import count

from .comm import ExpertParallel, Plan, block_transpose_index, expert_grad_hook, send_rows
from .config import MoEConfig
from .experts import EXPERT_KINDS
from .gates import GATES, noisy_logits
from .losses import (MoEAux, ShazeerInputs, balance_loss, gate_entropy, global_balance_share, router_z_loss,
                     sequence_balance_loss)
from .pipeline import pipelined_experts
from .routing import ROUTINGS


class MoELayer(nn.Module):
    """ep: None (all experts here) or comm.ExpertParallel (this rank holds ep.num_local_experts)."""

    def __init__(self, cfg: MoEConfig, ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.cfg = cfg.validate()
        self.ep = ep
        self.policy = ROUTINGS[cfg.routing]
        self.gate = GATES[cfg.gate](cfg.model_dim, self.policy.router_outputs(cfg), fp32=cfg.gate_fp32) \
            if self.policy.learned_router else None
        local, first = (cfg.num_experts, 0) if ep is None else (ep.num_local_experts, ep.first_expert)
        Experts = EXPERT_KINDS[cfg.expert_kind]
        self.experts = Experts(
            local, cfg.model_dim, cfg.ffn_dim, cfg.activation, cfg.activation_dropout, first,
            cfg.num_experts,
        )
        self.shared = Experts(cfg.shared_experts, cfg.model_dim, cfg.shared_expert_ffn_dim or cfg.ffn_dim,
                              cfg.activation, cfg.activation_dropout, routed=False) if cfg.shared_experts else None
        # Qwen2-MoE's gate of the shared experts' output: sigmoid(x . g) per token
        self.shared_gate = nn.Linear(cfg.model_dim, 1, bias=False) if cfg.shared_expert_gate else None
        # NLLB-MoE's CMR gate: one logit per token, whose sigmoid mixes the shared FFN and the routed experts
        self.cmr_gate = nn.Linear(cfg.model_dim, 1) if cfg.cmr else None
        self._demand = None  # [E] fp32: assignments asked for since the last bias update (training forwards)
        # A training forward whose loss is thrown away (fairseq's dummy batch, on a rank whose data ran out): its
        # tokens count nowhere across the ranks, neither in the global balance loss nor in the balancing bias's load
        self.ignored = False
        # The global balance loss over the micro-batches of one update (--update-freq): the counts and tokens [E + 1]
        # of this update's earlier micro-batches (add_global_counts), and those of the latest training forward (the
        # same again where --checkpoint-activations recomputes it: no state changes in a forward)
        self.global_prior, self.last_global_counts = None, None
        if cfg.bias_update_rate:  # the aux-loss-free balancing bias: state (checkpointed), not a parameter
            self.register_buffer("routing_bias", torch.zeros(cfg.num_experts))
        self.register_load_state_dict_pre_hook(_bias_as_configured)
        if ep is not None:
            self._lockstep_index = ep.lockstep.add(self)
            for p in self.experts.parameters():
                p.register_hook(partial(expert_grad_hook, ep=ep, normalization=cfg.expert_grad_normalization))
        if cfg.frozen_experts:  # (experts 0 .. N - 1: the rows of them this rank holds, and their router rows)
            mine = max(0, min(self.experts.num_experts, cfg.frozen_experts - first))
            for p in self.experts.parameters() if mine else ():
                p.register_hook(partial(_zero_rows, rows=mine))
            if self.gate is not None:
                self.gate.weight.register_hook(partial(_zero_rows, rows=cfg.frozen_experts))

    def forward(self, x, padding_mask=None, top_k=None, capacity_factor=None, token_ids=None, time_major=False):
        """x: [..., d]; padding_mask: [...] (True or nonzero = padding, skipped by routing and losses).
        top_k, capacity_factor: other values for this call only (default: the config's; at eval the
        config's eval_top_k when set). token_ids: [...] the token id at each position (hash routing).
        The sequences (--moe-balance-loss-scope sequence): x [B, T, d] (any leading dims), or [T, B, d] where
        time_major (fairseq's activations); x [T, d] is one sequence.

        Returns (y, aux): y [..., d] (zeros for padding and for fully dropped tokens), aux: MoEAux.
        """
        if self.ep is None:
            return self._forward(x, padding_mask, top_k, capacity_factor, token_ids, time_major)
        self.ep.lockstep.before(self._lockstep_index)  # (in inference, lockstep.py: until every rank calls it)
        try:
            return self._forward(x, padding_mask, top_k, capacity_factor, token_ids, time_major)
        except BaseException:
            self.ep.lockstep.broken = True  # (the peers may be inside this call's all-to-all)
            raise

    def _forward(self, x, padding_mask, top_k, capacity_factor, token_ids, time_major):
        cfg, policy = self.cfg, self.policy
        if policy.slots:
            if top_k is not None or capacity_factor is not None:
                raise ValueError(f"--moe-routing {cfg.routing} has no top-k and no capacity to set for a call")
            logits, _ = self.router_logits(x.reshape(-1, x.shape[-1]))  # [every position, S] (padding too)
            return policy.forward(self, x, logits, padding_mask)
        k = top_k or (cfg.eval_top_k if not self.training and cfg.eval_top_k else cfg.top_k)
        if k != cfg.top_k or capacity_factor is not None:
            cf = cfg.capacity_factor if capacity_factor is None else capacity_factor
            cfg = dataclasses.replace(cfg, top_k=k, capacity_factor=cf, **policy.at_k(cfg, k)).validate()
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T_all, d]
        keep = None
        if padding_mask is not None:
            if padding_mask.shape != shape[:-1]:
                raise ValueError(f"padding_mask {tuple(padding_mask.shape)} must match x{tuple(shape[:-1])}")
            keep = _kept_positions(padding_mask)  # [T]
            x = x.index_select(0, keep)
        if token_ids is not None:
            if token_ids.shape != shape[:-1]:
                raise ValueError(f"token_ids {tuple(token_ids.shape)} must match x{tuple(shape[:-1])}")
            token_ids = token_ids.reshape(-1) if keep is None else token_ids.reshape(-1).index_select(0, keep)
        T = x.shape[0]
        dtype = self.experts.compute_dtype(x)  # autocast's where it is on (the gate and the losses stay fp32)
        ops = backend.ops(backend.resolve(cfg.kernel_backend, x.device, dtype))

        logits, clean = self.router_logits(x)  # [T, E] fp32
        router = ops.router if ops.name == "triton" else None  # torch: route() shares the softmax
        bias = getattr(self, "routing_bias", None)
        counted = shape[:-1].numel() if cfg.capacity_counts_padding else T  # (the padding too: NLLB-MoE's capacity)
        plans = []  # experts spread: the all-to-alls' counts, exchanged before routing's read (host.ahead)
        with host.ahead(lambda counts: self._plan(counts, plans).tensors) if self.ep is not None else \
                contextlib.nullcontext():
            r = policy.route(logits, k, cfg.capacity(counted, self.training), cfg, self.training, router=router,
                             bias=bias, token_ids=token_ids)
        if plans and plans[0].counts is not r.counts:
            raise RuntimeError(f"--moe-routing {cfg.routing}: the routing read counts other than the kept counts it "
                               f"returns through host.routed (whose read the layer shares with the all-to-alls')")
        if bias is not None and self.training and not self.ignored:
            self._demand = r.demand.detach().float() + (0 if self._demand is None else self._demand)
        weights = self._masked(r.weights, cfg.expert_output_masking)  # [N] (each expert output: --moe-eom)
        if self.ep is None:
            y = self.experts.combine(x, r.token_index, weights, r.counts, ops, policy.rows_per_token(cfg, k))  # [T, d]
        else:
            rows = ops.permute(x.to(dtype), r.token_index)  # [N, d] sorted by expert, cast before they travel
            y = ops.unpermute(self.remote(rows, r.counts, ops, plans[0] if plans else None), r.token_index, weights,
                              T)  # [T, d]

        cmr = None
        if self.cmr_gate is not None:  # (1 - g) FFN(x) + g MoE(x), g dropped out in training (NLLB's CMRGate)
            cmr = torch.nn.functional.dropout(torch.sigmoid(self.cmr_gate(x).squeeze(-1)), cfg.cmr_gate_drop,
                                              self.training)  # [T]
            y = y * cmr.unsqueeze(-1).to(y.dtype) + self.shared.all_tokens(x, ops) * (1 - cmr).unsqueeze(-1).to(y.dtype)
        elif self.shared is not None:
            shared = self.shared.all_tokens(x, ops)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x)).to(shared.dtype)
            y = y + shared
        if cfg.final_output_masking:  # (each token's whole output: --moe-fom)
            y = y * self._masked(y.new_ones(T, 1), cfg.final_output_masking).to(y.dtype)
        if keep is not None:
            y = y.new_zeros(shape[:-1].numel(), shape[-1]).index_copy(0, keep, y)
        aux = self._aux(logits, clean, r, T, k, cfg, lambda: _sequences(shape, time_major, keep, x.device))
        if cmr is not None:
            aux.cmr_gate_sum = cmr.float().sum()  # (NLLB's cmr_gate_loss_num; num_tokens its denominator)
        return y.view(shape), aux

    def router_logits(self, x):
        """(logits, clean) of tokens x [T, d], made once per forward and handed to the policy, whichever it is:
        the gate's logits [T, outputs] fp32 with all the layer applies to them (--moe-gate-noise, in training),
        and the logits without the noise where they are known (None under jitter); (None, None) without a
        learned router."""
        if self.gate is None:
            return None, None
        return noisy_logits(self.gate, x, self.cfg.gate_noise, self.cfg.gate_noise_scale, self.training)

    def _masked(self, factors, p):
        """NLLB-MoE's output masking of what factors scale: in training each is zeroed with probability p (kept as it
        is otherwise: no 1 / (1 - p)), at evaluation all are scaled by 1 - p, the expected value of training's."""
        if not p:
            return factors
        if not self.training:
            return factors * (1 - p)
        return factors * (torch.empty_like(factors).uniform_() > p)

    def _apply(self, fn, *args, **kwargs):
        """.to(), .half(), .bfloat16() move the balancing bias but keep it fp32: its steps of
        bias_update_rate (1e-3) would round away in bf16 once it is around 0.5."""
        out = super()._apply(fn, *args, **kwargs)
        bias = getattr(self, "routing_bias", None)
        if bias is not None and bias.dtype != torch.float32:
            self.routing_bias = bias.float()
        return out

    def reset_global_counts(self):
        """Before the first micro-batch of an update (fairseq_moe's Trainer hook): the global balance loss starts
        from this micro-batch's counts again."""
        self.global_prior = self.last_global_counts = None

    def add_global_counts(self):
        """After each micro-batch's backward (the MoE tasks' train_step): its counts join those the later
        micro-batches of the update balance over."""
        last, self.last_global_counts = self.last_global_counts, None
        if last is not None:
            self.global_prior = last if self.global_prior is None else self.global_prior + last

    def update_routing_bias(self):
        """After every optimizer step (the fairseq tasks call it; plain PyTorch: after optimizer.step()):
        move each expert's routing bias by bias_update_rate toward balance, from the load of every rank
        since the last update (an all-reduce when several processes train: call it on all of them)."""
        if not self.cfg.bias_update_rate:
            return
        load = torch.zeros_like(self.routing_bias) if self._demand is None else self._demand.to(self.routing_bias)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(load)
        with torch.no_grad():
            self.routing_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        self._demand = None

    def _plan(self, counts, plans):
        plans.append(Plan(counts, self.ep))
        return plans[-1]

    def remote(self, rows, counts, ops, plan=None):
        """Rows [N, d] sorted by global expert -> their experts on other ranks -> back, same order. plan: the call's
        comm.Plan of counts, where made already (exchanged, maybe read); else made here."""
        El = self.ep.num_local_experts
        # The layer's one read of the device (host.py): what goes where, both ways, for every all-to-all of the call
        # and its backward; where routing read the kept counts (capacity) it was that same read (host.ahead).
        plan = (plan or Plan(counts, self.ep)).read()
        if self.ep.overlap_degree > 1:
            return pipelined_experts(rows, plan, self.experts, ops)
        out, back = plan.ways()
        x = send_rows(rows, out, back, self.ep)  # (source, local expert) order
        recv_h = host.sizes(plan.recv)
        order = block_transpose_index(plan.recv, total=sum(recv_h))  # -> (local expert, source) order
        rows_per_expert = host.known(plan.recv.sum(0), [sum(recv_h[e::El]) for e in range(El)])
        y = self.experts(x.index_select(0, order), rows_per_expert, ops)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (source, local expert) order
        return send_rows(y, back, out, self.ep)

    def _aux(self, logits, clean, r, T, k, cfg, sequences):
        # A zero loss that still belongs to the graph of every gate parameter (also for T = 0: the empty
        # logits); without a learned router a plain zero.
        zero = logits.sum() * 0.0 if logits is not None else r.probs.new_zeros(())
        scope = cfg.balance_loss_scope if r.top_experts is not None else "batch"
        shared_out = scope == "global" and self.training and _data_parallel()
        if T == 0 and not shared_out:  # nothing routed
            return MoEAux(zero, zero, r.demand, r.counts, 0, k, zero.detach())
        noisy = clean is not None and cfg.gate_noise == "gaussian" and cfg.gate_noise_scale
        if r.top_experts is None:
            balance = zero
        elif scope == "sequence":
            balance = sequence_balance_loss(r.probs, r.top_experts, *sequences())
        elif scope == "global":  # (in training, over every rank's tokens: a rank with none still meets the others)
            E = r.probs.shape[1]
            counted = torch.cat([count(r.top_experts.reshape(-1), E).double(),
                                 torch.full((1,), float(T), dtype=torch.float64, device=r.probs.device)])
            if self.ignored:
                counted = torch.zeros_like(counted)
            if shared_out:
                torch.distributed.all_reduce(counted)
            pooled = counted  # (training: with the counts of the update's earlier micro-batches)
            if self.training:
                self.last_global_counts = counted
                if self.global_prior is not None:
                    pooled = counted + self.global_prior.to(counted.device)
            balance = global_balance_share(r.probs, r.top_experts, pooled[:E], pooled[E], counted[E]) + zero
            if T == 0:
                return MoEAux(balance, zero, r.demand, r.counts, 0, k, zero.detach(), balance_share_of_global=True)
        else:
            balance = balance_loss(r.probs, r.top_experts)
        return MoEAux(
            balance_loss=balance,
            z_loss=zero if logits is None else router_z_loss(logits),
            demand=r.demand.detach(),
            counts=r.counts.detach(),
            num_tokens=T,
            top_k=k,
            entropy=gate_entropy(r.probs.detach()),
            dropped=r.dropped,
            shazeer=None if r.top_experts is None else ShazeerInputs(
                r.probs, r.top_experts, *((clean, logits.float(), k, cfg.gate_noise_scale) if noisy else ())),
            balance_share_of_global=shared_out,
        )


def _data_parallel():
    """Several processes train together (the global balance loss all-reduces its counts over all of them)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def _sequences(shape, time_major, keep, device):
    """(each routed token's sequence [T] long, the number of sequences) for x of `shape` [..., d]: [T, d] is one
    sequence, [T, B, d] time_major B, otherwise [..., T, d] one per row of T; keep: the positions routed (or None)."""
    positions = shape[:-1].numel()
    flat = torch.arange(positions, device=device) if keep is None else keep
    if len(shape) == 2:
        return torch.zeros_like(flat), 1
    if time_major:
        if len(shape) != 3:
            raise ValueError(f"time_major x must be [T, B, d], got {tuple(shape)}")
        return flat % shape[1], shape[1]
    return flat // shape[-2], positions // shape[-2]


def _zero_rows(grad, rows):
    """A gradient with its first `rows` rows zeroed (--moe-frozen-experts)."""
    grad = grad.clone()
    grad[:rows] = 0
    return grad


def _kept_positions(padding_mask):
    """The flat positions that are not padding [T]: a read of the device (nonzero), made once per mask tensor and kept
    on it with the mask's version (the layers of one encoder or decoder get the same mask: one read per forward, not
    per layer; a mask changed in place since is read again). What is kept holds no reference to the mask."""
    version, keep = getattr(padding_mask, "_moe_keep", (None, None))
    if version != padding_mask._version:
        keep = (~padding_mask.reshape(-1).bool()).nonzero().squeeze(1)
        padding_mask._moe_keep = (padding_mask._version, keep)
    return keep


def _bias_as_configured(module, state_dict, prefix, *args):
    """The balancing bias follows the layer's --moe-bias-update-rate, not the checkpoint's: a checkpoint
    trained without it loads into a layer that has one with a zero bias; one trained with it loads into a
    layer without one by leaving its bias out (the routing then follows the scores alone)."""
    bias = getattr(module, "routing_bias", None)
    if bias is not None and prefix + "routing_bias" not in state_dict:
        state_dict[prefix + "routing_bias"] = torch.zeros_like(bias)
    elif bias is None:
        state_dict.pop(prefix + "routing_bias", None)
