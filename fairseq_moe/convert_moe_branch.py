"""Checkpoints of fairseq's `moe` branch (and of the projects built on it) in: one fairseq-moe checkpoint.

    python -m fairseq_moe.convert_moe_branch IN_PREFIX OUT.pt

IN_PREFIX names a set written by the moe branch's trainer: IN_PREFIX-shared.pt (everything but the experts:
embeddings, attention, layer norms, the gates `...moe_layer.gate.wg.weight`, the config) and
IN_PREFIX-rank-R.pt, R = 0..n-1 (rank R's local experts `...moe_layer.experts.j.fc1/fc2`, j = 0..El-1, which
are the global experts R * El + j; with more ranks than experts, rank R holds expert R mod E and the files of
ranks E..n-1 are replicas). IN_PREFIX may also be given as one of those file names or as IN_PREFIX.pt.
Layout and semantics as read from the moe branch's code (fairseq/modules/moe/, moe_checkpoint_utils.py,
trainer.py): see docs/moe_branch.md.

OUT.pt is a single moe_transformer / moe_transformer_lm checkpoint with every expert (it loads at any world size,
fairseq-generate and fairseq-eval-lm read it with --user-dir fairseq_moe), its flags mapped: the MoE layers where
they were (--encoder/--decoder-moe-freq), --moe-expert-count, top-1 or top-2, the second-expert policy, gate-
probability normalisation, batch-prioritised routing, the pad mask, fp32 gating, NLLB's expert and final output
masking (--moe-eom, --moe-fom) and its conditional MoE routing (--moe-cmr: the layer's dense FFN becomes the one
shared expert, the CMR gate mixes it with the experts), the capacity (training and eval: --moe-capacity-rounding
per_choice; with the pad mask it counts the padding too: --moe-capacity-counts-padding) and which tokens an expert
takes first at capacity (--moe-token-priority sentence). The optimizer
state is not converted (continue training with --finetune-from-model). What cannot be mapped is refused, naming
the key: BASE layers, dense "pseudo-MoE" layers of another width, FSDP-sharded files, tasks other than
translation, translation_multi_simple_epoch (NLLB's: it becomes moe_translation_multi_simple_epoch) and language
modelling. Never overwrites; writes OUT whole or not at all.
"""
import math
import os
import re
import sys

import torch

from .checkpoints import sets as shards
from .checkpoints import safe_load
from .errors import CheckpointError
from fairseq_moe_layer.routing import TopK
from .checkpoints.new_files import write_new
from .checkpoints.command import PROG, new_checkpoint, parser, run, safe_globals
from .checkpoints.state import every_nth, moe_checkpoint, section

_EXPERT = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.experts\.(?P<j>\d+)\."
                     r"(?P<fc>fc1|fc2)\.(?P<kind>weight|bias)$")
_GATE = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.moe_layer\.gate\.wg\.weight$")
_RANK = re.compile(r"-rank-(\d+)\.pt$")
# NLLB's CMR layers: the gate, its language ids (logging only), and the MoE layer a second time (the same module)
_CMR = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.cmr_layer\."
                  r"(?P<rest>gate\.wg\.(?:weight|bias)|lang_idx|moe_layer\..+)$")
# cfg.model fields whose non-default value this converter cannot map (the moe branch / NLLB feature named)
UNMAPPABLE = {"base_layers": "BASE layers (balanced assignment, extra layers)",
              "alternate_ffn_embed_dim": "dense pseudo-MoE layers of another FFN width",
              "alternate_decoder_ffn_embed_dim": "dense pseudo-MoE layers of another FFN width",
              "moe_eval_capacity_max_seqlen": "NLLB's eval capacity from the longest positions, ceil(fraction * "
                                              "max_positions * B), not from the batch's tokens"}


def base_of(prefix):
    """The set's base name from IN_PREFIX, IN_PREFIX.pt, -shared.pt or -rank-R.pt."""
    return re.sub(r"(-shared|-rank-\d+)?\.pt$", "", prefix)


