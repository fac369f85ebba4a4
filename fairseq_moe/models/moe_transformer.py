"""The `moe_transformer` model: fairseq's transformer with MoE blocks in every N-th layer.

Flags follow fairseq's moe branch where it has them. Layer i (0-based) of a side is MoE when
freq > 0 and (i + 1) % freq == 0, freq being --encoder-moe-freq / --decoder-moe-freq or else
--moe-freq (the moe branch's rule).
"""
import argparse
import dataclasses
import logging
import os
from argparse import Namespace

import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint_utils
from torch import nn

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase, TransformerModel
from fairseq.models.transformer import transformer_legacy as dense
from fairseq.modules import LayerDropModuleList
from omegaconf import OmegaConf

from fairseq_moe_kernels import backend as kernel_backend

from .. import refusals
from ..checkpoints.fits import expert_counts
from ..errors import FlagError
from fairseq_moe_layer import MoEConfig
from fairseq_moe_layer.options import describe, dest_of, flag_of, full_help, settings
from fairseq_moe_layer.comm import check_overlap_degree, expert_parallel, expert_parallel_size
from fairseq_moe_layer.lockstep import Lockstep
from .moe_ffn import MoEDecoderLayer, MoEEncoderLayer, moe_blocks, token_ids

logger = logging.getLogger(__name__)
D = MoEConfig  # its field defaults are the defaults of the layer's flags

# The layer's flags (argparse dest -> MoEConfig field), from its settings: their defaults are MoEConfig's (D).
# Not among them (cli=False): the sizes, fairseq's activation flags, and --moe-top-k / --moe-expert-ffn-dim,
# which are the model's own (below).
LAYER_FLAGS = {dest_of(f): f.name for f in settings(MoEConfig) if f.metadata["cli"]}
# The model's own flags (where the MoE layers go, how their experts talk) and their defaults.
# --moe-top-k None: MoEConfig's top_k, unless --moe-top1-expert (the two are checked against each other);
# --moe-expert-ffn-dim None: the side's ffn dim.
MODEL_DEFAULTS = dict(moe_top_k=None, moe_top1_expert=False, moe_expert_ffn_dim=None, moe_freq=2,
                      encoder_moe_freq=0, decoder_moe_freq=0, use_moe_pad_mask=False, moe_a2a_local_size=None,
                      moe_a2a_overlap_degree=1, moe_keep_freed_memory=False)


def add_moe_args(parser, encoder=True):
    """The MoE flags of the model (fairseq suppresses unset ones; defaults live in the archs).
    encoder=False: a decoder-only model (no --encoder-moe-freq)."""
    add = parser.add_argument
    add("--moe-freq", type=int, metavar="N",
        help="make every N-th layer MoE" + (" on both sides (0: none unless a side's own freq is set)"
                                           if encoder else " (0: none unless --decoder-moe-freq is set)")
        + f" (default {MODEL_DEFAULTS['moe_freq']})")
    # As in fairseq's moe branch, a side's 0 means "as --moe-freq": a dense encoder is
    # --moe-freq 0 --decoder-moe-freq N.
    if encoder:
        add("--encoder-moe-freq", type=int, metavar="N",
            help="every N-th encoder layer is MoE (0, the default: as --moe-freq)")
    add("--decoder-moe-freq", type=int, metavar="N",
        help="every N-th decoder layer is MoE (0, the default: as --moe-freq)")
    add("--moe-expert-ffn-dim", type=int, metavar="F",
        help="hidden size of each expert (default: --encoder/decoder-ffn-embed-dim of the side)")
    add("--moe-top-k", type=int, metavar="K", help=f"experts per token: 1 is Switch, 2 is GShard (default {D.top_k})")
    add("--moe-top1-expert", action="store_true", help="alias of --moe-top-k 1 (fairseq's moe branch)")
    add("--use-moe-pad-mask", action="store_true",
        help="keep padding tokens out of routing, capacity and the balance loss")
    add("--moe-a2a-local-size", type=int, metavar="L",
        help="ranks per node for the hierarchical all-to-all (default: the launcher's LOCAL_WORLD_SIZE; "
             "1 or all ranks: flat all-to-all)")
    add("--moe-a2a-overlap-degree", type=int, metavar="D",
        help="with the experts spread over ranks: cut the rows into D chunks whose all-to-alls "
             "overlap expert compute (flat all-to-all only; default 1: no overlap)")
    add("--moe-keep-freed-memory", action="store_true",
        help="training: glibc's malloc keeps freed memory for reuse in this process (no block mapped apart, the "
             "heap not trimmed): on the CPU at many experts a step's fresh gradient buffers then cost far fewer page "
             "faults; resident memory does not shrink after a peak (set when the Trainer is built; never in "
             "generate or eval)")
    add_layer_args(parser)


