"""import_hf against transformers: tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models, saved by
save_pretrained, imported: our model's logits on the same tokens (mapped through hf_token_ids.json) equal transformers'
(fp32, eval, eager attention), greedy steps too; export_hf gives back every tensor bit for bit and the config's
fields; fairseq-eval-lm scores the imported model as transformers' loss does; what our model cannot express is
refused by the config field. Skipped without transformers (the test extra installs it)."""
import json
import warnings

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe import export_hf, import_hf

from tests.fairseq_moe.helpers import one_error_line, run_eval_lm

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

COMMON = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, attn_implementation="eager")
# The notes' section 6, with the special ids each family keeps by default (Mixtral: bos 1, eos 2, no pad) or some
FAMILIES = {
    "mixtral": ("Mixtral", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    # head dim 16 (H x hd = 64 != d); layer 0 dense; norm_topk_prob false; eos only
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, eos_token_id=5,
                                   attention_bias=True)),
    # q/k norm over the projections; pad 1, eos 2; top-1 renormalised (weight 1)
    "olmoe": ("Olmoe", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=1, norm_topk_prob=True,
                            pad_token_id=1, eos_token_id=2, clip_qkv=None)),
    # the gated shared expert, qkv biases, tied embeddings; bos = eos (Qwen1.5-MoE's), no pad
    "qwen2_moe": ("Qwen2Moe", dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=48,
                                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                   tie_word_embeddings=True, bos_token_id=6, eos_token_id=6)),
}