def find_files(prefix):
    """(shared file, [rank files in rank order]) of a moe-branch set; errors name the missing file."""
    base = base_of(prefix)
    shared = f"{base}-shared.pt"
    if not os.path.exists(shared):
        raise CheckpointError(f"{shared} is missing: the moe branch writes NAME-shared.pt beside NAME-rank-R.pt "
                              f"(give IN_PREFIX as NAME)")
    folder, name = os.path.split(base)
    ranks = sorted((int(m.group(1)), os.path.join(folder, f)) for f in os.listdir(folder or ".")
                   if f.startswith(name + "-rank-") and (m := _RANK.search(f)) and f == f"{name}-rank-{m.group(1)}.pt")
    if not ranks:
        raise CheckpointError(f"{base}-rank-0.pt is missing: a moe-branch set has one file per rank")
    for expected, (rank, _) in enumerate(ranks):
        if rank != expected:
            raise CheckpointError(f"{base}-rank-{expected}.pt is missing (the set has rank files up to {ranks[-1][0]})")
    return shared, [path for _, path in ranks]


def _model_cfg(state, path):
    if state.get("cfg") is None and state.get("args") is not None:
        raise CheckpointError(f"{path} was saved by fairseq < 0.10 (args, no cfg): load and save it once with the "
                              f"moe branch's own fairseq (a newer one), then convert")
    return section(state.get("cfg"), "model", path)


def _read(path, what):
    state = shards.read_file(path, what=what)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path} is not a fairseq checkpoint (no model state)")
    if "shard_metadata" in state:
        raise CheckpointError(f"{path} holds FSDP-sharded parameters (shard_metadata, --use-sharded-state): "
                              f"consolidate the shards with fairseq's consolidate_fsdp_shards first")
    safe_load.check_config(state, path)
    return state


def expert_tensors(rank_files, E, shared_path):
    """{MoE layer: {(fc, kind): [E tensors]}} from the rank files (global expert R * El + j)."""
    per_rank = []
    for path in rank_files:
        model = _read(path, "a rank file of the set")["model"]
        found = {}
        for key, t in model.items():
            if (c := _CMR.match(key)) is not None and c["rest"].startswith("moe_layer."):
                twin = f"{c['layer']}.{c['rest']}"  # (CMRLayer holds the layer's own MoE module: the same tensor)
                if twin not in model or not torch.equal(model[twin], t):
                    raise CheckpointError(f"{path}: {key} differs from {twin}, which NLLB's CMR layer shares")
                continue
            m = _EXPERT.match(key)
            if m is None:
                raise CheckpointError(f"{path}: {key} is not an expert parameter of the moe branch's layout "
                                      f"(LAYER.moe_layer.experts.J.fc1/fc2.weight/bias): cannot map it")
            found.setdefault(m["layer"], {}).setdefault((m["fc"], m["kind"]), {})[int(m["j"])] = t
        per_rank.append((path, found))
    n = len(per_rank)
    local = {len(js) for _, found in per_rank for parts in found.values() for js in parts.values()}
    if len(local) != 1:
        raise CheckpointError(f"{shared_path}: the rank files hold different numbers of experts per layer ({sorted(local)})")
    El = local.pop()
    if n * El == E:
        owners = per_rank
    elif El == 1 and n > E and n % E == 0:  # more ranks than experts: rank R serves expert R mod E
        owners = per_rank[:E]
        for (path, found), (first, original) in zip(per_rank[E:], per_rank[:E] * (n // E - 1)):
            same = lambda layer, part, j, t: (layer in original and part in original[layer] and  # noqa: E731
                                              j in original[layer][part] and torch.equal(t, original[layer][part][j]))
            if any(not same(layer, part, j, t) for layer, parts in found.items()
                   for part, js in parts.items() for j, t in js.items()):
                raise CheckpointError(f"{path} should be a replica of {first} (rank R holds expert R mod {E}), "
                                      f"but its experts differ")
    else:
        raise CheckpointError(f"{shared_path}: {n} rank files of {El} experts each do not make the "
                              f"moe_expert_count {E} of its config")
    layers = {}
    for r, (path, found) in enumerate(owners):
        for layer, parts in found.items():
            for part, js in parts.items():
                if sorted(js) != list(range(El)):
                    raise CheckpointError(f"{path}: {layer} has local experts {sorted(js)}, not 0..{El - 1}")
                slots = layers.setdefault(layer, {}).setdefault(part, [None] * E)
                for j, t in js.items():
                    slots[r * El + j] = t
    for layer, parts in layers.items():
        if len(parts) != 4 or any(t is None for slots in parts.values() for t in slots):
            raise CheckpointError(f"{shared_path}: {layer}'s experts are incomplete across the rank files "
                                  f"(each needs fc1/fc2 weight and bias for all {E})")
    return layers


def _field(cfg, key, kind, default, path, choices=None):
    """cfg.model.key as the moe branch types it (bool, float: an int too, str among choices); default when it
    is absent; any other value (a string "False", None, a typo) refused by name, before anything is written."""
    if key not in cfg:
        return default
    value = cfg[key]
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) if kind is float
          else isinstance(value, str) and (choices is None or value in choices))
    if not ok:
        want = {bool: "True or False", float: "a number"}.get(kind) or f"one of {list(choices)}"
        raise CheckpointError(f"{path}: cfg.model.{key} = {value!r} is not {want} (the moe branch's type): not "
                              f"converted")
    return float(value) if kind is float else value


