"""Our moe_mixtral_lm and transformers' four MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), both ways: the
family a model's flags select and the HF config that says the same (hf_config, with every flag the family cannot
express at evaluation refused by name), the flags of an HF config (fairseq_flags), the state dicts (to_hf, from_hf)
and the vocabulary (token_ids: fairseq's four specials first, then HF's other ids). No fairseq or transformers
import: export_hf and import_hf call these, with the checkpoint and the HF model they read.
Letters: d model, f expert width, s shared expert width, E experts, k experts per token, L layers.
"""
import re

import torch

from ..errors import FlagError

# model_type -> transformers' class prefix (XConfig, XForCausalLM)
FAMILIES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}
SPECIALS = ("bos_token_id", "pad_token_id", "eos_token_id", "unk_token_id")  # fairseq's <s> <pad> </s> <unk>: 0-3
TOKEN_IDS = "hf_token_ids.json"  # beside an imported checkpoint: [the HF id of each fairseq index]
# Where a family keeps a MoE block's modules: (block, expert gate, up, down)
BLOCKS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
QWEN_BLOCK = ("mlp", "gate_proj", "up_proj", "down_proj")
_MOE = re.compile(r"^decoder\.layers\.(\d+)\.fc1\.moe\.(.+)$")
_HF_MOE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(gate\.weight|experts\.(\d+)\.(\w+)\.weight|"
                     r"shared_expert\.(\w+)\.weight|shared_expert_gate\.weight)$")


def family(a):
    """The model_type a model's flags a (its saved cfg.model) select: the qk norm per head -> Qwen3-MoE, over the
    projection -> OLMoE, a shared expert -> Qwen2-MoE, else Mixtral."""
    qk = a.get("qk_norm") or "none"
    if qk != "none":
        return "qwen3_moe" if qk == "head" else "olmoe"
    return "qwen2_moe" if a.get("moe_shared_expert_count") else "mixtral"


def expert_width(a):
    return a.get("moe_expert_ffn_dim") or a["decoder_ffn_embed_dim"]


def check_plain_router(a, need, expert_kind):
    """What transformers' MoE blocks (NllbMoe's and the four causal LMs') have not: need(ok, flag, why) on our
    model's flags a for a routing other than softmax top-k of a linear gate, experts of another kind than
    expert_kind, a routed scaling factor, a balancing bias, expert groups, final output masking, NLLB's CMR."""
    for flag, default in (("moe_routing", "topk"), ("moe_score", "softmax"), ("moe_gate", "linear"),
                          ("moe_expert_kind", expert_kind)):
        need(a.get(flag, default) == default, f"--{flag.replace('_', '-')} {a.get(flag)}", f"is not {default}")
    need(a.get("moe_routed_scaling_factor", 1.0) == 1.0,
         f"--moe-routed-scaling-factor {a.get('moe_routed_scaling_factor')}", "is not 1")
    need(not a.get("moe_bias_update_rate"), f"--moe-bias-update-rate {a.get('moe_bias_update_rate')}",
         "is set (a balancing bias)")
    need(a.get("moe_expert_groups", 1) == 1 and a.get("moe_topk_groups") is None,
         f"--moe-expert-groups {a.get('moe_expert_groups')}", "is set")
    need(not a.get("moe_fom"), f"--moe-fom {a.get('moe_fom')}", "is set")
    need(not a.get("moe_cmr"), "--moe-cmr", "is on")