def hf_model(kind, **changes):
    """A tiny random model of the family, eval; routers x50 (choices well apart), biases and norms drawn."""
    prefix, config = FAMILIES[kind]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, f"{prefix}ForCausalLM")(
            getattr(transformers, f"{prefix}Config")(**{**COMMON, **config, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and "shared" not in name:
                p.mul_(50)
            elif name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, HF model, its folder, our checkpoint, hf_token_ids) of each family, imported once."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = hf_model(kind)
    hf.save_pretrained(root / "hf")
    assert import_hf.main([str(root / "hf"), str(root / "ours" / "ours.pt")]) == 0
    ids = json.loads((root / "ours" / "hf_token_ids.json").read_text())
    return kind, hf, root, root / "ours" / "ours.pt", ids


def load(path):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return model.eval(), task


def to_ours(ids, x):
    """HF token ids x -> fairseq's indices."""
    inverse = torch.full((max(ids) + 1,), -1, dtype=torch.long)
    inverse[torch.tensor([h for h in ids if h >= 0])] = torch.tensor([i for i, h in enumerate(ids) if h >= 0])
    return inverse[x], inverse


def test_imported_model_computes_what_transformers_computes(imported):
    kind, hf, _, ckpt, ids = imported
    ours, task = load(ckpt)
    # fairseq's </s> takes HF's eos first (it ends every line, starts every block), then <s> bos and <pad> pad
    want = [-1, -1, -1]
    for index, s in ((2, hf.config.eos_token_id), (0, hf.config.bos_token_id), (1, hf.config.pad_token_id)):
        want[index] = -1 if s is None or s in want else s
    assert ids[:3] == want
    assert len(task.dictionary) == len(ids) == COMMON["vocab_size"] + ids.count(-1)
    x = torch.randint(0, COMMON["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    x[x == ids[1]] = 3  # (no padding inside a sentence: fairseq masks its <pad> as padding wherever it is)
    mine_x, inverse = to_ours(ids, x)
    with torch.no_grad():
        theirs = hf(x).logits
        mine = ours(mine_x)[0][..., inverse]  # [B, T, V_hf]: the columns of HF's ids
    assert float((mine - theirs).abs().max() / theirs.abs().max()) < 1e-5
    # greedy decoding, ours step by step (its incremental state), HF's from the full forward: the same tokens
    with torch.no_grad():
        greedy, y, state = x[:, :3], mine_x[:, :3], {}
        for _ in range(4):
            greedy = torch.cat([greedy, hf(greedy).logits[:, -1:].argmax(-1)], 1)
            step = ours(y, incremental_state=state)[0][:, -1][..., inverse].argmax(-1)  # (HF ids)
            y = torch.cat([y, inverse[step][:, None]], 1)
    assert y.tolist() == inverse[greedy].tolist()


def test_import_then_export_is_bit_identical(imported, tmp_path):
    kind, hf, root, ckpt, _ = imported
    assert export_hf.main([str(ckpt), str(tmp_path / "back")]) == 0
    a, b = (safetensors.load_file(str(folder / "model.safetensors")) for folder in (root / "hf", tmp_path / "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, again = (json.loads((folder / "config.json").read_text()) for folder in (root / "hf", tmp_path / "back"))
    differ = {k: (v, again.get(k)) for k, v in first.items() if again.get(k) != v and k != "transformers_version"}
    if first.get("bos_token_id") == first.get("eos_token_id") is not None:  # (a bos shared with eos is not kept:
        assert differ.pop("bos_token_id") == (first["eos_token_id"], None)  # fairseq's <s> got a row of its own)
    assert not differ
    vocab = json.loads((tmp_path / "back" / "vocab.json").read_text())
    assert sorted(vocab.values()) == list(range(COMMON["vocab_size"])) and vocab["hf7"] == 7


@pytest.mark.parametrize("imported", ["mixtral"], indirect=True)
def test_eval_lm_scores_the_imported_model_as_transformers(imported, tmp_path):
    """fairseq-eval-lm on sentences of HF ids (binarised with the imported dict.txt, each after </s>, HF's eos):
    its loss is transformers' cross-entropy of the same tokens, with the logit 0 of each row added for a fairseq
    special HF lacks (Mixtral: <pad>, <unk>) among the choices: zero rows without a bias are not -inf."""
    from fairseq import options
    from fairseq_cli import preprocess

    _, hf, root, ckpt, ids = imported
    g = torch.Generator().manual_seed(2)
    sentences = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g) for n in (5, 8, 3, 6)]
    (tmp_path / "valid.txt").write_text("".join(" ".join(f"hf{i}" for i in s.tolist()) + "\n" for s in sentences))
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--only-source", "--srcdict", str(root / "ours" / "dict.txt"), "--validpref", str(tmp_path / "valid.txt"),
        "--destdir", str(tmp_path / "bin"), "--workers", "1"]))
    result = run_eval_lm(str(tmp_path / "bin"), ckpt)
    eos = hf.config.eos_token_id
    total, count = 0.0, 0
    with torch.no_grad():
        for s in sentences:
            x = torch.cat([torch.tensor([eos]), s])
            target = torch.cat([s, torch.tensor([eos])])
            logits = torch.cat([hf(x[None]).logits[0], torch.zeros(len(x), ids.count(-1))], 1)  # [T, V_hf + added]
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(target)
    assert float(result["loss"]) == pytest.approx(total / count / torch.log(torch.tensor(2.0)).item(), abs=1e-4)


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not silu"),
    (dict(sliding_window=16), "sliding_window = 16 is set"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
])
def test_what_our_model_cannot_express_is_refused_by_the_field(tmp_path, capsys, changes, match):
    hf_model("mixtral", **changes).save_pretrained(tmp_path / "hf")
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ours.pt")]) == 2
    line = one_error_line(capsys.readouterr().err, "python -m fairseq_moe.import_hf")
    assert match in line and "moe_mixtral_lm cannot express it" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("imported", ["mixtral"], indirect=True)
def test_weights_missing_from_hf_dir_are_refused(imported, tmp_path, capsys):
    """A weight that config.json asks for and the files lack (from_pretrained would draw it at random): refused."""
    import shutil

    _, _, root, _, _ = imported
    shutil.copytree(root / "hf", tmp_path / "hf")
    weights = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    safetensors.save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ours.pt")]) == 2
    line = one_error_line(capsys.readouterr().err, "python -m fairseq_moe.import_hf")
    assert "weights missing" in line and "experts.2.w3" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("imported", ["mixtral"], indirect=True)
def test_weights_of_another_shape_are_refused(imported, tmp_path, capsys):
    import shutil

    _, _, root, _, _ = imported
    shutil.copytree(root / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, intermediate_size=48)))
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "ours.pt")]) == 2
    line = one_error_line(capsys.readouterr().err, "python -m fairseq_moe.import_hf")
    assert "weights do not fit config.json" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("imported", ["mixtral"], indirect=True)
def test_nothing_is_overwritten(imported, tmp_path, capsys):
    _, _, root, _, _ = imported
    (tmp_path / "dict.txt").write_text("x 1\n")
    assert import_hf.main([str(root / "hf"), str(tmp_path / "ours.pt")]) == 2
    assert "dict.txt exists" in one_error_line(capsys.readouterr().err, "python -m fairseq_moe.import_hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dict.txt"]