def add_layer_args(parser):
    """One flag per setting of MoEConfig that the user sets as it is (its metadata: options.setting)."""
    for f in settings(MoEConfig):
        m = f.metadata
        if not m["cli"]:
            continue
        if m["type"] is bool:
            parser.add_argument(flag_of(f), action="store_true",
                                help=full_help(f) + (" (the default)" if f.default else ""))
            if m["negative"]:
                parser.add_argument(m["negative"], dest=dest_of(f), action="store_false",
                                    help=f"the opposite of {flag_of(f)}")
            continue
        choices = None if m["choices"] is None else sorted(m["choices"])
        kind = expert_count_flag if f.name in PER_LAYER else m["type"]
        parser.add_argument(flag_of(f), type=kind, choices=choices, metavar=None if choices else m["metavar"],
                            help=f"{full_help(f)} (default {describe(f)})")


PER_LAYER = {"num_experts": "moe_expert_count", "frozen_experts": "moe_frozen_experts"}  # (MoEConfig field: dest)


def expert_count_flag(text):
    """--moe-expert-count's (and --moe-frozen-experts') value: one count (an int) or one per MoE layer (the list as
    the canonical string "4,8,4,8": a string keeps the saved config plain data)."""
    try:
        counts = expert_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return counts[0] if len(counts) == 1 else ",".join(map(str, counts))


def layer_expert_counts(args, sides=("encoder", "decoder"), dest="moe_expert_count"):
    """{side: [E of each MoE layer]} from --moe-expert-count (one count for every MoE layer, or one per MoE layer:
    encoder layers first), args carrying the layer ids (moe_{side}_layer_ids); dest: another flag of that form."""
    value = getattr(args, dest)
    flag = "--" + dest.replace("_", "-")
    ids = {side: list(getattr(args, f"moe_{side}_layer_ids", []) or []) for side in sides}
    total = sum(map(len, ids.values()))
    try:
        counts = all_counts = expert_counts(value)
    except ValueError as e:
        raise FlagError(f"{flag} {e}") from None
    if len(counts) == 1:
        counts = counts * total
    before = {side: moe_layer_ids(args, side, kept=False) for side in sides}
    if len(counts) != total and len(counts) == sum(map(len, before.values())):
        # One per MoE layer of the model as trained, some dropped by --{side}-layers-to-keep: the counts of the kept.
        counts, start = [], 0
        for side in sides:
            keep = getattr(args, f"{side}_layers_to_keep", None)
            left = set(int(i) for i in keep.split(",")) if keep else None
            counts += [c for i, c in zip(before[side], all_counts[start:]) if left is None or i in left]
            start += len(before[side])
    if len(counts) != total:
        where = ", ".join(f"{side} {layers}" for side, layers in ids.items() if layers)
        raise FlagError(f"{flag} {value} gives {len(counts)} counts for {total} MoE layers ({where}): "
                        f"give one count, or one per MoE layer, encoder layers first")
    out, start = {}, 0
    for side, layers in ids.items():
        out[side], start = counts[start:start + len(layers)], start + len(layers)
    return out