def hf_config(a, moe_layers, experts, vocab, specials):
    """(model_type, the HF config's arguments, what differs in training only) of our model's flags a, its MoE layer
    indices and expert count (from its weights), vocab rows and special ids {bos_token_id: id or None, ...}; or a
    FlagError naming what the family cannot express at evaluation."""
    kind = family(a)
    name = FAMILIES[kind]

    def need(ok, flag, why):
        if not ok:
            raise FlagError(f"{flag} {why}: transformers' {name} cannot express it")

    d, H, L = a["decoder_embed_dim"], a["decoder_attention_heads"], a["decoder_layers"]
    hd = a.get("decoder_head_dim") or d // H
    k = 1 if a.get("moe_top1_expert") else a.get("moe_top_k") or 2
    check_plain_router(a, need, "swiglu")
    need(a.get("moe_eval_top_k") in (None, k), f"--moe-eval-top-k {a.get('moe_eval_top_k')}", f"differs from k {k}")
    need(not a.get("moe_eom"), f"--moe-eom {a.get('moe_eom')}", "is set")
    frac, cf = a.get("moe_eval_capacity_token_fraction", 0.0), a.get("moe_capacity_factor", 1.0)
    need(frac == 0 or (frac < 0 and cf == 0), f"--moe-eval-capacity-token-fraction {frac}",
         "drops tokens at evaluation (HF's MoE blocks are dropless: 0)")
    renormalize = a.get("moe_top1_weight", "prob") == "one" if k == 1 else a.get("moe_topk_renormalize", True)
    if kind == "mixtral":
        need(renormalize, "--no-moe-topk-renormalize" if k > 1 else f"--moe-top1-weight {a.get('moe_top1_weight')}",
             "leaves the top-k weights unnormalised (Mixtral always renormalises)")
    shared = a.get("moe_shared_expert_count") or 0
    need(shared == 0 or (kind == "qwen2_moe" and shared == 1 and a.get("moe_shared_expert_gate")),
         f"--moe-shared-expert-count {shared}", "is not one gated shared expert (Qwen2-MoE's)" if kind == "qwen2_moe"
         else "is set (only Qwen2-MoE has a shared expert, without qk norm)")
    qkv_bias, o_bias = a.get("qkv_bias"), a.get("attention_bias")
    need(kind != "mixtral" or not (qkv_bias or o_bias), "--qkv-bias/--attention-bias", "is set (Mixtral's attention "
         "has no biases; Qwen2-MoE's q, k, v biases come with its gated shared expert)")
    need(kind != "qwen2_moe" or not o_bias, "--attention-bias", "is set (Qwen2-MoE: biases on q, k, v only: "
         "--qkv-bias)")
    need(kind in ("mixtral", "qwen2_moe") or not qkv_bias, "--qkv-bias", f"puts biases on q, k, v without o "
         f"({name}'s attention_bias: all four, --attention-bias)")
    need(kind in ("mixtral", "qwen3_moe") or hd * H == d, f"--decoder-head-dim {hd}", f"times {H} heads is not "
         f"--decoder-embed-dim {d}")
    if kind in ("mixtral", "olmoe"):
        need(moe_layers == list(range(L)), f"--moe-freq/--decoder-moe-freq (MoE layers {moe_layers})",
             f"leaves dense layers ({name}: every layer MoE)")
        step = 1
    else:
        step = next((n for n in range(1, L + 1) if moe_layers == [i for i in range(L) if (i + 1) % n == 0]), None)
        need(step is not None, f"--moe-freq/--decoder-moe-freq (MoE layers {moe_layers})", "is not every N-th")
    f = expert_width(a)
    config = dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=a["decoder_kv_heads"], max_position_embeddings=a["max_target_positions"],
                  rope_theta=a["rope_theta"], rms_norm_eps=a["rms_norm_eps"], num_experts_per_tok=k,
                  router_aux_loss_coef=a.get("moe_gate_loss_wt", 0.01), initializer_range=a["init_std"],
                  attention_dropout=a["attention_dropout"], hidden_act="silu",
                  tie_word_embeddings=bool(a.get("share_decoder_input_output_embed")), **specials)
    if kind == "mixtral":
        config.update(intermediate_size=f, num_local_experts=experts, head_dim=None if hd * H == d else hd,
                      sliding_window=None)
    else:
        config.update(num_experts=experts, norm_topk_prob=bool(renormalize))
    if kind in ("qwen2_moe", "qwen3_moe"):
        config.update(intermediate_size=a["decoder_ffn_embed_dim"], moe_intermediate_size=f,
                      decoder_sparse_step=step, mlp_only_layers=[], use_sliding_window=False)
    if kind == "qwen2_moe":
        config.update(shared_expert_intermediate_size=a.get("moe_shared_expert_ffn_dim") or f, qkv_bias=bool(qkv_bias))
    if kind == "qwen3_moe":
        config.update(attention_bias=bool(o_bias), **({} if hd * H == d else dict(head_dim=hd)))
    if kind == "olmoe":
        config.update(intermediate_size=f, attention_bias=bool(o_bias), clip_qkv=None)
    return kind, config, training_differences(a, kind)


def training_differences(a, kind):
    """What the exported model computes otherwise in training only (transformers trains its own way)."""
    cf = a.get("moe_capacity_factor", 1.0)
    out = ["balance loss: transformers' counts all k choices of every token, pooled over the layers (its uniform "
           "optimum is k, router_aux_loss_coef = --moe-gate-loss-wt); ours counts first choices per layer"]
    if cf:
        out.append(f"training capacity: this model --moe-capacity-factor {cf}; transformers' is dropless")
    if a.get("moe_z_loss_wt"):
        out.append(f"router z-loss --moe-z-loss-wt {a['moe_z_loss_wt']}: transformers' has none")
    if a.get("dropout"):
        out.append(f"--dropout {a['dropout']} on the residual branches: transformers' has none")
    if a.get("moe_gate_noise", "none") != "none":
        out.append(f"router noise {a['moe_gate_noise']}: " + ("Mixtral's router_jitter_noise multiplies the "
                                                             "block's input, left 0" if kind == "mixtral" else
                                                             "transformers' has none"))
    if a.get("moe_second_expert_policy", "all") != "all":
        out.append(f"second expert drawn ({a['moe_second_expert_policy']}): transformers' takes the best k")
    return out


