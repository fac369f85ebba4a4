"""moe_mixtral_lm: the decoder of Mixtral (and Qwen2-MoE, Qwen3-MoE, OLMoE) with MoE blocks.

Its logits equal transformers' models given the same weights (Mixtral; Qwen3-MoE's per-head qk norm and head dim;
OLMoE's full qk norm; Qwen2-MoE's qkv bias and dense layers); one expert equals a dense SwiGLU LM written here as
plain per-token, per-head loops; step-by-step decoding (and a beam's reordering) equals the full forward; it trains
with fairseq-train and scores with fairseq-eval-lm; bad flags are refused by name.
"""
import math
import re
import warnings

import pytest
import torch

from fairseq_moe.errors import FlagError
from fairseq_moe.models.moe_ffn import moe_blocks

from tests.fairseq_moe.helpers import LM_DATA, USER_DIR, build, lm_train_argv, run_eval_lm, run_generate, run_train

# 4 heads sharing 2 kv heads, d 32, SwiGLU 64, 4 experts, k 2 (the tiny arch, narrower); dropless at eval.
SIZES = ("--decoder-attention-heads", "4", "--decoder-kv-heads", "2", "--moe-expert-count", "4")


def mixtral(data, tmp_path, *flags):
    """Our model as fairseq-train builds it from flags (lm_train_argv's sizes, then SIZES, then flags), at eval."""
    argv = lm_train_argv(data, tmp_path, *SIZES, *flags)
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
    _, model, _, _ = build(argv)
    return model.eval()


def tokens(model, seed=0, B=3, T=9):
    """[B, T] tokens of the model's vocabulary, the last row padded after 5."""
    dictionary = model.decoder.dictionary
    x = torch.randint(dictionary.nspecial, len(dictionary), (B, T), generator=torch.Generator().manual_seed(seed))
    x[-1, 5:] = dictionary.pad()
    return x


def from_hf(hf):
    """Our state dict from a transformers Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE state dict (keys: the notes' section 3).
    Experts: swiglu w1 [E, d, 2f] = (gate.T | up.T), w2 [E, f, d] = down.T."""
    s = hf.state_dict()
    out = {"decoder.embed_tokens.weight": s["model.embed_tokens.weight"], "decoder.norm.weight": s["model.norm.weight"],
           "decoder.output_projection.weight": s["lm_head.weight"]}
    for key, value in s.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.((input_layernorm|post_attention_layernorm|self_attn)\..*|"
                         r"mlp\.(gate|up|down)_proj\.weight)", key)  # (the last: a dense layer's MLP)
        if m:
            out[f"decoder.layers.{m[1]}.{m[2]}"] = value
    for i in range(hf.config.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}.fc1.moe."
        moe = next((p + b for b in ("block_sparse_moe.", "mlp.") if p + b + "gate.weight" in s), None)
        if moe is None:
            continue
        names = ("w1", "w3", "w2") if "block_sparse" in moe else ("gate_proj", "up_proj", "down_proj")
        E = s[moe + "gate.weight"].shape[0]
        gate, up, down = ([s[f"{moe}experts.{e}.{n}.weight"] for e in range(E)] for n in names)
        out[q + "gate.weight"] = s[moe + "gate.weight"]
        out[q + "experts.w1"] = torch.stack([torch.cat([g.t(), u.t()], 1) for g, u in zip(gate, up)])  # [E, d, 2f]
        out[q + "experts.w2"] = torch.stack([w.t() for w in down])  # [E, f, d]
        if s.get(moe + "shared_expert.gate_proj.weight", torch.empty(0)).numel():  # Qwen2-MoE's gated shared expert
            g, u, w = (s[f"{moe}shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down"))
            out[q + "shared.w1"], out[q + "shared.w2"] = torch.cat([g.t(), u.t()], 1)[None], w.t()[None]
            out[q + "shared_gate.weight"] = s[moe + "shared_expert_gate.weight"]
    return out


