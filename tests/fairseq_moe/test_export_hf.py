"""NLLB-MoE against an implementation nobody here wrote: Hugging Face transformers' NllbMoeForConditionalGeneration
(a port of fairseq's nllb branch). A tiny random NllbMoe is written in the layout of fairseq's checkpoints (the
inverse of transformers' own conversion script, convert_nllb_moe_sharded_original_checkpoint_to_pytorch.py:
NAME-shared.pt and one NAME-rank-E.pt per expert, as NLLB-MoE 54B ships), converted by convert_moe_branch, and
the converted model's logits equal transformers' on the same tokens: with nothing dropped, with tokens dropped at
capacity (sentence by sentence, NLLB's capacity rounding), with expert output masking at eval, and with NLLB's
task (translation_multi_simple_epoch: moe_translation_multi_simple_epoch after the conversion). Skipped without
transformers (the test extra installs it)."""
import argparse
import json

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe import convert_moe_branch

from tests.fairseq_moe.helpers import ML_ARGS, run_train, tail, train_argv

transformers = pytest.importorskip("transformers")

E = 4
# transformers' names -> fairseq's (the inverse of rename_fairseq_keys in transformers' conversion script)
RENAMES = ((".ffn.router.classifier.", ".moe_layer.gate.wg."), (".ffn.fc1.", ".fc1."), (".ffn.fc2.", ".fc2."),
           (".cross_attention_layer_norm.", ".encoder_attn_layer_norm."), (".cross_attention.", ".encoder_attn."),
           (".ff_layer_norm.", ".final_layer_norm."))


@pytest.fixture(scope="module")
def fairseq_cfg(data_bin, ml_data_bin, tmp_path_factory):
    """{task: (its data, a complete fairseq checkpoint of ours after 1 update, whose config is edited)}: translation
    on the toy corpus, and translation_multi_simple_epoch (NLLB's task) on the toy two-direction one."""
    out = {}
    for task, data, extra in (("translation", data_bin, ()), ("translation_multi_simple_epoch", ml_data_bin,
                                                               (*ML_ARGS, "--share-all-embeddings"))):
        folder = tmp_path_factory.mktemp(task)
        run_train(train_argv(data, folder, "--max-update", "1", "--moe-expert-count", str(E), *extra))
        out[task] = data, torch.load(folder / "checkpoint_last.pt", weights_only=True)
    return out


