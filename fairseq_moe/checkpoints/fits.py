"""Does a checkpoint fit the model it is loaded into? Checked before fairseq loads it (which would stop at a
size mismatch or a missing key deep in load_state_dict, once per rank), so that the error names the cause:
the task, the dictionary, the embedding width, the MoE layers and experts, the flags the saved weights need.
No fairseq import, nor of the models: the flags' names come from the layer's settings (options.py)."""
import argparse
import logging

from . import sets as shards
from ..errors import CheckpointError
from fairseq_moe_layer.config import MoEConfig
from fairseq_moe_layer.experts import EXPERT_KINDS
from fairseq_moe_layer.options import dest_of, flag_of, settings

logger = logging.getLogger(__name__)


def expert_counts(value):
    """--moe-expert-count's value (one count: an int or "8"; one per MoE layer: "4,8,4,8" or a list) -> [int];
    ValueError where it is neither."""
    items = value if isinstance(value, (list, tuple)) else str(value).strip().strip("[]").split(",")
    try:
        counts = [int(str(c).strip()) for c in items]
    except ValueError:
        raise ValueError(f"{value!r} is not a count nor a comma-separated list of counts") from None
    if not counts:
        raise ValueError(f"{value!r} is not a count nor a comma-separated list of counts")
    return counts


def expert_count_flag(experts):
    """--moe-expert-count's value for {expert parameter name: E} (in the model's order): one count, or one per MoE
    layer (encoder layers first) where they differ."""
    per_layer = list(dict.fromkeys((name.rsplit(".", 2)[0], E) for name, E in experts.items()))
    counts = [E for _, E in per_layer]
    return str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))


def check_expert_layout(saved, model, path):
    """saved, model: {expert parameter name: E}. A checkpoint of other MoE layers or expert counts is
    refused here, with the flags to change, before any rank cuts out its experts."""
    if not saved or not model or saved == model:
        return
    for name in sorted(set(saved) & set(model)):
        if saved[name] != model[name]:
            raise CheckpointError(f"{path} was saved with {saved[name]} experts in {name.rsplit('.', 2)[0]}; this "
                                  f"model has {model[name]} (--moe-expert-count {expert_count_flag(model)}). Resume "
                                  f"with --moe-expert-count {expert_count_flag(saved)}, or train into another "
                                  f"--save-dir")
    layers, mine = (sorted({n.rsplit(".", 2)[0] for n in names}) for names in (saved, model))
    if layers == mine:  # the same layers and counts, other expert tensors: another kind of expert
        was, now = (_expert_kind({n.rsplit(".", 1)[1] for n in names}) for names in (saved, model))
        raise CheckpointError(f"{path} was saved with --moe-expert-kind {was}; this model has --moe-expert-kind "
                              f"{now}. Resume with --moe-expert-kind {was}, or train into another --save-dir")
    raise CheckpointError(f"{path} has MoE layers {layers}; this model has {mine} (--moe-freq, "
                          f"--encoder/decoder-moe-freq and the layer counts must match the saved run's)")



def _expert_kind(tensors):
    """The expert kind (EXPERT_KINDS) whose experts hold these tensors (w1, w2, and b1, b2 where it has biases)."""
    kinds = [k for k, cls in EXPERT_KINDS.items() if tensors == {"w1", "w2"} | ({"b1", "b2"} if cls.biases else set())]
    return kinds[0] if kinds else "of tensors " + ", ".join(sorted(tensors))


