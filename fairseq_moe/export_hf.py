"""A moe_transformer checkpoint out to Hugging Face transformers' NllbMoe:

    python -m fairseq_moe.export_hf CKPT OUT_DIR [--data DATA]

CKPT: a single file or a set (NAME.pt of NAME-shared.pt + rank files: every expert is read). OUT_DIR (new) gets
what `NllbMoeForConditionalGeneration.from_pretrained(OUT_DIR)` loads: config.json and model.safetensors, and
vocab.json, the fairseq dictionary as {symbol: id} (ids as the model's embeddings: specials, words, then the
language tokens of a multilingual task), read through the checkpoint's task from DATA (default: the task's
data folder as saved). There is no tokenizer: the ids are fairseq's.

NllbMoe is one architecture: pre-norm layers with a final layer norm on each side, sinusoidal positions, one
embedding shared by the encoder, the decoder and the output, top-2 routing with a linear fp32 router, every N-th
layer MoE with every expert as wide as its side's FFN, NLLB's capacity at evaluation (a fraction of the tokens,
queued sentence by sentence) and its expert output masking. A checkpoint that computes anything else at
evaluation is refused, naming the flag, before anything is written. What differs in training only (the training
capacity, the second expert's sampling, router noise, expert output masking, dropout, the router losses) is listed
when the export is done: transformers' NllbMoe trains its own way. transformers is an optional dependency (pip
install 'fairseq-moe[hf]'); nothing else here needs it.
"""
import json
import os
import re
import sys
from argparse import Namespace

from .errors import CheckpointError, FlagError
from .checkpoints.new_files import one_line, refuse_existing
from .checkpoints.command import PROG, check_data, parser, read_any, run, safe_globals
from .checkpoints import hf_lm
from .checkpoints.fits import expert_counts
from .checkpoints.state import every_nth, section

_MOE = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.fc1\.moe\.gate\.weight$")
_LM_MOE = re.compile(r"^decoder\.layers\.(\d+)\.fc1\.moe\.gate\.weight$")
_RENAMES = ((".encoder_attn_layer_norm.", ".cross_attention_layer_norm."), (".encoder_attn.", ".cross_attention."),
            (".final_layer_norm.", ".ff_layer_norm."))


def _flags(state, path):
    """(our model's flags, whether it is a moe_mixtral_lm) of a checkpoint, or the reason no export takes it."""
    model = state.get("cfg", {}).get("model") if isinstance(state.get("cfg"), dict) else None
    arch = str(getattr(model, "arch", "")) if isinstance(model, Namespace) else ""
    if arch.startswith("moe_mixtral_lm"):
        return vars(model), True
    if not arch.startswith("moe_transformer"):
        raise CheckpointError(f"{path} is not a moe_transformer or moe_mixtral_lm checkpoint (cfg.model): export "
                              f"translation models (NllbMoe) or moe_mixtral_lm language models")
    if arch.startswith("moe_transformer_lm"):
        raise CheckpointError(f"{path} is a language model (--arch {model.arch}): NllbMoe is an encoder-decoder; "
                              f"transformers' MoE causal LMs take --arch moe_mixtral_lm")
    return vars(model), False


def sparse_step(layers, count, side):
    """NllbMoe's {side}_sparse_step for MoE layers at these indices of count layers (0: none), or an error."""
    step = every_nth(layers, count)
    if step is None:
        raise FlagError(f"the {side}'s MoE layers {layers} are not every N-th of {count} layers: NllbMoe's "
                        f"{side}_sparse_step cannot express them")
    return step