def tiny_nllb_moe(vocab, **changes):
    """A random NllbMoe of 4 + 4 layers (every second one MoE, 4 experts), eval mode, on the toy vocabulary."""
    config = transformers.NllbMoeConfig(**{**dict(
        vocab_size=vocab, d_model=16, encoder_layers=4, decoder_layers=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, num_experts=E, encoder_sparse_step=2,
        decoder_sparse_step=2, expert_capacity=None, moe_eval_capacity_token_fraction=1.0, moe_token_dropout=0.0,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        activation_function="relu", pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        second_expert_policy="all", router_dtype="float32"), **changes})
    torch.manual_seed(0)
    model = transformers.NllbMoeForConditionalGeneration(config).eval()
    with torch.no_grad():  # (transformers initialises the biases and layer norms to 0 and 1: make them count)
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_as_fairseq(hf, ours, prefix, **moe_flags):
    """hf's weights as fairseq's nllb/moe branch saves them: PREFIX-shared.pt (all but the experts, the routers as
    LAYER.moe_layer.gate.wg.weight) and PREFIX-rank-E.pt (expert E as LAYER.moe_layer.experts.0), with a
    transformer's config of the same shape (pre-norm, shared embeddings, sinusoidal positions)."""
    c = hf.config
    shared, experts = {}, [{} for _ in range(E)]
    for key, t in hf.state_dict().items():
        if key in ("model.shared.weight", "lm_head.weight"):
            continue
        key = key.removeprefix("model.")
        for a, b in RENAMES:
            key = key.replace(a, b)
        if ".ffn.experts.expert_" in key:
            layer, rest = key.split(".ffn.experts.expert_")
            e, part = rest.split(".", 1)
            experts[int(e)][f"{layer}.moe_layer.experts.0.{part}"] = t.clone()
        else:
            shared[key] = t.clone()
    shared["decoder.output_projection.weight"] = shared["decoder.embed_tokens.weight"]
    for side in ("encoder", "decoder"):  # (fairseq saves them; transformers' script drops them)
        shared[f"{side}.version"] = torch.tensor([3.0])
    args = dict(vars(ours["cfg"]["model"]))
    args = {k: v for k, v in args.items() if not k.startswith("moe_")}
    args.update(
        _name="transformer", arch="transformer", encoder_embed_dim=c.d_model, decoder_embed_dim=c.d_model,
        encoder_ffn_embed_dim=c.encoder_ffn_dim, decoder_ffn_embed_dim=c.decoder_ffn_dim, decoder_input_dim=c.d_model,
        decoder_output_dim=c.d_model,
        encoder_layers=c.encoder_layers, decoder_layers=c.decoder_layers,
        encoder_attention_heads=c.encoder_attention_heads, decoder_attention_heads=c.decoder_attention_heads,
        encoder_normalize_before=True, decoder_normalize_before=True, share_all_embeddings=True,
        share_decoder_input_output_embed=True, encoder_learned_pos=False, decoder_learned_pos=False,
        layernorm_embedding=False, no_scale_embedding=False, activation_fn="relu", dropout=0.0,
        moe_expert_count=E, moe_freq=c.encoder_sparse_step, moe_top1_expert=False, moe_gating_use_fp32=True,
        moe_second_expert_policy="all", moe_normalize_gate_prob_before_dropping=False,
        moe_batch_prioritized_routing=False, use_moe_pad_mask=not c.router_ignore_padding_tokens,  # (its default)
        moe_eom=c.moe_token_dropout, moe_fom=0.0,
        moe_eval_capacity_token_fraction=c.moe_eval_capacity_token_fraction, **moe_flags)
    cfg = dict(ours["cfg"], model=argparse.Namespace(**args))
    task = cfg["task"]
    legacy = isinstance(task, argparse.Namespace)  # (an argparse task: fairseq keeps its Namespace)
    task = {k: v for k, v in (vars(task) if legacy else task).items() if not k.startswith("moe_")}
    task["_name"] = task["_name"].removeprefix("moe_")
    if legacy:
        task["task"] = task["_name"]
    cfg["task"] = argparse.Namespace(**task) if legacy else task
    common = {k: v for k, v in ours.items() if k not in ("model", "cfg", "last_optimizer_state")}
    torch.save(dict(common, model=shared, cfg=cfg), f"{prefix}-shared.pt")
    for e in range(E):
        torch.save(dict(common, model=experts[e], cfg=cfg), f"{prefix}-rank-{e}.pt")


def logits(hf, ours, src, prev):
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=src.ne(1).long(), decoder_input_ids=prev).logits
        mine = ours(src, src.ne(1).sum(1), prev)[0]
    return theirs, mine


@pytest.mark.parametrize("task, changes", [
    ("translation", dict()),  # nothing dropped (NLLB's evaluation: fraction 1.0)
    ("translation", dict(moe_eval_capacity_token_fraction=0.25)),  # ceil(0.25 * T) per expert: tokens dropped
    ("translation", dict(moe_eval_capacity_token_fraction=-1.0)),  # the training capacity, 2 * ceil(T / E)
    ("translation", dict(moe_token_dropout=0.2)),  # expert output masking: x 0.8 at eval
    ("translation_multi_simple_epoch", dict(moe_token_dropout=0.2, moe_eval_capacity_token_fraction=0.25)),
    # sources left-padded, NLLB's --use-moe-pad-mask (NllbMoe's default): the padding is routed nowhere, but the
    # capacity ceil(0.25 * T) counts it
    ("translation", dict(moe_eval_capacity_token_fraction=0.25, padded=True)),
])
def test_a_converted_nllb_moe_computes_what_transformers_computes(fairseq_cfg, tmp_path, task, changes):
    data, saved = fairseq_cfg[task]
    vocab = saved["model"]["encoder.embed_tokens.weight"].shape[0]
    changes = dict(changes)
    padded = changes.pop("padded", False)
    hf = tiny_nllb_moe(vocab, **changes)
    write_as_fairseq(hf, saved, str(tmp_path / "nllb"))
    out = tmp_path / "converted.pt"
    assert convert_moe_branch.main([str(tmp_path / "nllb"), str(out)]) == 0
    (ours,), _, fairseq_task = checkpoint_utils.load_model_ensemble_and_task([str(out)], arg_overrides={"data": data})
    assert type(fairseq_task).__name__ == {"translation": "MoETranslationTask",
                                           "translation_multi_simple_epoch": "MoETranslationMultiSimpleEpochTask"}[task]
    assert len(fairseq_task.source_dictionary) == vocab
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, vocab, (3, 11), generator=g)
    if padded:
        src[0, :4], src[2, :2] = 1, 1
    prev = torch.cat([torch.full((3, 1), 2), torch.randint(4, vocab, (3, 8), generator=g)], 1)
    theirs, mine = logits(hf, ours.eval(), src, prev)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    if changes.get("moe_eval_capacity_token_fraction", 1.0) < 1:  # tokens were dropped, and it mattered
        full, _ = logits(tiny_nllb_moe(vocab, **dict(changes, moe_eval_capacity_token_fraction=1.0)), ours, src, prev)
        assert not torch.allclose(full, theirs, rtol=1e-3, atol=1e-3)