def moe_config(args, side, num_experts=None, frozen_experts=None):
    """The MoEConfig of one side ('encoder' or 'decoder') from the parsed flags; num_experts, frozen_experts: that MoE
    layer's (layer_expert_counts), where --moe-expert-count, --moe-frozen-experts give one per layer."""
    top_k = args.moe_top_k
    if args.moe_top1_expert:
        if top_k not in (None, 1):
            raise FlagError(f"--moe-top1-expert conflicts with --moe-top-k {top_k}")
        top_k = 1
    if args.moe_expert_ffn_dim is not None and args.moe_expert_ffn_dim < 1:
        raise FlagError(f"--moe-expert-ffn-dim must be >= 1 (leave it out for the side's "
                        f"--{side}-ffn-embed-dim), got {args.moe_expert_ffn_dim}")
    cfg = MoEConfig(
        model_dim=getattr(args, f"{side}_embed_dim"),
        ffn_dim=args.moe_expert_ffn_dim or getattr(args, f"{side}_ffn_embed_dim"),
        top_k=D.top_k if top_k is None else top_k,
        activation=getattr(args, "activation_fn", "relu"),
        activation_dropout=getattr(args, "activation_dropout", 0.0) or getattr(args, "relu_dropout", 0.0),
        **{name: getattr(args, flag) for flag, name in LAYER_FLAGS.items() if name not in PER_LAYER},
        num_experts=args.moe_expert_count if num_experts is None else num_experts,
        frozen_experts=(getattr(args, "moe_frozen_experts", 0) or 0) if frozen_experts is None else frozen_experts)
    if cfg.capacity_counts_padding and not getattr(args, "use_moe_pad_mask", False):
        raise FlagError("--moe-capacity-counts-padding needs --use-moe-pad-mask (without it the padding is routed "
                        "like a token, and counted as one already)")
    if cfg.cmr and cfg.shared_experts == 0:  # (NLLB's --moe-cmr brings its dense FFN: the one shared expert)
        cfg = dataclasses.replace(cfg, shared_experts=1)
    try:
        return cfg.validate()
    except ValueError as e:  # the layer's own check names the flag; to the CLI it is a flag error
        raise FlagError(str(e)) from None


def moe_layer_ids(args, side, kept=True):
    """Indices of the MoE layers of a side (kept=False: before --{side}-layers-to-keep drops and renumbers them)."""
    freq = getattr(args, f"{side}_moe_freq") or args.moe_freq
    if freq is None or freq < 0:
        raise FlagError(f"--{side}-moe-freq / --moe-freq must be >= 0, got {freq}")
    layers = getattr(args, f"{side}_layers")
    ids = [i for i in range(layers) if freq and (i + 1) % freq == 0]
    keep = getattr(args, f"{side}_layers_to_keep", None)
    if keep and kept:  # fairseq builds only these layers (LayerDrop pruning), renumbered 0, 1, ...
        ids = [new for new, old in enumerate(sorted(int(i) for i in keep.split(","))) if old in ids]
    return ids