def nllb_config(a, moe_layers, vocab):
    """NllbMoeConfig's arguments from our model's flags a, or FlagError naming what NllbMoe cannot express at
    evaluation; and the list of what differs in training only."""
    def need(ok, flag, why):
        if not ok:
            raise FlagError(f"{flag} {why}: NllbMoe cannot express it")

    d = a["encoder_embed_dim"]
    counts = expert_counts(a["moe_expert_count"])
    need(len(set(counts)) == 1, f"--moe-expert-count {a['moe_expert_count']}",
         "gives its MoE layers different expert counts (NllbMoe has one num_experts for every layer; a pruned model: "
         "prune with --uniform)")
    need(a["decoder_embed_dim"] == d and a.get("decoder_output_dim", d) == d and a.get("decoder_input_dim", d) == d,
         f"--decoder-embed-dim {a['decoder_embed_dim']}", f"differs from --encoder-embed-dim {d}")
    for side in ("encoder", "decoder"):
        need(a.get(f"{side}_normalize_before"), f"--{side}-normalize-before", "is off (post-norm layers)")
        need(not a.get(f"{side}_learned_pos"), f"--{side}-learned-pos", "is on (NllbMoe: sinusoidal positions)")
        need(not a.get(f"{side}_layers_to_keep"), f"--{side}-layers-to-keep", "is set")
    need(a.get("share_all_embeddings"), "--share-all-embeddings", "is off (NllbMoe shares one embedding)")
    for flag in ("layernorm_embedding", "no_token_positional_embeddings", "cross_self_attention",
                 "no_decoder_final_norm", "adaptive_input", "tie_adaptive_weights"):
        need(not a.get(flag), "--" + flag.replace("_", "-"), "is on")
    need(not a.get("adaptive_softmax_cutoff"), "--adaptive-softmax-cutoff", "is set")
    need(not (a.get("quant_noise_pq") or a.get("quant_noise_scalar")), "--quant-noise-pq/--quant-noise-scalar",
         "is set")
    top_k = 1 if a.get("moe_top1_expert") else a.get("moe_top_k") or 2
    need(top_k == 2 and a.get("moe_eval_top_k") in (None, 2), f"--moe-top-k {top_k}", "is not 2 (NllbMoe routes "
         "top-2)")
    hf_lm.check_plain_router(a, need, "ffn")  # (NllbMoe's experts: fc1, act, fc2, with biases; its eom is NLLB's)
    need(a.get("moe_gating_use_fp32", True), "--no-moe-gating-use-fp32", "is set")
    need(a.get("moe_topk_renormalize", True), "--no-moe-topk-renormalize", "is set (NllbMoe renormalises its "
         "top-2 weights)")
    need(not a.get("moe_shared_expert_count"), f"--moe-shared-expert-count {a.get('moe_shared_expert_count')}",
         "is set")
    for side in ("encoder", "decoder"):
        ffn = a.get("moe_expert_ffn_dim")
        need(ffn in (None, a[f"{side}_ffn_embed_dim"]), f"--moe-expert-ffn-dim {ffn}",
             f"differs from --{side}-ffn-embed-dim {a[f'{side}_ffn_embed_dim']}")
    frac, cf, rounding = a.get("moe_eval_capacity_token_fraction", 0.25), a.get("moe_capacity_factor", 1.0), \
        a.get("moe_capacity_rounding", "total")
    # A fraction < 0 (the training capacity at evaluation): transformers' router computes 2 * ceil(T / E) on its
    # first batch and keeps it for every later one (modeling_nllb_moe.py: self.expert_capacity), so no setting of
    # NllbMoe gives this model's capacity on batches of other sizes.
    need(frac >= 0, f"--moe-eval-capacity-token-fraction {frac}", "takes the training capacity at evaluation, which "
         "transformers' NllbMoe fixes at its first batch's (export a model with a fraction >= 0, e.g. after "
         "--model-overrides, or 0: dropless)")
    drops = 0 < frac < 1
    need(not (drops and a.get("use_moe_pad_mask") and not a.get("moe_capacity_counts_padding")),
         "--use-moe-pad-mask", "without --moe-capacity-counts-padding, with tokens dropped at evaluation, counts the "
         "real tokens only for the capacity; NllbMoe counts the padding too")
    need(not drops or a.get("moe_token_priority", "position") == "sentence",
         f"--moe-token-priority {a.get('moe_token_priority', 'position')}", "queues tokens position by position "
         "(NllbMoe: sentence by sentence)")
    steps = {side: sparse_step(sorted(i for s, i in moe_layers if s == side), a[f"{side}_layers"], side)
             for side in ("encoder", "decoder")}
    policy = a.get("moe_second_expert_policy", "all")
    training = [f"training capacity: this model {'dropless' if cf == 0 else f'CF {cf}, rounded {rounding}'}; "
                f"NllbMoe 2 * ceil(T / E)"] if (cf, rounding) != (1, "per_choice") else []
    if policy != "all":
        training.append(f"second expert: this model draws it ({policy}) in training only; exported as 'all' "
                        f"(NllbMoe's 'sampling' and 'random' would draw at evaluation too)")
    if a.get("moe_gate_noise", "none") != "none":
        training.append(f"router noise {a['moe_gate_noise']}: NllbMoe has none")
    if a.get("moe_eom"):
        training.append(f"expert output masking {a['moe_eom']}: this model zeroes whole expert outputs (NLLB's "
                        f"fairseq); NllbMoe trains it as element-wise dropout, rescaled by 1 / (1 - p)")
    if a.get("dropout", 0.1) != a.get("activation_dropout", 0.0):
        training.append(f"dropout after the FFN: this model --dropout {a.get('dropout', 0.1)}; NllbMoe's ff_dropout "
                        f"is its activation_dropout, {a.get('activation_dropout', 0.0)}")
    training.append(f"router losses: NllbMoe computes its own (router_aux_loss_coef = --moe-gate-loss-wt "
                    f"{a.get('moe_gate_loss_wt', 0.01)}, router_z_loss_coef = --moe-z-loss-wt "
                    f"{a.get('moe_z_loss_wt', 0.0)})")
    config = dict(
        vocab_size=vocab, d_model=d, max_position_embeddings=max(a.get("max_source_positions", 1024),
                                                                 a.get("max_target_positions", 1024)),
        encoder_layers=a["encoder_layers"], decoder_layers=a["decoder_layers"],
        encoder_ffn_dim=a["encoder_ffn_embed_dim"], decoder_ffn_dim=a["decoder_ffn_embed_dim"],
        encoder_attention_heads=a["encoder_attention_heads"], decoder_attention_heads=a["decoder_attention_heads"],
        encoder_layerdrop=a.get("encoder_layerdrop", 0.0), decoder_layerdrop=a.get("decoder_layerdrop", 0.0),
        activation_function=a.get("activation_fn", "relu"), dropout=a.get("dropout", 0.1),
        attention_dropout=a.get("attention_dropout", 0.0), activation_dropout=a.get("activation_dropout", 0.0),
        scale_embedding=not a.get("no_scale_embedding"), router_bias=False, router_dtype="float32",
        router_ignore_padding_tokens=not a.get("use_moe_pad_mask"), num_experts=counts[0],
        expert_capacity=None, encoder_sparse_step=steps["encoder"], decoder_sparse_step=steps["decoder"],
        router_z_loss_coef=a.get("moe_z_loss_wt", 0.0), router_aux_loss_coef=a.get("moe_gate_loss_wt", 0.01),
        second_expert_policy="all",
        normalize_router_prob_before_dropping=bool(a.get("moe_normalize_gate_prob_before_dropping")),
        batch_prioritized_routing=bool(a.get("moe_batch_prioritized_routing")),
        moe_eval_capacity_token_fraction=1.0 if frac == 0 else frac,  # (0: dropless; 1.0 drops nothing either)
        moe_token_dropout=a.get("moe_eom", 0.0), pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2)
    return config, training