def fine_tune_argv(root, ckpt, folder, save, seed, *extra):
    """fairseq-train's argv: 2 updates from the imported checkpoint (--finetune-from-model) with the flags import_hf
    chose (hf_lm.fairseq_flags), on sentences of random HF ids binarised with the imported dict.txt into folder."""
    from fairseq import options
    from fairseq_cli import preprocess

    from fairseq_moe.checkpoints import hf_lm
    from tests.fairseq_moe.helpers import lm_train_argv

    g = torch.Generator().manual_seed(seed)
    for split in ("train", "valid"):
        (folder / f"{split}.txt").write_text("".join(
            " ".join(f"hf{i}" for i in torch.randint(3, COMMON["vocab_size"], (7,), generator=g).tolist()) + "\n"
            for _ in range(20)))
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--only-source", "--srcdict", str(root / "ours" / "dict.txt"), "--trainpref", str(folder / "train.txt"),
        "--validpref", str(folder / "valid.txt"), "--destdir", str(folder / "bin"), "--workers", "1"]))
    flags = hf_lm.fairseq_flags(json.loads((root / "hf" / "config.json").read_text()), "config.json")
    argv = lm_train_argv(str(folder / "bin"), save, *flags, "--finetune-from-model", str(ckpt), "--max-update", "2",
                         "--required-batch-size-multiple", "1", *extra)
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm"
    return argv


@pytest.mark.parametrize("imported", ["qwen2_moe"], indirect=True)
def test_fairseq_train_continues_from_the_imported_checkpoint(imported, tmp_path, capsys):
    """fairseq-train --finetune-from-model OUT.pt with the flags import_hf chose (hf_lm.fairseq_flags): 2 updates."""
    from tests.fairseq_moe.helpers import run_train

    _, hf, root, ckpt, _ = imported
    run_train(fine_tune_argv(root, ckpt, tmp_path, tmp_path / "save", seed=4))
    trained = tmp_path / "save" / "checkpoint_last.pt"
    state = torch.load(trained, weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 2
    before = torch.load(ckpt, weights_only=True)["model"]
    assert state["model"].keys() == before.keys()
    # Back to transformers: the token ids are neither beside the checkpoint nor in the data folder: refused by
    # --token-ids (the HF ids would shift); given, the fine-tuned model's logits in transformers equal ours, and the
    # rows of fairseq's own specials (trained through the tied output) are left out with a note.
    assert export_hf.main([str(trained), str(tmp_path / "back")]) == 2
    assert "--token-ids" in one_error_line(capsys.readouterr().err, "python -m fairseq_moe.export_hf")
    assert not (tmp_path / "back").exists()
    assert export_hf.main([str(trained), str(tmp_path / "back"), "--token-ids",
                           str(root / "ours" / "hf_token_ids.json")]) == 0
    assert "note: the rows of <s>, <pad>, <unk>" in capsys.readouterr().out
    ids = json.loads((root / "ours" / "hf_token_ids.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ours, _ = load(trained)
    x = torch.randint(3, COMMON["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    x[x == 6] = 7
    mine_x, inverse = to_ours(ids, x)
    with torch.no_grad():
        theirs, mine = back(x).logits, ours(mine_x)[0][..., inverse]
    assert float((mine - theirs).abs().max() / theirs.abs().max()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("imported", ["qwen2_moe"], indirect=True)
def test_two_ranks_fine_tune_from_an_import(imported, tmp_path):
    """fairseq-train --finetune-from-model OUT.pt on 2 gloo ranks, the experts spread: each rank takes its experts out
    of the imported file (as from upcycle's); at learning rate 0 the set the ranks save holds the imported weights,
    every expert where it belongs."""
    from fairseq_moe.checkpoints import sets as shards
    from tests.fairseq_moe.hooks.test_trainer_expert_parallel import Launched

    _, hf, root, ckpt, _ = imported
    save = tmp_path / "save"
    Launched(2, save, fine_tune_argv(root, ckpt, tmp_path, save, 6, "--lr", "0", "--dropout", "0")).result()
    assert (save / "checkpoint_last-rank-1.pt").exists()
    after = shards.assemble(str(save / "checkpoint_last"))["model"]
    before = torch.load(ckpt, weights_only=True)["model"]
    assert after.keys() == before.keys()
    assert [k for k in before if not torch.equal(after[k].to(before[k].dtype), before[k])] == []
