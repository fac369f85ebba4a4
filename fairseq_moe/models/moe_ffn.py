"""The bridge between fairseq's transformer layers and MoELayer.

fairseq's layers compute their FFN as fc2(activation_dropout(activation_fn(fc1(x)))). An MoE layer
overrides one hook, build_fc1, to return MoEFeedForward (which does the whole FFN: gate, experts with
their activation and activation dropout) and makes the other three steps identities. The layer's
forward, residual and layer norms stay fairseq's own, so they cannot drift from it.
"""
import contextlib
import copy

import torch
from torch import nn

from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq_moe_layer import ROUTINGS, MoEConfig, MoELayer


class MoEFeedForward(nn.Module):
    """MoELayer for fairseq's time-major activations: x [T, B, C] -> [T, B, C].

    Keeps the aux of its latest forward in `last_aux` for the criterion and the task to read:
    fairseq's encoder and decoder have no channel to return per-layer losses through.
    """

    def __init__(self, cfg: MoEConfig, ep=None):
        super().__init__()
        self.moe = MoELayer(cfg, ep)
        self.padding_mask = None  # [B, T] bool, set by the owning layer for one forward
        self.token_ids = None  # [B, T] long, set by the encoder/decoder for one forward (routing by token id)
        self.last_aux = None
        # The expert statistics by language pair (tasks/expert_stats.py): each sentence's pair [B] (-1: unknown) and
        # the number of pairs, set by the task for a training step; the latest forward's demand per pair [L, E].
        self.sentence_labels, self.label_count, self.last_label_demand = None, 0, None

    def __deepcopy__(self, memo):
        """A copy (fairseq's --store-ema) without the latest forward's losses: they are not graph leaves, which
        torch cannot copy (and the copy has run no forward)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = None if key == "last_aux" else copy.deepcopy(value, memo)
        return new

    def forward(self, x):
        mask = self.padding_mask
        if mask is not None and mask.shape != (x.shape[1], x.shape[0]):
            mask = None  # not x's tokens (incremental decoding passes the step's own [B, 1] mask)
        batch_major = self.moe.policy.slots or self.moe.cfg.token_priority == "sentence"
        if batch_major:
            # Batch-major tokens [B, T, C]: slots mix the tokens of one sentence; the layer queues the tokens for
            # capacity in the order it is given them (--moe-token-priority sentence)
            y, self.last_aux = self.moe(x.transpose(0, 1), mask, token_ids=self.token_ids)
            y = y.transpose(0, 1)
        else:
            ids = None if self.token_ids is None else self.token_ids.t()
            y, self.last_aux = self.moe(x, None if mask is None else _transposed(mask), token_ids=ids,
                                     time_major=True)
        self.last_label_demand = self._demand_by_label(x.shape[0], batch_major, mask)
        return y

    def _demand_by_label(self, T, batch_major, mask):
        """[L, E] assignments asked for (before capacity, as MoEAux.demand) by the sentences of each label, or None
        (no labels, or a policy without per-token choices)."""
        labels, aux = self.sentence_labels, self.last_aux
        if labels is None or aux is None or aux.shazeer is None or labels.shape[0] * T == 0:
            return None
        B = labels.shape[0]
        per_token = labels[:, None].expand(B, T) if batch_major else labels[None, :].expand(T, B)
        if mask is not None:  # (the routed tokens: padding left out)
            per_token = per_token[~(mask if batch_major else mask.t()).bool()]
        top = aux.shazeer.top_experts  # [tokens, k]
        if top.shape[0] != per_token.numel() or int(aux.demand.sum()) != top.numel():
            return None  # (not these tokens; or a policy that thins the choices, --moe-second-expert-policy random)
        L, E = self.label_count, self.moe.cfg.num_experts
        rows = per_token.reshape(-1, 1).expand_as(top).reshape(-1)
        known = rows >= 0
        out = torch.zeros(L * E, dtype=torch.float64, device=top.device)
        out.index_add_(0, (rows[known] * E + top.reshape(-1)[known]).long(),
                       torch.ones(int(known.sum()), dtype=torch.float64, device=top.device))
        return out.view(L, E)


class _MoEBlock:
    """What both MoE layers add to fairseq's: the FFN is the MoE block (build_fc1 returns it; fairseq's
    activation, activation dropout and fc2 become identities), and the padding mask reaches it for one
    forward when --use-moe-pad-mask."""

    def __init__(self, cfg, moe_cfg: MoEConfig, ep=None, use_pad_mask=False, **kwargs):
        # Policies that mix tokens always keep padding out: it would change the output of the real tokens
        # with the amount of padding in the batch.
        mixes = ROUTINGS[moe_cfg.routing].mixes_tokens
        self.moe_cfg, self.ep, self.use_pad_mask = moe_cfg, ep, use_pad_mask or mixes
        super().__init__(cfg, **kwargs)
        self.activation_fn = _identity
        self.activation_dropout_module = nn.Identity()
        self.fc2 = nn.Identity()

    def build_fc1(self, input_dim, output_dim, q_noise, qn_block_size):
        return MoEFeedForward(self.moe_cfg, self.ep)

    @contextlib.contextmanager
    def _padding(self, mask):
        self.fc1.padding_mask = mask if self.use_pad_mask else None
        try:
            yield
        finally:
            self.fc1.padding_mask = None


def _transposed(mask):
    """mask.t() as one tensor per mask, kept on it with the mask's version: the MoE layers of an encoder or decoder then
    share it, and the positions the layer keeps of it (MoELayer: read once per mask). A copy, not a view: a view kept
    on its own base would hold it forever (a reference cycle through the tensor that Python's collector cannot see)."""
    version, copy = getattr(mask, "_moe_t", (None, None))
    if version != mask._version:
        copy = mask.t().clone()
        mask._moe_t = (mask._version, copy)
    return copy


def _identity(x):
    return x


class MoEEncoderLayer(_MoEBlock, TransformerEncoderLayerBase):
    def forward(self, x, encoder_padding_mask, attn_mask=None):
        with self._padding(encoder_padding_mask):
            return super().forward(x, encoder_padding_mask, attn_mask)


class MoEDecoderLayer(_MoEBlock, TransformerDecoderLayerBase):
    def forward(self, x, *args, self_attn_padding_mask=None, **kwargs):
        with self._padding(self_attn_padding_mask):
            return super().forward(x, *args, self_attn_padding_mask=self_attn_padding_mask, **kwargs)


def moe_blocks(model):
    """(name, MoEFeedForward) for every MoE block of a model, DDP wrappers' prefixes removed."""
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            while name.startswith("module."):
                name = name[len("module."):]
            blocks.append((name, module))
    return blocks


@contextlib.contextmanager
def token_ids(module, ids):
    """ids [B, T] for the MoE blocks of module that route by token id (Policy.needs_token_ids), for one forward. The blocks
    are found once per module (its layers do not change after the build), not at every forward."""
    blocks = module.__dict__.get("_hash_routed_blocks")
    if blocks is None:  # (a plain attribute, not a registered submodule list)
        blocks = module.__dict__["_hash_routed_blocks"] = [
            block for _, block in moe_blocks(module) if block.moe.policy.needs_token_ids]
    for block in blocks:
        block.token_ids = ids
    try:
        yield
    finally:
        for block in blocks:
            block.token_ids = None