def hf_weights(model):
    """Our state dict in NllbMoeForConditionalGeneration's names (the experts one per module, their weights
    transposed: ours are [E, d, f] / [E, f, d], nn.Linear's [out, in])."""
    out = {}
    for key, t in model.items():
        if key.endswith(".version") or key.endswith("_float_tensor") or key == "decoder.output_projection.weight":
            continue
        if ".fc1.moe." in key:
            layer, rest = key.split(".fc1.moe.")
            if rest == "gate.weight":
                out[f"model.{layer}.ffn.router.classifier.weight"] = t.float()
                continue
            fc, kind = {"experts.w1": ("fc1", "weight"), "experts.b1": ("fc1", "bias"), "experts.w2": ("fc2", "weight"),
                        "experts.b2": ("fc2", "bias")}[rest]
            for e in range(t.shape[0]):
                out[f"model.{layer}.ffn.experts.expert_{e}.{fc}.{kind}"] = (
                    t[e].t() if kind == "weight" else t[e]).contiguous()
            continue
        for a, b in _RENAMES:
            key = key.replace(a, b)
        key = re.sub(r"\.layers\.(\d+)\.(fc1|fc2)\.", r".layers.\1.ffn.\2.", key)
        out["model." + key] = t
    embed = out["model.encoder.embed_tokens.weight"]
    out["model.shared.weight"] = embed
    out["model.decoder.embed_tokens.weight"] = embed
    out["lm_head.weight"] = embed
    return out