def layer_freq(indices, count, side):
    """The --{side}-moe-freq that makes exactly `indices` (0-based) of `count` layers MoE, or an error."""
    freq = every_nth(indices, count)
    if freq is None:
        raise CheckpointError(f"the MoE layers of the {side} are {indices} of {count}: not every N-th layer, "
                              f"which --{side}-moe-freq cannot express")
    return freq


def convert(prefix, out):
    """Write OUT from the moe-branch set at prefix; returns {MoE layer: E}."""
    new_checkpoint(out)
    shared_path, rank_files = find_files(prefix)
    state = _read(shared_path, "the shared file of the set")
    cfg = _model_cfg(state, shared_path)
    for key, what in UNMAPPABLE.items():
        if cfg.get(key):
            raise CheckpointError(f"{shared_path}: cfg.model.{key} = {cfg[key]!r} ({what}) has no counterpart in "
                                  f"fairseq-moe: not converted")
    E = cfg.get("moe_expert_count")
    if not isinstance(E, int) or E < 1:
        raise CheckpointError(f"{shared_path}: cfg.model.moe_expert_count = {E!r}: not an MoE checkpoint of the "
                              f"moe branch")
    experts = expert_tensors(rank_files, E, shared_path)
    model = {}
    gates, cmr = {}, {}
    cmr_on = _field(cfg, "moe_cmr", bool, False, shared_path)
    for key, t in state["model"].items():
        if (m := _GATE.match(key)) is not None:
            gates[m["layer"]] = t
        elif cmr_on and (c := _CMR.match(key)) is not None:
            if c["rest"].startswith("moe_layer."):
                twin = f"{c['layer']}.{c['rest']}"
                if twin not in state["model"] or not torch.equal(state["model"][twin], t):
                    raise CheckpointError(f"{shared_path}: {key} differs from {twin}, which NLLB's CMR layer shares")
            elif c["rest"] != "lang_idx":  # (the gates per language that CMR logs: nothing to compute)
                cmr.setdefault(c["layer"], {})[c["rest"].rsplit(".", 1)[1]] = t
        elif "moe_layer" in key or "expert" in key or "cmr_layer" in key:
            raise CheckpointError(f"{shared_path}: {key} is not part of the moe branch's MoE layer as this "
                                  f"converter knows it (gate.wg.weight; experts in the rank files): not converted")
        else:
            model[key] = t
    if set(gates) != set(experts):
        raise CheckpointError(f"{shared_path}: gates for {sorted(gates)} but experts for {sorted(experts)}")
    for layer, parts in experts.items():
        fc1_w, fc1_b = torch.stack(parts["fc1", "weight"]), torch.stack(parts["fc1", "bias"])  # [E, F, D], [E, F]
        fc2_w, fc2_b = torch.stack(parts["fc2", "weight"]), torch.stack(parts["fc2", "bias"])  # [E, D, F], [E, D]
        if gates[layer].shape != (E, fc1_w.shape[2]):
            raise CheckpointError(f"{shared_path}: {layer}.moe_layer.gate.wg.weight is {tuple(gates[layer].shape)}, "
                                  f"not [{E}, {fc1_w.shape[2]}]")
        p = f"{layer}.fc1.moe."
        model.update({p + "gate.weight": gates[layer].float(), p + "experts.w1": fc1_w.transpose(1, 2).contiguous(),
                      p + "experts.b1": fc1_b, p + "experts.w2": fc2_w.transpose(1, 2).contiguous(),
                      p + "experts.b2": fc2_b})
        if cmr_on:  # the layer's dense FFN is the one shared expert; the CMR gate mixes it with the experts
            dense = {part: model.pop(f"{layer}.{part}", None) for part in ("fc1.weight", "fc1.bias", "fc2.weight",
                                                                            "fc2.bias")}
            missing = [part for part, t in dense.items() if t is None] + [
                f"cmr_layer.gate.wg.{kind}" for kind in ("weight", "bias") if kind not in cmr.get(layer, {})]
            if missing:
                raise CheckpointError(f"{shared_path}: cfg.model.moe_cmr is on but the MoE layer {layer} has no "
                                      f"{layer}.{missing[0]}")
            model.update({p + "shared.w1": dense["fc1.weight"].t().unsqueeze(0).contiguous(),
                          p + "shared.b1": dense["fc1.bias"].unsqueeze(0),
                          p + "shared.w2": dense["fc2.weight"].t().unsqueeze(0).contiguous(),
                          p + "shared.b2": dense["fc2.bias"].unsqueeze(0),
                          p + "cmr_gate.weight": cmr[layer]["weight"], p + "cmr_gate.bias": cmr[layer]["bias"]})

    sides = ("encoder", "decoder") if any(k.startswith("encoder.") for k in model) else ("decoder",)
    freqs = {}
    for side in sides:
        count = len({int(m.group(1)) for k in model if (m := re.match(rf"{side}\.layers\.(\d+)\.", k))})
        freqs[side] = layer_freq(sorted(int(layer.split(".")[2]) for layer in experts if layer.startswith(side)),
                                 count, side)
    top1 = _field(cfg, "moe_top1_expert", bool, False, shared_path)
    fraction = _field(cfg, "moe_eval_capacity_token_fraction", float, 0.25, shared_path)
    policy = "all" if top1 else _field(cfg, "moe_second_expert_policy", str, "sampling", shared_path,
                                       choices=TopK.options["second_expert_policy"].metadata["choices"])
    normalize = _field(cfg, "moe_normalize_gate_prob_before_dropping", bool, False, shared_path) and not top1
    masking = {key: _field(cfg, key, float, 0.0, shared_path) for key in ("moe_eom", "moe_fom")}  # NLLB's
    for key, p in masking.items():
        if not 0 <= p < 1:
            raise CheckpointError(f"{shared_path}: cfg.model.{key} = {p!r} is not a probability in [0, 1): not "
                                  f"converted")
    pad_mask = _field(cfg, "use_moe_pad_mask", bool, False, shared_path)
    name = "moe_transformer" if "encoder" in sides else "moe_transformer_lm"
    cfg.update(_name=name, arch=name, moe_expert_count=E, moe_freq=0, decoder_moe_freq=freqs["decoder"],
               moe_top_k=1 if top1 else 2, moe_top1_expert=top1, moe_gate="linear", moe_routing=TopK.name,
               moe_expert_ffn_dim=None,  # (the moe branch ignores it: an expert is as wide as its side's FFN)
               # the moe branch's capacity: k * ceil(T / E) in training, its tokens queued sentence by sentence
               moe_capacity_factor=1.0, moe_capacity_rounding="per_choice", moe_token_priority="sentence",
               moe_capacity_counts_padding=pad_mask,  # (with the pad mask, the moe branch counts padding too)
               # the moe branch: a fraction > 0 gives ceil(fraction * T) at eval, anything else the training capacity
               moe_eval_capacity_token_fraction=fraction if fraction > 0 else -1.0,
               moe_second_expert_policy=policy, moe_normalize_gate_prob_before_dropping=normalize, **masking,
               moe_cmr=cmr_on, moe_shared_expert_count=1 if cmr_on else 0,
               cmr_gate_drop=_field(cfg, "cmr_gate_drop", float, 0.0, shared_path) if cmr_on else 0.0)
    if "encoder" in sides:
        cfg["encoder_moe_freq"] = freqs["encoder"]
    converted = moe_checkpoint(state, model, cfg, shared_path, {
        "what": f"converted from fairseq's moe branch ({os.path.abspath(shared_path)})",
        "rank_files": len(rank_files), "experts": E})
    write_new(out, lambda save: save(converted, out))
    return {layer: E for layer in sorted(experts)}


def main(argv=None):
    p = parser(PROG.format("convert_moe_branch"), __doc__)
    p.add_argument("prefix", help="IN_PREFIX: the set NAME (NAME-shared.pt + NAME-rank-R.pt), or one of its files")
    p.add_argument("output", help="OUT.pt (never overwritten)")
    a = p.parse_args(argv)
    return run(p.prog, lambda: convert(a.prefix, a.output),
               lambda done: f"{a.output}: {len(done)} MoE layers of {next(iter(done.values()))} experts; no "
                            f"optimizer state (continue training with --finetune-from-model {a.output})",
               setup=safe_globals)


if __name__ == "__main__":
    sys.exit(main())