def check_fits(state, model_keys, reset_optimizer, path, experts=None, model_cfg=None, log=False):
    """Before fairseq loads a state into the trainer: refuse, naming the cause, a checkpoint of another task,
    dictionary or embedding width, MoE weights of other flags (fairseq would stop at a size mismatch or a
    missing key deep in load_state_dict, once per rank), an upcycled or converted one resumed as if it had an
    optimizer state, and one whose cosine gates predate the learned temperature resumed with its optimizer
    state (the load hook adds parameters the saved Adam state has no entry for). Routing flags changed since
    the save are said in one log line (log: this rank logs): the weights load, the routing follows the flags.
    model_keys: {state-dict name: shape} of the model it loads into; experts: its {expert parameter: E}
    (the model holds its own slice of them); model_cfg: this run's model config, to name changed flags."""
    model = state.get("model", {})
    embed = lambda keys: {n: tuple(keys[n]) for n in keys if n.endswith("embed_tokens.weight")}  # noqa: E731
    saved, mine = embed({n: t.shape for n, t in model.items()}), embed(model_keys)
    if saved and mine:  # (both with token embeddings: not adaptive input, not a wrapper's flattened names)
        encoder = lambda names: any(n.startswith("encoder.") for n in names)  # noqa: E731
        if encoder(saved) != encoder(mine):
            kinds = {True: "a translation model (encoder + decoder)", False: "a language model (decoder only)"}
            raise CheckpointError(f"{path} holds {kinds[encoder(saved)]}; this task trains {kinds[encoder(mine)]}")
        for name in sorted(set(saved) & set(mine)):
            side = name.split(".", 1)[0]
            if saved[name][0] != mine[name][0]:
                raise CheckpointError(f"{path}: its {side} dictionary has {saved[name][0]} symbols, this task's has "
                                      f"{mine[name][0]}: train with the data (and dict.*.txt) the checkpoint was "
                                      f"trained on")
            if saved[name][1:] != mine[name][1:]:
                raise CheckpointError(f"{path}: its {side} embeddings are {saved[name][1]} wide, this model's "
                                      f"{mine[name][1]} (--{side}-embed-dim {saved[name][1]} as saved)")
    made_by = (state.get("extra_state") or {}).get(shards.MADE_BY)  # (a tool's file, no optimizer state)
    if made_by and not reset_optimizer:
        raise CheckpointError(f"{path} was {made_by.get('what', 'written by a tool')} and has no optimizer state: "
                              f"train from it with --finetune-from-model {path}")
    changes = flag_changes(_section(state.get("cfg"), "model"), model_cfg)
    structural = {f: v for f, v in changes.items() if f[2:].replace("-", "_") in STRUCTURAL}
    mismatch = structure_mismatch(model, model_keys, experts or {}, bool(shards.manifest_of(state).get("experts")))
    if mismatch:
        raise CheckpointError(f"{path} does not fit this model ({mismatch}): " + (
            f"it was saved with {_said(structural, 0)}, this run has {_said(structural, 1)}; give the flags as saved"
            if structural else "give the model flags it was saved with (--arch, layer counts and sizes, --moe-*)"))
    old_gates = [n for n in model_keys if n.endswith(".gate.log_inv_temperature") and n not in model
                 and n.replace("log_inv_temperature", "weight") in model
                 and n.replace("log_inv_temperature", "proj.weight") in model]
    if old_gates and not reset_optimizer and state.get("last_optimizer_state") is not None:
        raise CheckpointError(f"{path} has cosine gates without the learned temperature (saved before it, e.g. "
                              f"{old_gates[0]}): they load as they were (t = 0.07), but its optimizer state has no "
                              f"entry for the new parameters: resume with --reset-optimizer")
    others = {f: v for f, v in changes.items() if f not in structural}
    if others and log:
        logger.warning(f"{path} was saved with {_said(others, 0)}; this run has {_said(others, 1)}: the weights "
                       f"load as saved, and route and train by this run's flags from here on")


# Of the model's flags: those that decide which weights its MoE layers hold (names and shapes), with the
# model's sizes; and those that choose only how a layer runs, not what it computes or learns (never named).
STRUCTURAL = {"moe_expert_count", "moe_expert_ffn_dim", "moe_expert_kind", "moe_shared_expert_count",
              "moe_shared_expert_ffn_dim", "moe_shared_expert_gate", "moe_routing", "decoder_kv_heads",
              "decoder_head_dim", "qk_norm", "qkv_bias", "attention_bias",
              "moe_gate",
              "moe_soft_slots", "moe_freq", "encoder_moe_freq", "decoder_moe_freq", "encoder_embed_dim",
              "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim", "encoder_layers", "decoder_layers"}
EXECUTION = {"moe_kernel_backend", "moe_a2a_local_size", "moe_a2a_overlap_degree"}
# The model config's names of the layer's flags (--moe-top-k -> moe_top_k), and of the model's own MoE flags.
LAYER_FLAGS = {dest_of(f) for f in settings(MoEConfig) if flag_of(f).startswith("--moe-")} | {
    "moe_top1_expert", "moe_freq", "use_moe_pad_mask"}


def _section(cfg, key):
    try:
        return cfg.get(key) if cfg is not None else None
    except AttributeError:
        return getattr(cfg, key, None)