def greedy_in_transformers(hf, src, prefix, steps):
    """transformers' greedy search (its generate, incremental, with its cache) from decoder input prefix, fairseq's
    bans applied (never pad, no eos in the first steps if steps is a forced length): the tokens after prefix and
    the log-probability of each."""
    forced = {} if steps[0] is None else dict(min_new_tokens=steps[0])
    with torch.no_grad():
        out = hf.generate(input_ids=src, attention_mask=src.ne(1).long(), decoder_input_ids=prefix, num_beams=1,
                          do_sample=False, max_new_tokens=steps[1], suppress_tokens=[1], output_logits=True,
                          return_dict_in_generate=True, **forced)
    new = out.sequences[:, prefix.shape[1]:]
    return new, torch.stack(out.logits, 1).float().log_softmax(-1).gather(2, new[..., None])[..., 0]


@pytest.mark.parametrize("task, changes", [
    # 3 sentences at capacity, sentence by sentence: ceil(0.25 * 3) = 1 slot per expert at each decoder step
    ("translation", dict(moe_token_dropout=0.2, moe_eval_capacity_token_fraction=0.25)),
    # NLLB's evaluation (nothing dropped) with its task: a batch of the test set, left-padded, the target's
    # language token as the prefix
    ("translation_multi_simple_epoch", dict(moe_token_dropout=0.2)),
])
def test_a_converted_nllb_moe_generates_what_transformers_generates(fairseq_cfg, tmp_path, task, changes):
    """Greedy search through fairseq's generator, as fairseq-generate runs it (the task's build_generator and
    inference_step, --beam 1, incremental decoding with its cache) against transformers' generate: the same
    tokens, and each token's log-probability equal to 1e-5."""
    from fairseq.dataclass.configs import GenerationConfig

    data, saved = fairseq_cfg[task]
    vocab = saved["model"]["encoder.embed_tokens.weight"].shape[0]
    def peaked(**settings):  # (a random model's log-probabilities are nearly flat: peaked ones make choices count)
        model = tiny_nllb_moe(vocab, **settings)
        with torch.no_grad():
            model.model.shared.weight.mul_(10)
        return model

    hf = peaked(**changes)
    write_as_fairseq(hf, saved, str(tmp_path / "nllb"))
    assert convert_moe_branch.main([str(tmp_path / "nllb"), str(tmp_path / "converted.pt")]) == 0
    overrides = {"data": data} if task == "translation" else {"data": data, "source_lang": "en", "target_lang": "yy"}
    (ours,), _, fairseq_task = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "converted.pt")],
                                                                            arg_overrides=overrides)
    if task == "translation":  # forced length 6: every sentence stays in the batch (fairseq drops finished ones)
        generation = GenerationConfig(beam=1, min_len=6, max_len_a=0, max_len_b=6)
        src = torch.randint(4, vocab, (3, 11), generator=torch.Generator().manual_seed(1))
        src[:, -1] = 2
        sample = {"id": torch.arange(3), "net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 11)}}
        prefix, steps = torch.full((3, 1), 2), (6, 6)
    else:
        generation = GenerationConfig(beam=1, max_len_a=0, max_len_b=12)
        fairseq_task.load_dataset("test")
        sample = next(iter(fairseq_task.get_batch_iterator(fairseq_task.dataset("test"), max_sentences=6)
                           .next_epoch_itr(shuffle=False)))
        src = sample["net_input"]["src_tokens"]
        assert src.eq(1).any()  # (left-padded)
        langtok = fairseq_task.source_dictionary.index("__yy__")
        prefix, steps = torch.tensor([[2, langtok]]).expand(len(src), 2), (None, 11)
    hyps = fairseq_task.inference_step(fairseq_task.build_generator([ours.eval()], generation), [ours], sample)
    tokens, scores = greedy_in_transformers(hf, src, prefix, steps)
    for hyp, theirs, their_scores in zip(hyps, tokens, scores):
        mine, my_scores = hyp[0]["tokens"][prefix.shape[1] - 1:], hyp[0]["positional_scores"][prefix.shape[1] - 1:]
        if len(mine) > steps[1]:  # (fairseq's eos at its maximum length, forced: not transformers' choice)
            mine, my_scores = mine[:-1], my_scores[:-1]
        n = len(mine)
        assert mine.tolist() == theirs[:n].tolist()
        torch.testing.assert_close(my_scores, their_scores[:n], rtol=1e-5, atol=1e-5)
        assert theirs[n:].eq(1).all()  # (transformers pads a sentence after its eos)
    if changes.get("moe_eval_capacity_token_fraction", 1.0) < 1:  # tokens were dropped, and it mattered
        _, full = greedy_in_transformers(peaked(**dict(changes, moe_eval_capacity_token_fraction=1.0)), src, prefix,
                                         steps)
        assert not torch.allclose(full, scores, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_a_converted_multilingual_nllb_moe_generates_on_two_ranks_as_on_one(fairseq_cfg, tmp_path):
    """fairseq-generate of the converted model with NLLB's task, en -> yy: on 2 ranks (2 experts each, the test
    sentences split between them) every sentence's lines and the BLEU line are one process's."""
    from tests.fairseq_moe.hooks.test_spread import assert_same, generate

    data, saved = fairseq_cfg["translation_multi_simple_epoch"]
    hf = tiny_nllb_moe(saved["model"]["encoder.embed_tokens.weight"].shape[0], moe_token_dropout=0.2)
    write_as_fairseq(hf, saved, str(tmp_path / "nllb"))
    assert convert_moe_branch.main([str(tmp_path / "nllb"), str(tmp_path / "converted.pt")]) == 0
    runs = [generate(data, tmp_path / "converted.pt", W, *ML_ARGS, "--source-lang", "en", "--target-lang", "yy")
            for W in (1, 2)]
    for run in runs:
        assert run.returncode == 0, tail(run.stderr)
    assert_same(runs[0].stdout, runs[1].stdout, count=12)


def test_convert_export_convert_is_bit_identical(fairseq_cfg, tmp_path):
    """transformers' model -> fairseq's layout -> convert_moe_branch -> export_hf -> transformers' model again: the
    same tensors, bit for bit; and once more through fairseq's layout and the converter: our checkpoint again."""
    from fairseq_moe import export_hf

    data, saved = fairseq_cfg["translation_multi_simple_epoch"]
    hf = tiny_nllb_moe(saved["model"]["encoder.embed_tokens.weight"].shape[0], moe_token_dropout=0.2,
                       moe_eval_capacity_token_fraction=0.25)
    write_as_fairseq(hf, saved, str(tmp_path / "nllb"))
    assert convert_moe_branch.main([str(tmp_path / "nllb"), str(tmp_path / "ours.pt")]) == 0
    assert export_hf.main([str(tmp_path / "ours.pt"), str(tmp_path / "hf"), "--data", data]) == 0
    again = transformers.NllbMoeForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    a, b = hf.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("num_experts", "encoder_sparse_step", "decoder_sparse_step", "moe_token_dropout",
                "moe_eval_capacity_token_fraction", "d_model", "encoder_layers", "decoder_ffn_dim", "vocab_size"):
        assert getattr(again.config, key) == getattr(hf.config, key), key
    vocab = json.loads((tmp_path / "hf" / "vocab.json").read_text())
    assert len(vocab) == hf.config.vocab_size and vocab["<pad>"] == 1 and "__xx__" in vocab  # (its language tokens)
    write_as_fairseq(again, saved, str(tmp_path / "back"))
    assert convert_moe_branch.main([str(tmp_path / "back"), str(tmp_path / "ours2.pt")]) == 0
    first, second = (torch.load(tmp_path / name, weights_only=True)["model"] for name in ("ours.pt", "ours2.pt"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


NLLB_LIKE = ("--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
             "--moe-capacity-rounding", "per_choice", "--moe-token-priority", "sentence", "--moe-eom", "0.1",
             "--moe-eval-capacity-token-fraction", "0.25", "--moe-freq", "1", "--encoder-layers", "2",
             "--decoder-layers", "2", "--use-moe-pad-mask", "--moe-capacity-counts-padding")


def test_an_exported_model_of_ours_computes_in_transformers_what_it_computes_here(data_bin, tmp_path, capsys):
    """A model trained here with flags NllbMoe can express (2 updates; every layer MoE; tokens dropped at
    evaluation, sentence by sentence; expert output masking; the pad mask, the padding counted for the capacity)
    gives transformers' NllbMoe its logits on left-padded sources; what differs in training only is listed."""
    from fairseq_moe import export_hf

    run_train(train_argv(data_bin, tmp_path / "save", "--max-update", "2", "--moe-expert-count", str(E), *NLLB_LIKE))
    assert export_hf.main([str(tmp_path / "save" / "checkpoint_last.pt"), str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert "expert output masking 0.1" in printed and "training capacity" not in printed  # (CF 1, per_choice)
    hf = transformers.NllbMoeForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    (ours,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "save" / "checkpoint_last.pt")])
    g = torch.Generator().manual_seed(2)
    src = torch.randint(4, hf.config.vocab_size, (3, 13), generator=g)
    src[1, :5] = 1
    prev = torch.cat([torch.full((3, 1), 2), torch.randint(4, hf.config.vocab_size, (3, 7), generator=g)], 1)
    theirs, mine = logits(hf, ours.eval(), src, prev)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_what_nllb_moe_cannot_express_is_refused_by_name(data_bin, trained_checkpoint, tmp_path, capsys):
    """Our tiny model is post-norm: one line naming the flag, nothing written; a folder that exists is not
    overwritten; a model trained with capacity rounded once names that."""
    from fairseq_moe import export_hf

    def fails(ckpt, out, match):
        assert export_hf.main([str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.export_hf: error: ") and match in err, err
        assert len(err.strip().splitlines()) == 1

    fails(trained_checkpoint, tmp_path / "hf", "--encoder-normalize-before is off (post-norm layers): NllbMoe cannot")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    (tmp_path / "taken").mkdir()
    fails(trained_checkpoint, tmp_path / "taken", "taken exists")
    flags = [f for f in NLLB_LIKE if f not in ("--moe-token-priority", "sentence")]
    run_train(train_argv(data_bin, tmp_path / "save", "--max-update", "1", "--moe-expert-count", str(E), *flags))
    fails(tmp_path / "save" / "checkpoint_last.pt", tmp_path / "hf", "--moe-token-priority position queues tokens")
    flags = [f for f in NLLB_LIKE if f != "--moe-capacity-counts-padding"]
    run_train(train_argv(data_bin, tmp_path / "save1", "--max-update", "1", "--moe-expert-count", str(E), *flags))
    fails(tmp_path / "save1" / "checkpoint_last.pt", tmp_path / "hf", "--use-moe-pad-mask without "
          "--moe-capacity-counts-padding, with tokens dropped at evaluation, counts the real tokens only")
    # transformers keeps the first batch's 2 * ceil(T / E) for every later batch: a fraction < 0 is refused
    run_train(train_argv(data_bin, tmp_path / "save2", "--max-update", "1", "--moe-expert-count", str(E),
                         *NLLB_LIKE, "--moe-eval-capacity-token-fraction", "-1"))
    fails(tmp_path / "save2" / "checkpoint_last.pt", tmp_path / "hf", "--moe-eval-capacity-token-fraction -1.0 "
          "takes the training capacity at evaluation")
    # NllbMoe has one num_experts: a model whose MoE layers have their own counts is refused, by the flag
    counts = f"{E},{E},{2 * E},{2 * E}"  # (NLLB_LIKE: every layer MoE, two a side)
    run_train(train_argv(data_bin, tmp_path / "save3", "--max-update", "1", *NLLB_LIKE, "--moe-expert-count", counts))
    fails(tmp_path / "save3" / "checkpoint_last.pt", tmp_path / "hf", f"--moe-expert-count {counts} gives its MoE "
          "layers different expert counts")
    # NllbMoe's experts are FFNs with biases: swiglu experts are refused, by the flag
    run_train(train_argv(data_bin, tmp_path / "save4", "--max-update", "1", *NLLB_LIKE, "--moe-expert-count", str(E),
                         "--moe-expert-kind", "swiglu"))
    fails(tmp_path / "save4" / "checkpoint_last.pt", tmp_path / "hf", "--moe-expert-kind swiglu is not ffn")