def vocabulary(state, path, data):
    """[symbol of each id] of the checkpoint's task's source dictionary (its language tokens included)."""
    from fairseq import tasks

    task_cfg = section(state["cfg"], "task", path)
    folder = data or task_cfg.get("data")
    if not folder or not os.path.isdir(str(folder).split(os.pathsep)[0]):
        raise FlagError(f"the dictionary is read from the task's data folder ({folder!r} is not one): give "
                        f"--data DATA")
    check_data(state, path, str(folder).split(os.pathsep)[0])  # (its dictionaries, by name)
    task_cfg["data"] = folder
    cfg = Namespace(**task_cfg) if isinstance(state["cfg"]["task"], Namespace) else task_cfg
    if isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.create(cfg)
    try:
        task = tasks.setup_task(cfg)
    except Exception as e:  # (the task reads nothing but DATA here: whatever stops it is about --data)
        raise FlagError(f"--data {folder}: the checkpoint's task cannot read its dictionaries "
                        f"({type(e).__name__}: {one_line(e)})") from e
    d = task.source_dictionary
    if task.target_dictionary is not None and task.target_dictionary.symbols != d.symbols:
        raise FlagError(f"{path}: the source and target dictionaries differ: NllbMoe shares one")
    return list(d.symbols)


def data_folder(state, path, data):
    """The data folder of the checkpoint's task: --data, or as saved."""
    folder = data or section(state["cfg"], "task", path).get("data")
    return str(folder).split(os.pathsep)[0] if folder else None


def nllb(state, flags, ckpt, data):
    """(class prefix, config, weights, vocab.json, what differs in training) of a moe_transformer."""
    model = state["model"]
    moe_layers = [(m.group(1), int(m.group(2))) for k in model if (m := _MOE.match(k))]
    vocab = model["encoder.embed_tokens.weight"].shape[0]
    config, training = nllb_config(flags, moe_layers, vocab)
    symbols = vocabulary(state, ckpt, data)
    if len(symbols) != vocab:
        raise FlagError(f"the task's dictionary has {len(symbols)} symbols, the model's embeddings {vocab} rows: "
                        f"not this model's data (--data)")
    return "NllbMoe", config, hf_weights(model), {s: i for i, s in enumerate(symbols)}, training, []


def causal_lm(state, flags, ckpt, data, token_ids=None):
    """(class prefix, config, weights, vocab.json, what differs in training, notes) of a moe_mixtral_lm: the family
    its flags select (hf_lm.family). With hf_token_ids.json (token_ids, or beside CKPT, or in the data folder:
    import_hf wrote it), the vocabulary goes back to HF's ids, the rows added for fairseq's specials dropped (a note
    where training changed them)."""
    model = state["model"]
    moe = sorted(int(m[1]) for k in model if (m := _LM_MOE.match(k)))
    counts = sorted({model[f"decoder.layers.{i}.fc1.moe.gate.weight"].shape[0] for i in moe})
    if len(counts) != 1:
        raise FlagError(f"--moe-expert-count {flags.get('moe_expert_count')} gives its MoE layers different expert "
                        f"counts {counts}: transformers' MoE LMs have one")
    rows = model["decoder.embed_tokens.weight"].shape[0]
    symbols = vocabulary(state, ckpt, data)
    if len(symbols) != rows:
        raise FlagError(f"the task's dictionary has {len(symbols)} symbols, the model's embeddings {rows} rows: "
                        f"not this model's data (--data)")
    ids = None
    places = [token_ids] if token_ids else [os.path.join(folder, hf_lm.TOKEN_IDS) for folder in (
        os.path.dirname(os.path.abspath(ckpt)), data_folder(state, ckpt, data)) if folder]
    for path in places:
        if os.path.isfile(path) or path == token_ids:
            try:
                with open(path, encoding="utf-8") as f:
                    ids = json.load(f)
            except (OSError, ValueError) as e:
                raise FlagError(f"--token-ids {path}: not a list of token ids ({type(e).__name__}: {one_line(e)})"
                                ) from None
            hf_lm.check_ids(ids, rows, path)
            break
    if ids is None and len(symbols) > 4 and all(re.fullmatch(r"hf\d+", s) for s in symbols[4:]):
        raise FlagError(f"the dictionary is one import_hf wrote (hfID symbols) but no {hf_lm.TOKEN_IDS} is beside "
                        f"{ckpt} or in the data folder: give --token-ids (import_hf's file), or the HF ids would "
                        f"shift")
    notes = []
    if ids:
        tied = flags.get("share_decoder_input_output_embed")
        names = ("decoder.embed_tokens.weight",) + (() if tied else ("decoder.output_projection.weight",))
        trained = [symbols[i] for i, h in enumerate(ids) if h < 0 and any(model[n][i].any() for n in names)]
        if trained:
            notes.append(f"the rows of {', '.join(trained)} (fairseq's own, which the HF model has no token for) are "
                         f"not zero any more (trained) and are left out")
    specials = hf_lm.specials_of(ids) if ids else {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}
    flags = dict(flags, max_target_positions=flags.get("max_target_positions") or flags.get("tokens_per_sample"))
    kind, config, training = hf_lm.hf_config(flags, moe, counts[0], rows - (ids or []).count(-1), specials)
    vocab = {s: (ids[i] if ids else i) for i, s in enumerate(symbols) if not ids or ids[i] >= 0}
    return hf_lm.FAMILIES[kind], config, hf_lm.to_hf(model, kind, ids), vocab, training, notes