def build_expert_parallel(args):
    """Spread the experts over the ranks when there are several: {E: ExpertParallel} for each expert count of the
    model's MoE layers (args.moe_layer_experts), made in the same order on every rank; layers of counts with the same
    expert-parallel size share its process groups, and all share one Lockstep (inference: the ranks meet before every
    MoE layer's all-to-alls, whichever its groups). None on one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    local = args.moe_a2a_local_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    counts = sorted({E for layers in args.moe_layer_experts.values() for E in layers})
    sizes = {}
    for E in counts:
        try:
            sizes[E] = expert_parallel_size(E, dist.get_world_size())
        except ValueError as e:  # names the flags (expert count, world size)
            layers = [f"{side} layer {i}" for side, ids in (("encoder", args.moe_encoder_layer_ids),
                                                            ("decoder", args.moe_decoder_layer_ids))
                      for i, n in zip(ids, args.moe_layer_experts.get(side, [])) if n == E]
            raise FlagError(str(e) + (f" ({', '.join(layers)})" if len(counts) > 1 else "")) from None
    # Layers of several expert-parallel sizes: one Lockstep for all, over every rank (each EP group is a part of them).
    shared = Lockstep(None) if len(set(sizes.values())) > 1 else None
    out, by_size = {}, {}
    for E in counts:
        P = sizes[E]
        try:
            ep = dataclasses.replace(by_size[P], num_local_experts=E // P) if P in by_size else expert_parallel(
                E, local_size=local, overlap_degree=args.moe_a2a_overlap_degree, lockstep=shared)
        except ValueError as e:  # names the flags (all-to-all layout)
            raise FlagError(str(e)) from None
        by_size.setdefault(P, ep)
        out[E] = ep
        logger.info("expert parallel: %d experts per rank on %d ranks, %d replica(s), %s all-to-all%s",
                    ep.num_local_experts, ep.size, ep.replicas,
                    f"hierarchical {ep.size // ep.local_size}x{ep.local_size}" if ep.local_size > 1 else "flat",
                    f" (the layers of {E} experts)" if len(counts) > 1 else "")
    return out


def _wrap(layer, cfg):
    """--checkpoint-activations for an MoE layer: torch's non-reentrant checkpoint, not fairseq's
    checkpoint_wrapper. fairseq's runs the forward under no_grad, so the router losses that the layer
    leaves for the criterion (last_aux) would carry no gradient and never train the gate. Here they
    stay in the graph; the backward recomputes the layer (same dropout masks) when it first needs it,
    and recomputes it whole (no early stop), so every rank issues the same all-to-alls again."""
    if not cfg.checkpoint_activations:
        return layer
    forward = layer.forward

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with checkpoint_utils.set_checkpoint_early_stop(False):
            return checkpoint_utils.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
    return layer


class UpdateLayerDrop(LayerDropModuleList):
    """fairseq's LayerDrop list, with the layers to skip drawn from (--seed, update, side) rather than from the
    global RNG: the same on every rank and for every micro-batch of one update. An MoE layer is an all-to-all of
    every rank, so one skipped on a rank must be skipped on all; and W ranks then skip what one process with
    --update-freq W skips (at_update sets the update; finish_moe puts this class in place of fairseq's)."""

    seed, side, update = 1, 0, None  # update None (a task that does not say it): fairseq's own draw

    def __iter__(self):
        if self.update is None:
            keep = torch.empty(len(self)).uniform_() > self.p
        else:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.update) * 2 + self.side)
            keep = torch.rand(len(self), generator=g) > self.p  # [layers]
        for i, layer in enumerate(nn.ModuleList.__iter__(self)):
            if not self.training or keep[i]:
                yield layer


def at_update(model, update_num):
    """Tell the model's LayerDrop lists the update they draw for (the MoE tasks' train_step, every micro-batch)."""
    for m in model.modules():
        if isinstance(m, UpdateLayerDrop):
            m.update = update_num


class MoETransformerEncoder(TransformerEncoderBase):
    def forward(self, src_tokens, *args, **kwargs):
        with token_ids(self, src_tokens):  # (hash routing: the source token at each position)
            return super().forward(src_tokens, *args, **kwargs)

    def build_encoder_layer(self, cfg):
        # fairseq builds the layers in order without passing the index: count them here.
        index = self._built = getattr(self, "_built", -1) + 1
        if index not in cfg.moe_encoder_layer_ids:
            return super().build_encoder_layer(cfg)
        moe, ep = layer_settings(cfg, "encoder", index)
        return _wrap(MoEEncoderLayer(cfg, moe, ep, cfg.use_moe_pad_mask, return_fc=self.return_fc), cfg)


class MoETransformerDecoder(TransformerDecoderBase):
    def extract_features_scriptable(self, prev_output_tokens, encoder_out=None, incremental_state=None, *args,
                                    **kwargs):
        # Hash routing: the previous output token at each position; one step decodes the last one only.
        ids = prev_output_tokens[:, -1:] if incremental_state is not None else prev_output_tokens
        with token_ids(self, ids):
            return super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state, *args,
                                                       **kwargs)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index = self._built = getattr(self, "_built", -1) + 1
        if index not in cfg.moe_decoder_layer_ids:
            return super().build_decoder_layer(cfg, no_encoder_attn)
        moe, ep = layer_settings(cfg, "decoder", index)
        return _wrap(MoEDecoderLayer(cfg, moe, ep, cfg.use_moe_pad_mask, no_encoder_attn=no_encoder_attn), cfg)