def hf_model(kind, dtype, **config):
    """A tiny transformers model of d 32, 2 layers, 4 heads, vocab 24 (the toy dictionary's), eval, in dtype; its
    routers scaled x50 (top-2 choices well apart) and its attention biases drawn (HF starts them at 0)."""
    transformers = pytest.importorskip("transformers")
    Config, Model = (getattr(transformers, f"{kind}{part}") for part in ("Config", "ForCausalLM"))
    common = dict(vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=1, attn_implementation="eager")
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (Qwen2-MoE's shared expert of width 0: "zero-element tensors")
        warnings.simplefilter("ignore")
        model = Model(Config(**{**common, **config})).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight",)) and "shared" not in name:
                p.mul_(50)
            elif name.endswith("_proj.bias"):
                p.normal_(0, 0.1)
    return model


def relative_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


def compare(ours, hf, dtype, tol):
    """Our logits and HF's on a batch with a right-padded row, at every real token."""
    ours.load_state_dict(from_hf(hf))  # strict: every parameter of ours comes from HF's
    ours.to(dtype)
    x = tokens(ours)
    real = x.ne(ours.decoder.dictionary.pad())
    with torch.no_grad():
        theirs = hf(x, attention_mask=real.long()).logits
        mine = ours(x)[0]
    assert mine.dtype == dtype
    assert relative_error(mine[real].double(), theirs[real].double()) < tol


# fp64: the router's logits and RMSNorm are fp32 on both sides; bf16: a few of its ulps (2^-8), the experts' sums
# in another order.
TOL = {torch.float32: 1e-5, torch.float64: 1e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype,kv_heads", [(torch.float32, 2), (torch.float64, 2), (torch.float32, 4),
                                            (torch.bfloat16, 2)], ids=["fp32", "fp64", "fp32_mha", "bf16"])
def test_mixtral_equals_transformers(lm_data_bin, tmp_path, dtype, kv_heads):
    hf = hf_model("Mixtral", dtype, num_key_value_heads=kv_heads, intermediate_size=64, num_local_experts=4,
                  num_experts_per_tok=2)
    compare(mixtral(lm_data_bin, tmp_path, "--decoder-kv-heads", str(kv_heads)), hf, dtype, TOL[dtype])


# norm_topk_prob False (Qwen2/Qwen3/OLMoE's default: the top-k probabilities as they are) is --no-moe-topk-renormalize.
@pytest.mark.parametrize("kind,config,flags", [
    # Qwen3-MoE: q/k RMSNorm per head; head dim 16 with 4 heads (H x hd = 64 != d = 32); layer 0 dense (SwiGLU 64)
    ("Qwen3Moe", dict(head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, rope_theta=1e4),
     ("--qk-norm", "head", "--decoder-head-dim", "16", "--moe-expert-ffn-dim", "16", "--decoder-moe-freq", "2",
      "--rms-norm-eps", "1e-6", "--rope-theta", "1e4")),
    # Qwen3-MoE's attention_bias: biases on q, k, v and o
    ("Qwen3Moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, attention_bias=True),
     ("--qk-norm", "head", "--attention-bias", "--moe-expert-ffn-dim", "16", "--rms-norm-eps", "1e-6",
      "--rope-theta", "1e4")),
    # OLMoE: q/k RMSNorm over the whole projection
    ("Olmoe", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, eos_token_id=2,
                   clip_qkv=None, rope_theta=1e4),
     ("--qk-norm", "full", "--moe-expert-ffn-dim", "16", "--rope-theta", "1e4")),
    # Qwen2-MoE: qkv bias (none on o); layer 0 dense; its shared expert of width 0 adds nothing
    ("Qwen2Moe", dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=0,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2),
     ("--qkv-bias", "--moe-expert-ffn-dim", "16", "--decoder-moe-freq", "2", "--rms-norm-eps", "1e-6",
      "--rope-theta", "1e4")),
    # Qwen2-MoE as it is: a wider shared expert whose output a sigmoid gate scales, top-k not renormalised
    ("Qwen2Moe", dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
     ("--qkv-bias", "--moe-expert-ffn-dim", "16", "--moe-shared-expert-count", "1", "--moe-shared-expert-ffn-dim",
      "48", "--moe-shared-expert-gate", "--no-moe-topk-renormalize", "--rms-norm-eps", "1e-6", "--rope-theta",
      "1e4")),
    # Qwen3-MoE and OLMoE with their default norm_topk_prob False (Qwen3 at top-3)
    ("Qwen3Moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=3,
                      norm_topk_prob=False),
     ("--qk-norm", "head", "--moe-expert-ffn-dim", "16", "--moe-top-k", "3", "--no-moe-topk-renormalize",
      "--rms-norm-eps", "1e-6", "--rope-theta", "1e4")),
    ("Olmoe", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, eos_token_id=2,
                   clip_qkv=None, rope_theta=1e4),
     ("--qk-norm", "full", "--moe-expert-ffn-dim", "16", "--no-moe-topk-renormalize", "--rope-theta", "1e4")),
], ids=["qwen3_moe", "qwen3_moe_attention_bias", "olmoe", "qwen2_moe_no_shared", "qwen2_moe", "qwen3_moe_raw_top3",
        "olmoe_raw"])