def fairseq_flags(c, where):
    """Our model's flags (fairseq-train's argv after --arch moe_mixtral_lm) for the HF config c (config.json's dict),
    or a FlagError naming the field of `where` (config.json's path) our model cannot express."""
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise FlagError(f"{where}: model_type {kind!r} is none of {', '.join(FAMILIES)}")

    def need(ok, field, why):
        if not ok:
            raise FlagError(f"{where}: {field} = {c.get(field)!r} {why}: moe_mixtral_lm cannot express it")

    need(c.get("hidden_act", "silu") == "silu", "hidden_act", "is not silu")
    need(not c.get("rope_scaling"), "rope_scaling", "is set")
    need(c.get("sliding_window") is None or (kind != "mixtral" and not c.get("use_sliding_window")),
         "sliding_window", "is set")
    need(c.get("clip_qkv") is None, "clip_qkv", "is set")
    d, H, L = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    hd = c.get("head_dim") or d // H
    E = c["num_local_experts"] if kind == "mixtral" else c["num_experts"]
    k = c["num_experts_per_tok"]
    need(E > 0, "num_experts", "leaves no MoE layer")
    step = 1
    if kind in ("qwen2_moe", "qwen3_moe"):
        skip, step = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1)
        moe = [i for i in range(L) if i not in skip and (i + 1) % step == 0]
        step = next((n for n in range(1, L + 1) if moe == [i for i in range(L) if (i + 1) % n == 0]), None)
        need(step is not None, "mlp_only_layers", f"with decoder_sparse_step {c.get('decoder_sparse_step')} makes MoE "
             f"layers {moe}, not every N-th")
    f = c["moe_intermediate_size"] if kind in ("qwen2_moe", "qwen3_moe") else c["intermediate_size"]
    flags = ["--decoder-embed-dim", d, "--decoder-ffn-embed-dim", c["intermediate_size"], "--decoder-layers", L,
             "--decoder-attention-heads", H, "--decoder-kv-heads", c.get("num_key_value_heads") or H,
             "--rope-theta", c.get("rope_theta", 1e4), "--rms-norm-eps", c["rms_norm_eps"],
             "--init-std", c.get("initializer_range", 0.02), "--dropout", 0,
             "--attention-dropout", c.get("attention_dropout", 0.0), "--max-target-positions",
             c["max_position_embeddings"], "--moe-expert-count", E, "--moe-top-k", k, "--moe-expert-ffn-dim", f,
             "--moe-expert-kind", "swiglu", "--moe-freq", step, "--moe-capacity-factor", 0,
             "--moe-eval-capacity-token-fraction", 0, "--moe-gate-loss-wt", c.get("router_aux_loss_coef", 0.001)]
    if hd * H != d:
        flags += ["--decoder-head-dim", hd]
    renormalize = kind == "mixtral" or c.get("norm_topk_prob")
    if k == 1:
        flags += ["--moe-top1-weight", "one" if renormalize else "prob"]
    elif not renormalize:
        flags += ["--no-moe-topk-renormalize"]
    if kind == "qwen2_moe":
        if c.get("qkv_bias", True):
            flags += ["--qkv-bias"]
        if c.get("shared_expert_intermediate_size"):
            flags += ["--moe-shared-expert-count", 1, "--moe-shared-expert-ffn-dim",
                      c["shared_expert_intermediate_size"], "--moe-shared-expert-gate"]
    if kind in ("qwen3_moe", "olmoe"):
        flags += ["--qk-norm", "head" if kind == "qwen3_moe" else "full"] + (
            ["--attention-bias"] if c.get("attention_bias") else [])
    if c.get("tie_word_embeddings"):
        flags += ["--share-decoder-input-output-embed"]
    return [str(x) for x in flags]


def token_ids(c):
    """[the HF id of each fairseq index] of HF config c: fairseq's <s>, <pad>, </s>, <unk> (0-3) are HF's bos, pad,
    eos, unk where the config has them, then every other HF id in order. An id goes to one special only, eos first
    (fairseq's </s> ends every line, starts every block, stops generation), then bos, pad, unk: one that repeats an
    earlier one's id (Qwen's bos = eos) gets -1, as those HF lacks (a row of its own). A list of eos ids: the
    first."""
    V = c["vocab_size"]
    ids = [-1] * len(SPECIALS)
    for index in (2, 0, 1, 3):  # (eos, bos, pad, unk)
        i = c.get(SPECIALS[index])
        i = i[0] if isinstance(i, list) and i else i
        ids[index] = i if isinstance(i, int) and 0 <= i < V and i not in ids else -1
    taken = set(ids)
    return ids + [i for i in range(V) if i not in taken]