def layer_settings(cfg, side, index):
    """(MoEConfig, ExpertParallel or None) of MoE layer `index` of a side: its own expert count."""
    i = list(cfg.moe_encoder_layer_ids if side == "encoder" else cfg.moe_decoder_layer_ids).index(index)
    E = cfg.moe_layer_experts[side][i]
    return moe_config(cfg, side, E, cfg.moe_layer_frozen[side][i]), None if cfg.moe_ep is None else cfg.moe_ep[E]


def prepare_moe_build(args, sides):
    """A checked copy of args for building a model whose `sides` ('encoder', 'decoder') have MoE layers:
    MoE defaults applied, layer ids derived, and the expert-parallel process groups created (a collective:
    with several ranks, every rank builds the model at the same point). Every bad flag fails here, named,
    before a single weight is built."""
    # A copy: fairseq saves the caller's object in checkpoints, where layer ids and process groups must not
    # go. fairseq-hydra-train passes a DictConfig, whose extra keys TransformerConfig.from_namespace drops.
    args = Namespace(**(vars(args) if isinstance(args, Namespace)
                        else OmegaConf.to_container(args, resolve=True)))
    moe_base_architecture(args)
    for side in ("encoder", "decoder"):
        setattr(args, f"moe_{side}_layer_ids", moe_layer_ids(args, side) if side in sides else [])
    if not args.moe_encoder_layer_ids and not args.moe_decoder_layer_ids:
        freqs = ", ".join(f"--{side}-moe-freq {getattr(args, f'{side}_moe_freq')}" for side in sides)
        layers = " / ".join(f"{getattr(args, f'{side}_layers')} {side}" for side in sides)
        keep = "".join(f" (of which --{side}-layers-to-keep {getattr(args, f'{side}_layers_to_keep')})"
                       for side in sides if getattr(args, f"{side}_layers_to_keep", None))
        raise FlagError(f"--moe-freq {args.moe_freq} ({freqs}) puts no MoE layer in {layers} layers{keep}")
    try:  # (checked on one process too, where no expert_parallel is built)
        check_overlap_degree(args.moe_a2a_overlap_degree)
    except ValueError as e:
        raise FlagError(str(e)) from None
    args.moe_layer_experts = layer_expert_counts(args, sides)
    args.moe_layer_frozen = layer_expert_counts(args, sides, "moe_frozen_experts")
    configs = [moe_config(args, side, E, N) for side in sides
               for E, N in zip(args.moe_layer_experts[side], args.moe_layer_frozen[side])]
    frac, k, fewest = args.moe_eval_capacity_token_fraction, configs[0].top_k, min(c.num_experts for c in configs)
    if 0 < frac < k / fewest:
        logger.warning("--moe-eval-capacity-token-fraction %s is below k / E = %d / %d: every expert can take fewer "
                       "tokens than its fair share at validation and generation, so tokens will be dropped even "
                       "with a perfectly balanced router (use -1 for the training capacity)", frac, k, fewest)
    # Where the model will run: a triton backend that cannot run there fails now, named. (Under
    # fairseq-hydra-train the model's config has no --cpu: then a backend that cannot run fails at
    # the first forward, before any update.)
    on_gpu = torch.cuda.is_available() and not getattr(args, "cpu", False)
    dtype = (torch.float16 if getattr(args, "fp16", False) else torch.bfloat16 if getattr(args, "bf16", False)
             else torch.float32)  # (the experts' dtype in training)
    try:
        kernel_backend.resolve(args.moe_kernel_backend, "cuda" if on_gpu else "cpu", dtype)
    except ValueError as e:  # names the flag and why
        raise FlagError(str(e)) from None
    args.moe_ep = build_expert_parallel(args)
    refusals.check("build", refusals.Context(flags=args, spread=args.moe_ep is not None))
    return args