def _flag_values(model_cfg):
    """({flag name: value}, [sides]) of an MoE model's config (an argparse Namespace or a mapping), the
    values as the model reads them: --moe-top1-expert is --moe-top-k 1, an unset --moe-eval-top-k the top-k,
    an unset expert width the FFN width of the sides with MoE layers (flag_changes reads the placement)."""
    get = (lambda k: getattr(model_cfg, k)) if isinstance(model_cfg, argparse.Namespace) else model_cfg.get
    has = (lambda k: hasattr(model_cfg, k)) if isinstance(model_cfg, argparse.Namespace) else (lambda k: k in model_cfg)
    values = {k: get(k) for k in (LAYER_FLAGS | STRUCTURAL) - EXECUTION if has(k)}
    if values.get("moe_expert_count") is not None:  # (one count, or one per MoE layer: equal counts are that count)
        counts = expert_counts(values["moe_expert_count"])
        values["moe_expert_count"] = counts[0] if len(set(counts)) == 1 else ",".join(map(str, counts))
    if values.pop("moe_top1_expert", False):
        values["moe_top_k"] = 1
    elif values.get("moe_top_k", 0) is None:
        values["moe_top_k"] = MoEConfig.top_k
    if values.get("moe_eval_top_k", 0) is None:
        values["moe_eval_top_k"] = values.get("moe_top_k")
    sides = [s for s in ("encoder", "decoder") if has(f"{s}_layers")]  # (a language model: the decoder)
    if values.get("moe_expert_ffn_dim", 0) is None:
        moe_sides = [s for s in sides if values.get(f"{s}_moe_freq") or values.get("moe_freq")]
        widths = sorted({values.get(f"{s}_ffn_embed_dim") for s in moe_sides} - {None})
        values["moe_expert_ffn_dim"] = widths[0] if len(widths) == 1 else "/".join(map(str, widths)) or None
    return values, sides


_PLACEMENT = {"moe_freq", "encoder_moe_freq", "decoder_moe_freq"}


def flag_changes(saved_model_cfg, model_cfg):
    """{'--flag': (saved value, this run's)} of the model flags that differ ({} when either config is unknown).
    Where the MoE layers are is said with the flag that places them: a side's own frequency, or --moe-freq
    where neither run set the side's (0: as --moe-freq)."""
    if saved_model_cfg is None or model_cfg is None:
        return {}
    try:
        (a, sides_a), (b, sides_b) = _flag_values(saved_model_cfg), _flag_values(model_cfg)
    except (AttributeError, TypeError, ValueError):
        return {}
    changes = {k: (a[k], b[k]) for k in set(a) & set(b) - _PLACEMENT if a[k] != b[k]}
    for side in (s for s in sides_a if s in sides_b):
        own_a, own_b = a.get(f"{side}_moe_freq") or 0, b.get(f"{side}_moe_freq") or 0
        key = f"{side}_moe_freq" if own_a or own_b else "moe_freq"
        va, vb = own_a or a.get("moe_freq"), own_b or b.get("moe_freq")
        if va != vb:
            changes[key] = (va, vb)
    shown = lambda v: "(unset)" if v is None else v  # noqa: E731
    return {"--" + k.replace("_", "-"): (shown(va), shown(vb)) for k, (va, vb) in sorted(changes.items())}


def _said(changes, which):
    return ", ".join(f"{flag} {values[which]}" for flag, values in changes.items())


def structure_mismatch(saved, model_keys, experts, counts_checked):
    """The first weight of the saved model state that this model cannot take, said in a few words, or None:
    a shape that differs (of an expert tensor, its expert count only where check_expert_layout has not
    compared it from the manifest: counts_checked), or an MoE weight only one of the two has (the load hooks
    fill a cosine gate's temperature and a routing bias that are missing)."""
    filled = (".gate.log_inv_temperature", ".gate.proj.bias", ".routing_bias")
    for name, shape in model_keys.items():
        if name not in saved:
            if ".moe." in name and not name.endswith(filled):
                return f"it has no {name}"
            continue
        got = tuple(saved[name].shape)
        want = tuple(shape)
        if name in experts:
            got, want = (got[1:], want[1:]) if counts_checked else (got, (experts[name],) + want[1:])
        if got != want:
            return f"{name} is {tuple(saved[name].shape)} there, {tuple(shape)} here"
    extra = sorted(n for n in saved if ".moe." in n and n not in model_keys and not n.endswith(".routing_bias"))
    return f"it has {extra[0]}, this model has not" if extra else None