def export(ckpt, out_dir, data=None, token_ids=None):
    """Write OUT_DIR from CKPT; returns (OUT_DIR, transformers' class, what differs in training, notes)."""
    try:
        import transformers
    except ImportError:
        raise FlagError("export_hf needs transformers: pip install 'fairseq-moe[hf]'") from None
    refuse_existing([out_dir], out="OUT_DIR")
    state = read_any(ckpt)
    flags, lm = _flags(state, ckpt)
    if token_ids and not lm:
        raise FlagError("--token-ids maps a causal LM's vocabulary (import_hf's); NllbMoe's ids are fairseq's")
    name, config, weights, vocab, training, notes = causal_lm(state, flags, ckpt, data, token_ids) if lm else \
        nllb(state, flags, ckpt, data)
    cls = f"{name}ForCausalLM" if lm else f"{name}ForConditionalGeneration"
    hf = getattr(transformers, cls)(getattr(transformers, f"{name}Config")(**config))
    theirs = hf.state_dict()
    if weights.keys() != theirs.keys():
        raise CheckpointError(f"{ckpt}: parameters {name} does not have: {sorted(weights.keys() - theirs.keys())[:3]}"
                              f"; {name}'s that this model lacks: {sorted(theirs.keys() - weights.keys())[:3]}")
    hf.load_state_dict({k: v.to(theirs[k].dtype) for k, v in weights.items()}, strict=True)
    tmp = out_dir.rstrip("/") + ".partial"
    refuse_existing([tmp], out="OUT_DIR")
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False, indent=0)
        os.rename(tmp, out_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir, cls, training, notes


def main(argv=None):
    p = parser(PROG.format("export_hf"), __doc__)
    p.add_argument("checkpoint", help="CKPT: a moe_transformer or moe_mixtral_lm checkpoint (a single file, or NAME.pt "
                                      "of a set)")
    p.add_argument("output", help="OUT_DIR (new): config.json, model.safetensors, vocab.json")
    p.add_argument("--data", help="the data folder whose dictionary the model was trained with (default: the "
                                  "checkpoint's task's, as saved)")
    p.add_argument("--token-ids", metavar="FILE", help="a causal LM imported by import_hf: its hf_token_ids.json "
                                                       "(default: the one beside CKPT or in the data folder)")
    a = p.parse_args(argv)

    def report(done):
        out, cls, training, notes = done
        lines = [f"{out}: {cls}.from_pretrained({out!r}) computes this model's evaluation"]
        lines += [f"  note: {line}" for line in notes]
        lines += [f"  in training only, {cls} differs: {line}" for line in training]
        return "\n".join(lines)

    return run(p.prog, lambda: export(a.checkpoint, a.output, a.data, a.token_ids), report, setup=safe_globals)


if __name__ == "__main__":
    sys.exit(main())