class MoEModelMixin:
    """What every MoE model adds to its fairseq model class (put it first among the bases)."""

    def finish_moe(self, args):
        for side, name in enumerate(("encoder", "decoder")):
            layers = getattr(getattr(self, name, None), "layers", None)
            if isinstance(layers, LayerDropModuleList):
                layers.__class__, layers.seed, layers.side = UpdateLayerDrop, getattr(args, "seed", 1) or 1, side
        # torch DDP (--ddp-backend pytorch_ddp) must not average the experts either.
        self._ddp_params_and_buffers_to_ignore = [n for n, p in self.named_parameters() if getattr(p, "expert", 0)]
        side = "encoder" if args.moe_encoder_layer_ids else "decoder"
        k = moe_config(args, side, args.moe_layer_experts[side][0], args.moe_layer_frozen[side][0]).top_k
        logger.info("MoE layers: encoder %s, decoder %s; %s experts, %s routing, k=%d", args.moe_encoder_layer_ids,
                    args.moe_decoder_layer_ids, args.moe_expert_count, args.moe_routing, k)
        return self

    def forward(self, *args, **kwargs):
        # Forget the previous batch's aux so that a layer skipped now (layerdrop) is not counted.
        for _, block in moe_blocks(self):
            block.last_aux = None
        return super().forward(*args, **kwargs)


@register_model("moe_transformer")
class MoETransformerModel(MoEModelMixin, TransformerModel):
    """Transformer whose FFN is a Mixture of Experts in every N-th encoder/decoder layer."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_moe_args(parser)

    @classmethod
    def build_model(cls, args, task):
        args = prepare_moe_build(args, ("encoder", "decoder"))
        return super().build_model(args, task).finish_moe(args)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return MoETransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return MoETransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def moe_base_architecture(args):
    for flag, name in LAYER_FLAGS.items():
        setattr(args, flag, getattr(args, flag, getattr(D, name)))
    for flag, value in MODEL_DEFAULTS.items():
        setattr(args, flag, getattr(args, flag, value))


def moe_arch(model, name, dense_arch, **defaults):
    """Register arch `name` of `model`: the dense arch's settings, then `defaults`, then the MoE ones.

    What args already state (the flags typed: fairseq suppresses the others; or a saved config) wins over
    what a dense arch forces: base_lm_architecture sets decoder_normalize_before = True whatever it was, so
    an upcycled post-norm transformer_lm would otherwise load as another model."""
    def arch(args):
        # (a Namespace from the command line or a checkpoint; hydra's DictConfig is left to the archs)
        stated = {k: v for k, v in vars(args).items() if v is not None} if isinstance(args, Namespace) else {}
        for key, value in defaults.items():
            setattr(args, key, getattr(args, key, value))
        dense_arch(args)
        for key, value in stated.items():
            setattr(args, key, value)
        moe_base_architecture(args)
    return register_model_architecture(model, name)(arch)


moe_transformer = moe_arch("moe_transformer", "moe_transformer", dense.base_architecture)
# For CPU runs: 3+3 layers, d=128, ffn 512, 4 heads; layer 2 of each side is MoE. Dropless at eval:
# with a capacity there, a sentence's output depends on the rest of its batch (and with few experts
# fairseq's 0.25 would drop tokens by construction: k / E >= 0.25).
TINY = dict(moe_expert_count=4, moe_eval_capacity_token_fraction=0.0)
moe_transformer_tiny = moe_arch("moe_transformer", "moe_transformer_tiny", dense.base_architecture, **TINY, **{
    f"{side}_{key}": value for side in ("encoder", "decoder") for key, value in
    (("embed_dim", 128), ("ffn_embed_dim", 512), ("layers", 3), ("attention_heads", 4))})
moe_transformer_iwslt_de_en = moe_arch("moe_transformer", "moe_transformer_iwslt_de_en", dense.transformer_iwslt_de_en)
moe_transformer_wmt_en_de = moe_arch("moe_transformer", "moe_transformer_wmt_en_de", dense.transformer_wmt_en_de)
moe_transformer_vaswani_wmt_en_de_big = moe_arch("moe_transformer", "moe_transformer_vaswani_wmt_en_de_big",
                                                 dense.transformer_vaswani_wmt_en_de_big)