def specials_of(ids):
    """{bos_token_id: HF id or None, ...} of the fairseq specials under token_ids (None: ids is the identity)."""
    return {name: (None if ids[i] < 0 else ids[i]) for i, name in enumerate(SPECIALS[:3])}


def check_ids(ids, rows, path):
    """ids (a hf_token_ids.json list) fits a model of `rows` embedding rows: every HF id once, 0..n-1."""
    hf = sorted(i for i in ids if i >= 0)
    if len(ids) != rows or hf != list(range(len(hf))) or any(i < -1 for i in ids):
        raise FlagError(f"{path}: not the token ids of this model ({len(ids)} entries for {rows} rows, the HF ids "
                        f"must be 0..n-1 once each)")


def _rows(t, ids, to_hf):
    """t's rows [V_fairseq, ...] as HF's [V_hf, ...] (to_hf) or back (the rows HF lacks zero)."""
    ours = torch.tensor([i for i, h in enumerate(ids) if h >= 0])
    theirs = torch.tensor([h for h in ids if h >= 0])
    if to_hf:
        out = t.new_empty(len(theirs), *t.shape[1:])
        out[theirs] = t[ours]
    else:
        out = t.new_zeros(len(ids), *t.shape[1:])
        out[ours] = t[theirs]
    return out


def to_hf(ours, kind, ids=None):
    """Our state dict in the HF family's names (experts one module each, [out, in]); the vocabulary rows in HF's
    order where ids (token_ids) are given."""
    block, g, u, dn = BLOCKS.get(kind, QWEN_BLOCK)
    out = {}
    for key, t in ours.items():
        if key.endswith((".version", "_float_tensor")):
            continue
        m = _MOE.match(key)
        if m is None:
            if ids is not None and key.endswith(("embed_tokens.weight", "output_projection.weight")):
                t = _rows(t, ids, to_hf=True)
            out["lm_head.weight" if key == "decoder.output_projection.weight" else "model." + key[8:]] = t
            continue
        p, rest = f"model.layers.{m[1]}.{block}.", m[2]
        if rest == "gate.weight":
            out[p + "gate.weight"] = t
        elif rest == "shared_gate.weight":
            out[p + "shared_expert_gate.weight"] = t
        elif rest in ("experts.w1", "shared.w1"):  # [E, d, 2f] = (gate.T | up.T)
            f = t.shape[2] // 2
            names = [f"{p}experts.{e}." for e in range(t.shape[0])] if rest[0] == "e" else [p + "shared_expert."]
            for q, w in zip(names, t):
                out[q + (g if rest[0] == "e" else "gate_proj") + ".weight"] = w[:, :f].t().contiguous()
                out[q + (u if rest[0] == "e" else "up_proj") + ".weight"] = w[:, f:].t().contiguous()
        elif rest in ("experts.w2", "shared.w2"):  # [E, f, d] = down.T
            names = [f"{p}experts.{e}.{dn}" for e in range(t.shape[0])] if rest[0] == "e" else [
                p + "shared_expert.down_proj"]
            for q, w in zip(names, t):
                out[q + ".weight"] = w.t().contiguous()
        else:
            raise FlagError(f"{key}: an MoE weight transformers' {FAMILIES[kind]} has no place for")
    return out


def from_hf(theirs, kind, ids):
    """Our state dict from an HF family's (to_hf's inverse); the vocabulary rows in fairseq's order (token_ids)."""
    _, g, u, dn = BLOCKS.get(kind, QWEN_BLOCK)
    out, experts, shared = {}, {}, {}
    for key, t in theirs.items():
        m = _HF_MOE.match(key)
        if m is None:
            if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
                t = _rows(t, ids, to_hf=False)
            out["decoder.output_projection.weight" if key == "lm_head.weight" else "decoder." + key[6:]] = t
            continue
        q = f"decoder.layers.{m[1]}.fc1.moe."
        if m[2] == "gate.weight":
            out[q + "gate.weight"] = t
        elif m[2] == "shared_expert_gate.weight":
            out[q + "shared_gate.weight"] = t
        elif m[3] is not None:
            experts.setdefault(q, {})[(int(m[3]), m[4])] = t
        else:
            shared.setdefault(q, {})[(0, m[5])] = t
    for q, parts in experts.items():
        E = max(e for e, _ in parts) + 1
        out[q + "experts.w1"] = torch.stack([torch.cat([parts[e, g].t(), parts[e, u].t()], 1) for e in range(E)])
        out[q + "experts.w2"] = torch.stack([parts[e, dn].t() for e in range(E)])
    for q, parts in shared.items():
        out[q + "shared.w1"] = torch.cat([parts[0, "gate_proj"].t(), parts[0, "up_proj"].t()], 1)[None]
        out[q + "shared.w2"] = parts[0, "down_proj"].t()[None]
    return out