def test_other_moe_lms_equal_transformers(lm_data_bin, tmp_path, kind, config, flags):
    hf = hf_model(kind, torch.float32, **config)
    compare(mixtral(lm_data_bin, tmp_path, *flags), hf, torch.float32, TOL[torch.float32])


def loop_lm(state, x, pad, d, H, K, hd, eps, theta, qk_norm):
    """The logits [B, T, V] of a dense SwiGLU LM of `state` (ours, one expert in an MoE layer), plain per-token and
    per-head loops from the formulas, in fp64: embedding, per layer x += attn(rms(x)), x += swiglu(rms(x)), then
    rms and the projection. Rotary: pair (m, m + hd/2) of a head turned by t / theta^(2m / hd) at position t."""
    w = {k: v.double() for k, v in state.items()}
    get = lambda name, default=None: w.get(name, default)  # noqa: E731

    def rms(v, weight):
        return weight * v / math.sqrt(float((v * v).mean()) + eps)

    def turn(v, t):
        out = v.clone()
        for m in range(hd // 2):
            a = t / theta ** (2 * m / hd)
            out[m] = v[m] * math.cos(a) - v[m + hd // 2] * math.sin(a)
            out[m + hd // 2] = v[m + hd // 2] * math.cos(a) + v[m] * math.sin(a)
        return out

    def linear(name, v):
        return w[name + ".weight"] @ v + get(name + ".bias", 0)

    layers = len({k.split(".")[2] for k in w if k.startswith("decoder.layers.")})
    logits = torch.zeros(*x.shape, w["decoder.output_projection.weight"].shape[0], dtype=torch.float64)
    for b in range(x.shape[0]):
        T = int(x[b].ne(pad).sum())  # (right padding: the real tokens see none of it)
        h = [w["decoder.embed_tokens.weight"][x[b, t]] for t in range(T)]
        for i in range(layers):
            p = f"decoder.layers.{i}."
            qs, ks, vs = [], [], []
            for t in range(T):
                a = rms(h[t], w[p + "input_layernorm.weight"])
                q, k, v = (linear(p + f"self_attn.{n}_proj", a) for n in "qkv")
                if qk_norm == "full":
                    q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
                q, k, v = ([z[j * hd:(j + 1) * hd] for j in range(len(z) // hd)] for z in (q, k, v))
                if qk_norm == "head":
                    q = [rms(z, w[p + "self_attn.q_norm.weight"]) for z in q]
                    k = [rms(z, w[p + "self_attn.k_norm.weight"]) for z in k]
                qs.append([turn(z, t) for z in q]), ks.append([turn(z, t) for z in k]), vs.append(v)
            for t in range(T):
                heads = []
                for j in range(H):
                    g = j // (H // K)  # the kv head of query head j
                    s = torch.tensor([float(qs[t][j] @ ks[u][g]) / math.sqrt(hd) for u in range(t + 1)])
                    prob = torch.softmax(s, 0)
                    heads.append(sum(prob[u] * vs[u][g] for u in range(t + 1)))
                h[t] = h[t] + linear(p + "self_attn.o_proj", torch.cat(heads))
            for t in range(T):
                a = rms(h[t], w[p + "post_attention_layernorm.weight"])
                if p + "fc1.moe.experts.w1" in w:  # the one expert: w1 [1, d, 2f] = (gate | up), w2 [1, f, d]
                    f = w[p + "fc1.moe.experts.w2"].shape[1]
                    gate, up = a @ w[p + "fc1.moe.experts.w1"][0][:, :f], a @ w[p + "fc1.moe.experts.w1"][0][:, f:]
                    down = w[p + "fc1.moe.experts.w2"][0].t()
                else:
                    gate, up = linear(p + "mlp.gate_proj", a), linear(p + "mlp.up_proj", a)
                    down = w[p + "mlp.down_proj.weight"]
                h[t] = h[t] + down @ (gate * torch.sigmoid(gate) * up)
        for t in range(T):
            logits[b, t] = w["decoder.output_projection.weight"] @ rms(h[t], w["decoder.norm.weight"])
    return logits


@pytest.mark.parametrize("flags", [
    (),
    ("--qk-norm", "head", "--decoder-head-dim", "12", "--attention-bias", "--decoder-moe-freq", "2"),
    ("--qk-norm", "full", "--qkv-bias", "--decoder-kv-heads", "1", "--share-decoder-input-output-embed",
     "--rope-theta", "100"),
], ids=["mixtral", "qwen3_like_dense_layer", "olmoe_like_tied"])
def test_one_expert_equals_a_plain_loop(lm_data_bin, tmp_path, flags):
    """E=1, k=1, dropless: the MoE block is one SwiGLU; the whole LM against loops written from the formulas."""
    model = mixtral(lm_data_bin, tmp_path, "--moe-expert-count", "1", "--moe-top-k", "1", *flags)
    with torch.no_grad():  # biases and norms away from their init, so that each is seen
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    x = tokens(model)
    pad = model.decoder.dictionary.pad()
    state = model.state_dict()
    hd = int(flags[flags.index("--decoder-head-dim") + 1]) if "--decoder-head-dim" in flags else 8
    K = int(flags[flags.index("--decoder-kv-heads") + 1]) if "--decoder-kv-heads" in flags else 2
    qk_norm = flags[flags.index("--qk-norm") + 1] if "--qk-norm" in flags else "none"
    theta = float(flags[flags.index("--rope-theta") + 1]) if "--rope-theta" in flags else 1e6
    expected = loop_lm(state, x, pad, 32, 4, K, hd, 1e-5, theta, qk_norm)
    with torch.no_grad():
        y = model(x)[0].double()
    real = x.ne(pad)
    assert relative_error(y[real], expected[real]) < 1e-5
    assert (model.decoder.output_projection.weight is model.decoder.embed_tokens.weight) == (
        "--share-decoder-input-output-embed" in flags)


@pytest.mark.parametrize("flags", [(), ("--moe-expert-kind", "ffn", "--qk-norm", "head", "--decoder-moe-freq", "2")])
def test_incremental_decoding_equals_the_full_forward_and_reorders(lm_data_bin, tmp_path, flags):
    """Each step's logits are the full forward's at that position; after reorder_incremental_state(perm) (a beam
    search's) the steps go on as the full forward of the permuted batch."""
    model = mixtral(lm_data_bin, tmp_path, *flags)
    x = tokens(model, seed=1, B=3)
    x[-1] = x[0]  # (no padding: the permuted rows carry on)
    x[-1, 6:] = torch.flip(x[-1, 6:], (0,))
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad():
        full, full_perm = model(x)[0], model(x[perm])[0]
        state = {}
        steps = [model(x[:, :t + 1], incremental_state=state)[0][:, -1] for t in range(5)]
        model.decoder.reorder_incremental_state_scripting(state, perm)
        after = [model(x[perm, :t + 1], incremental_state=state)[0][:, -1] for t in range(5, x.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(after, 1), full_perm[:, 5:], rtol=1e-5, atol=1e-5)
    # A prompt of several tokens in one call, then one at a time: the same.
    with torch.no_grad():
        state = {}
        first = model(x[:, :4], incremental_state=state)[0]
        rest = model(x[:, :5], incremental_state=state)[0]
    torch.testing.assert_close(torch.cat([first, rest], 1), full[:, :5], rtol=1e-5, atol=1e-5)


def test_moe_blocks_are_found_by_the_package_names(lm_data_bin, tmp_path):
    model = mixtral(lm_data_bin, tmp_path, "--decoder-layers", "4", "--decoder-moe-freq", "2")
    assert [name for name, _ in moe_blocks(model)] == ["decoder.layers.1.fc1", "decoder.layers.3.fc1"]
    state = model.state_dict()
    assert state["decoder.layers.1.fc1.moe.experts.w1"].shape == (4, 32, 128)  # swiglu: (gate | up), f = 64
    assert state["decoder.layers.1.fc1.moe.experts.w2"].shape == (4, 64, 32)
    assert "decoder.layers.0.mlp.gate_proj.weight" in state
    assert float(model.decoder.embed_tokens.weight[model.decoder.dictionary.pad()].detach().abs().sum()) == 0


@pytest.mark.parametrize("extra,flag", [
    (("--decoder-kv-heads", "3"), "--decoder-kv-heads 3 must divide --decoder-attention-heads 4"),
    (("--decoder-kv-heads", "0"), "--decoder-kv-heads must be >= 1"),
    (("--decoder-attention-heads", "5", "--decoder-kv-heads", "5"), "--decoder-embed-dim 32 is not a multiple of --decoder-attention-heads 5"),
    (("--decoder-head-dim", "7"), "--decoder-head-dim 7 must be even"),
    (("--rope-theta", "0"), "--rope-theta must be > 0"),
    (("--rms-norm-eps", "-1"), "--rms-norm-eps must be > 0"),
    (("--init-std", "0"), "--init-std must be > 0"),
    (("--dropout", "1"), r"--dropout must be in \[0, 1\)"),
    (("--attention-dropout", "-0.1"), "--attention-dropout must be in"),
    (("--moe-freq", "3", "--decoder-moe-freq", "0"), "--moe-freq 3"),
])
def test_bad_flags_are_named(lm_data_bin, tmp_path, extra, flag):
    with pytest.raises(FlagError, match=flag):
        mixtral(lm_data_bin, tmp_path, *extra)


def test_trains_then_eval_lm_and_generate_read_its_checkpoint(lm_data_bin, tmp_path):
    """A few updates of fairseq-train (the MoE task and criterion), then fairseq-eval-lm: its loss is the validation
    loss of the same checkpoint; fairseq-generate (--task language_modeling, beam 2) continues each sentence's first two
    tokens."""
    argv = lm_train_argv(lm_data_bin, tmp_path, *SIZES, "--max-update", "3", "--required-batch-size-multiple", "1")
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
    run_train(argv)
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 3
    assert state["model"]["decoder.layers.1.fc1.moe.experts.w1"].shape == (4, 32, 128)
    result = run_eval_lm(lm_data_bin, tmp_path / "checkpoint_last.pt")
    assert float(result["loss"]) == pytest.approx(state["extra_state"]["val_loss"], abs=5.1e-4)
    scorer = run_generate([lm_data_bin, "--user-dir", USER_DIR, "--path", str(tmp_path / "checkpoint_last.pt"),
                           "--task", "language_modeling", *LM_DATA, "--gen-subset", "valid", "--beam", "2",
                           "--max-len-b", "5", "--prefix-size", "2", "--max-tokens", "400", "--cpu"])
    assert scorer.stat.predlen > 0


def test_beam_search_scores_are_the_full_forward_log_probs(lm_data_bin, tmp_path):
    """fairseq's SequenceGenerator (what fairseq-generate and -interactive run), beam 3 after a forced prefix: every
    hypothesis' positional scores are the log-probabilities of the full forward of its tokens (the cache reordered
    between the steps as the beams move)."""
    from fairseq.sequence_generator import SequenceGenerator

    model = mixtral(lm_data_bin, tmp_path)
    dictionary = model.decoder.dictionary
    prefix = tokens(model, seed=3, B=2, T=3)
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=8)
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": torch.full((2,), 3)}}
    with torch.no_grad():
        hypos = generator.generate([model], sample, prefix_tokens=prefix)
        for b, beam in enumerate(hypos):
            assert len(beam) == 3 and beam[0]["tokens"][:3].tolist() == prefix[b].tolist()
            for hypo in beam:
                y = hypo["tokens"]  # [L], the last eos
                inputs = torch.cat([y.new_tensor([dictionary.eos()]), y[:-1]])[None]
                lprobs = torch.log_softmax(model(inputs)[0][0].float(), -1).gather(1, y[:, None])[:, 0]
                torch.testing.assert_close(hypo["positional_scores"], lprobs, rtol=1e-4, atol=1e-4)


def test_expert_kind_ffn_trains(lm_data_bin, tmp_path):
    """--moe-expert-kind ffn: experts act(x W1 + b1) W2 + b2 with --activation-fn (silu here by default)."""
    argv = lm_train_argv(lm_data_bin, tmp_path, *SIZES, "--max-update", "2", "--moe-expert-kind", "ffn",
                         "--activation-fn", "gelu", "--no-save")
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
    _, model, _, _ = build(argv)
    block = moe_blocks(model)[0][1].moe
    assert block.cfg.expert_kind == "ffn" and block.cfg.activation == "gelu" and block.experts.b1 is not None
    run_train(argv)


TWO_RANKS = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9", "--moe-capacity-factor", "0",
             "--max-update", "3", "--required-batch-size-multiple", "1")


@pytest.mark.slow
def test_two_ranks_with_the_experts_spread_equal_one_process(lm_data_bin, tmp_path):
    """2 gloo ranks (2 experts each) against one process with --update-freq 2: the same parameters after 3 updates."""
    import os
    import subprocess
    import sys

    from fairseq_moe.checkpoints import sets as shards
    from tests import warm
    from tests.fairseq_moe.helpers import assert_same_params

    def argv(save, *extra):
        a = lm_train_argv(lm_data_bin, save, *SIZES, *TWO_RANKS, *extra)
        a[a.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
        return a

    proc = warm.Popen([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-train",
                       *argv(tmp_path / "many")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    run_train(argv(tmp_path / "one", "--update-freq", "2"))  # (while the ranks run)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    a = torch.load(tmp_path / "one" / "checkpoint_last.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "many" / "checkpoint_last-rank-1.pt", weights_only=True)["model"]
    assert rank1["decoder.layers.0.fc1.moe.experts.w1"].shape[0] == 2  # (2 of the 4 experts on each rank)
    b = shards.assemble(str(tmp_path / "many" / "checkpoint_last"))
    assert b["extra_state"]["val_loss"] == pytest.approx(a["extra_state"]["val_loss"], rel=1e-5)
    assert_same_params(b["model"], a["model"])


def test_checkpoint_activations_give_the_same_loss_and_gradients(lm_data_bin, tmp_path):
    """--checkpoint-activations: every layer recomputed in the backward; the loss (router losses included) and every
    gradient as without it."""
    results = []
    for extra in ((), ("--checkpoint-activations",)):
        argv = lm_train_argv(lm_data_bin, tmp_path, *SIZES, *extra)
        argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
        task, model, criterion, _ = build(argv)
        model.train()
        x = tokens(model, seed=4)
        sample = {"net_input": {"src_tokens": x, "src_lengths": x.ne(1).sum(1)}, "target": torch.roll(x, -1, 1),
                  "ntokens": int(x.numel())}
        loss, _, _ = criterion(model, sample)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a)
    assert grads_a.keys() == grads_b.keys() and all(g is not None for g in grads_a.values())
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, msg=name)
