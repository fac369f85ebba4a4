"""python -m fairseq_moe.upcycle: a dense fairseq checkpoint made MoE computes what the dense one did, and
training continues from it (one process, and 2 ranks == 1 process); what cannot be upcycled is refused."""
import argparse
import os

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe import upcycle
from fairseq_moe.errors import CheckpointError

from tests.fairseq_moe.helpers import assert_same_params, lm_train_argv, run_train, train_argv
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched


def dense_argv(argv, arch, task, criterion):
    """Our MoE argv with fairseq's dense model, task and criterion in their place."""
    argv = list(argv)
    for ours, theirs in ((argv[argv.index("--arch") + 1], arch), (argv[argv.index("--task") + 1], task),
                         (argv[argv.index("--criterion") + 1], criterion)):
        argv[argv.index(ours)] = theirs
    return argv


@pytest.fixture(scope="module")
def dense_mt(data_bin, tmp_path_factory):
    """checkpoint_last.pt of fairseq's `transformer`, 3 updates (SGD, as COMMON) on the toy corpus."""
    folder = tmp_path_factory.mktemp("dense_mt")
    pairs = zip(COMMON[::2], COMMON[1::2])  # (COMMON is flag-value pairs)
    argv = [x for flag, value in pairs if not flag.startswith("--moe-") for x in (flag, value)]
    run_train(dense_argv(train_argv(data_bin, folder, *argv, "--max-update", "3"), "transformer", "translation",
                         "label_smoothed_cross_entropy"))
    return folder / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def dense_lm(lm_data_bin, tmp_path_factory):
    """checkpoint_last.pt of fairseq's plain `transformer_lm` made pre-norm (as its named archs), 3 updates."""
    folder = tmp_path_factory.mktemp("dense_lm")
    run_train(dense_argv(lm_train_argv(lm_data_bin, folder, "--max-update", "3", "--decoder-input-dim", "32",
                                       "--decoder-output-dim", "32", "--decoder-normalize-before"),
                         "transformer_lm", "language_modeling", "cross_entropy"))
    return folder / "checkpoint_last.pt"


def load(path):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return model.eval(), task


def logits(model, task, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = task.target_dictionary
    x = torch.randint(d.nspecial, len(d), (3, 9), generator=g)
    if getattr(task, "source_dictionary", None) is not None and hasattr(model, "encoder"):
        src = torch.randint(d.nspecial, len(d), (3, 7), generator=g)
        return model(src, torch.full((3,), 7), x)[0]
    x[2, 5:] = d.pad()
    return model(x)[0]


@pytest.mark.parametrize("kind, flags", [
    ("mt", ["--experts", "4", "--top-k", "2"]),
    ("mt", ["--experts", "2,6", "--top-k", "2"]),  # (each MoE layer its own count: encoder 2, decoder 6)
    ("mt", ["--experts", "4", "--top-k", "1", "--top1-weight", "one", "--moe-freq", "1"]),
    ("lm", ["--experts", "4", "--top-k", "2", "--moe-freq", "1"]),
    ("lm", ["--experts", "3", "--top-k", "1", "--top1-weight", "one", "--router", "zero"]),
    ("mt", ["--experts", "8", "--top-k", "4", "--granularity", "4"]),  # (2 copies, each 4 slices; 1 copy a token)
    ("lm", ["--experts", "6", "--top-k", "4", "--granularity", "2", "--moe-freq", "1"]),  # (3 copies, 2 chosen)
], ids=["mt-top2", "mt-top2-per-layer", "mt-top1", "lm-top2", "lm-top1-zero-router", "mt-granular-4",
        "lm-granular-2"])
def test_upcycled_model_computes_what_the_dense_one_did(request, tmp_path, kind, flags):
    dense = request.getfixturevalue(f"dense_{kind}")
    out = tmp_path / "moe.pt"
    assert upcycle.main([str(dense), str(out), *flags]) == 0
    (a, task), (b, _) = load(dense), load(out)
    assert type(b).__name__.startswith("MoE") and any(".moe.experts." in n for n in b.state_dict())
    if "2,6" in flags:
        assert [m.moe.experts.w1.shape[0] for n, m in b.named_modules() if n.endswith("fc1") and hasattr(m, "moe")] \
            == [2, 6]
    if "--granularity" in flags:  # experts of f / G hidden units; a copy's G slices share one router row
        G = int(flags[flags.index("--granularity") + 1])
        moe = next(m.moe for n, m in b.named_modules() if n.endswith("fc1") and hasattr(m, "moe"))
        dense_f = next(t for n, t in a.state_dict().items() if n.endswith("fc1.weight")).shape[0]
        assert moe.experts.w1.shape[2] == dense_f // G and moe.cfg.top_k == int(flags[flags.index("--top-k") + 1])
        rows = moe.gate.weight
        assert all(torch.equal(rows[e], rows[e - e % G]) for e in range(rows.shape[0]))
        assert not torch.equal(rows[0], rows[G])
    with torch.no_grad():
        torch.testing.assert_close(logits(b, task), logits(a, task), rtol=1e-5, atol=1e-5)
    # The control: copies with noise are different experts, and the model no longer computes the dense one.
    noisy = tmp_path / "noisy.pt"
    assert upcycle.main([str(dense), str(noisy), *flags, "--noise", "0.1"]) == 0
    with torch.no_grad():
        assert not torch.allclose(logits(load(noisy)[0], task), logits(a, task), rtol=1e-3, atol=1e-3)


def test_layers_copies_router_and_config(dense_mt, tmp_path):
    out = tmp_path / "moe.pt"
    done = upcycle.upcycle(str(dense_mt), str(out), 4, moe_freq=2, decoder_moe_freq=1, router="zero")
    assert sorted(done) == ["decoder.layers.0.fc1", "decoder.layers.1.fc1", "encoder.layers.1.fc1"]
    a, b = (torch.load(p, weights_only=True) for p in (dense_mt, out))
    fc1 = a["model"]["decoder.layers.0.fc1.weight"]  # [f, d]
    w1 = b["model"]["decoder.layers.0.fc1.moe.experts.w1"]  # [E, d, f]
    assert w1.shape == (4, *fc1.t().shape) and all(torch.equal(w1[e], fc1.t()) for e in range(4))
    assert not b["model"]["decoder.layers.0.fc1.moe.gate.weight"].any()  # --router zero
    assert "encoder.layers.0.fc1.weight" in b["model"] and "encoder.layers.1.fc1.weight" not in b["model"]
    assert "last_optimizer_state" not in b and b["extra_state"]["made_by"]["experts"] == 4
    model = b["cfg"]["model"]
    assert (model._name, model.moe_expert_count, model.decoder_moe_freq) == ("moe_transformer", 4, 1)
    assert (b["cfg"]["task"]["_name"], b["cfg"]["criterion"]["_name"]) == (
        "moe_translation", "moe_label_smoothed_cross_entropy")


def test_training_continues_on_one_process_and_two_ranks_alike(data_bin, dense_mt, tmp_path, caplog):
    """--finetune-from-model OUT.pt: 2 ranks (each cutting out its experts) == 1 process, from the same
    upcycled weights; resuming OUT.pt as if it had an optimizer state is refused by name."""
    out = tmp_path / "moe.pt"
    upcycle.main([str(dense_mt), str(out), "--experts", "4"])
    argv = (*COMMON, "--finetune-from-model", str(out))
    many, one = tmp_path / "many", tmp_path / "one"
    run = Launched(2, many, train_argv(data_bin, many, *argv))
    caplog.set_level("INFO")
    run_train(train_argv(data_bin, one, *argv, "--update-freq", "2"))
    assert f"Loaded checkpoint {out} (epoch" in caplog.text  # the upcycled weights, not a fresh model
    _, launched = run.result()
    assert f"Loaded checkpoint {out} (epoch" in launched.stdout + launched.stderr
    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    b = shards.assemble(str(many / "checkpoint_last"))
    assert [h["num_updates"] for h in a["optimizer_history"]][-1] == 4  # a fresh start from update 0
    assert_same_params(b["model"], a["model"])
    upcycled = torch.load(out, weights_only=True)["model"]
    key = "encoder.layers.1.fc1.moe.experts.w1"
    assert not torch.equal(a["model"][key], upcycled[key])  # it trained

    with pytest.raises(CheckpointError, match="upcycled from the dense .* --finetune-from-model"):
        run_train(train_argv(data_bin, tmp_path / "resume", *COMMON, "--restore-file", str(out)))


def test_refusals(dense_mt, dense_lm, data_bin, lm_data_bin, tmp_path, capsys):
    def fails(*argv, match):
        assert upcycle.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.upcycle: error:") and match in err, err

    out = tmp_path / "moe.pt"
    fails(dense_mt, out, "--experts", "4", "--moe-freq", "5", match="--moe-freq 5")
    fails(dense_lm, out, "--experts", "4", "--encoder-moe-freq", "1", match="--encoder-moe-freq")
    fails(dense_mt, out, "--experts", "2", "--top-k", "3", match="--top-k 3")
    fails(dense_mt, out, "--experts", "4,4,4", match="--experts 4,4,4 gives 3 counts for 2 MoE layers")
    fails(dense_mt, out, "--experts", "4,x", match="--experts '4,x' is not a count")
    fails(tmp_path / "missing.pt", out, "--experts", "2", match="missing.pt")
    fails(dense_mt, out, "--experts", "6", "--top-k", "2", "--granularity", "4",
          match="--granularity 4: --experts (6) and --top-k (2) must be multiples of it")
    fails(dense_mt, out, "--experts", "4", "--top-k", "2", "--granularity", "2", "--router", "zero",
          match="--granularity 2 with --router zero")
    fails(dense_mt, out, "--experts", "6", "--top-k", "3", "--granularity", "3",
          match="--granularity 3: the FFN width (decoder 64, encoder 64) must be a multiple of it")
    assert not out.exists()
    upcycle.main([str(dense_mt), str(out), "--experts", "2"])
    fails(dense_mt, out, "--experts", "2", match="exists")  # never overwritten
    fails(out, tmp_path / "again.pt", "--experts", "2", match="already has MoE layers")
    state = torch.load(dense_mt, weights_only=True)
    for section, change, match in (("model", {"_name": "lstm", "arch": "lstm"}, "'lstm' model"),
                                   ("task", {"_name": "multilingual_translation"}, "cfg.task._name = 'multilingual_translation'"),
                                   ("model", {"activation_fn": "tanh"}, "--activation-fn tanh")):
        cfg = dict(state["cfg"])
        old = cfg[section]
        cfg[section] = argparse.Namespace(**{**vars(old), **change}) if isinstance(old, argparse.Namespace) else \
            {**old, **change}
        bad = tmp_path / f"bad-{section}-{len(os.listdir(tmp_path))}.pt"
        torch.save(dict(state, cfg=cfg), bad)
        fails(bad, tmp_path / "x.pt", "--experts", "2", match=match)

    # A post-norm LM (plain --arch transformer_lm): no fairseq-train command line could fine-tune it as such.
    lm = torch.load(dense_lm, weights_only=True)
    post = tmp_path / "post-norm.pt"
    torch.save(dict(lm, cfg=dict(lm["cfg"], model={**lm["cfg"]["model"], "decoder_normalize_before": False})), post)
    fails(post, tmp_path / "y.pt", "--experts", "2", match="post-norm transformer_lm")

    # Fine-tuning the translation checkpoint on language-model data: named, before any weight is loaded.
    from tests.fairseq_moe.helpers import run_train as train
    with pytest.raises(CheckpointError, match="holds a translation model .* trains a language model"):
        train(lm_train_argv(lm_data_bin, tmp_path / "lm", "--finetune-from-model", str(out), "--max-update", "1"))
    # ... and with another expert count (an upcycled file has no expert manifest): named, the flag too.
    with pytest.raises(CheckpointError, match=r"moe.pt does not fit this model \(.* is \(2, .*"
                                              r"saved with --moe-expert-count 2, this run has --moe-expert-count 4"):
        train(train_argv(data_bin, tmp_path / "mt", "--finetune-from-model", str(out), "--max-update", "1",
                         "--moe-expert-count", "4"))


def test_check_fits_names_the_cause():
    """checkpoint.check_fits, the check of every state fairseq-train loads: task, dictionary, a missing optimizer
    state, and cosine gates from before the learned temperature; quiet where it cannot tell (no embed_tokens)."""
    from fairseq_moe.checkpoints.fits import check_fits

    mt = {"encoder.embed_tokens.weight": (10, 4), "decoder.embed_tokens.weight": (10, 4)}
    lm = {"decoder.embed_tokens.weight": (10, 4)}
    state = lambda keys, **kw: dict(model={n: torch.zeros(s) for n, s in keys.items()}, **kw)  # noqa: E731
    check_fits(state(mt), mt, False, "ok.pt")
    check_fits(state(mt), {"decoder.embed_tokens.embeddings.0.weight": (10, 4)}, False, "adaptive.pt")
    with pytest.raises(CheckpointError, match="holds a translation model .* trains a language model"):
        check_fits(state(mt), lm, False, "mt.pt")
    with pytest.raises(CheckpointError, match="its decoder dictionary has 12 symbols, this task's has 10"):
        check_fits(state({"decoder.embed_tokens.weight": (12, 4)}), lm, False, "lm.pt")
    with pytest.raises(CheckpointError, match=r"its decoder embeddings are 6 wide, this model's 4 "
                                              r"\(--decoder-embed-dim 6 as saved\)"):
        check_fits(state({"decoder.embed_tokens.weight": (10, 6)}), lm, False, "lm.pt")
    moe = "decoder.layers.1.fc1.moe."
    gate = {moe + "gate.weight": (4, 8), moe + "gate.proj.weight": (8, 4)}  # a cosine gate of before
    new = {**lm, **gate, moe + "gate.log_inv_temperature": (), moe + "gate.proj.bias": (8,)}
    with pytest.raises(CheckpointError, match="without the learned temperature .* --reset-optimizer"):
        check_fits(state({**lm, **gate}, last_optimizer_state={}), new, False, "old.pt")
    check_fits(state({**lm, **gate}, last_optimizer_state={}), new, True, "old.pt")
    # A linear gate resumed as a cosine one is another model, with or without --reset-optimizer.
    for reset in (False, True):
        with pytest.raises(CheckpointError,
                           match=f"linear.pt does not fit this model \\({moe}gate.weight is \\(4, 4\\) there"):
            check_fits(state({**lm, moe + "gate.weight": (4, 4)}, last_optimizer_state={}), new, reset, "linear.pt")
    # Experts: the expert count is compared where no manifest did (an upcycled file), the sizes always.
    experts = {moe + "experts.w1": 4}
    with pytest.raises(CheckpointError, match=r"experts.w1 is \(4, 4, 16\) there, \(2, 4, 8\) here"):
        check_fits(state({**lm, moe + "experts.w1": (4, 4, 16)}), {**lm, moe + "experts.w1": (2, 4, 8)}, True,
                   "x.pt", experts)
    with pytest.raises(CheckpointError, match=r"experts.w1 is \(2, 4, 8\) there, \(2, 4, 8\) here"):
        check_fits(state({**lm, moe + "experts.w1": (2, 4, 8)}), {**lm, moe + "experts.w1": (2, 4, 8)}, True,
                   "x.pt", experts)  # 2 experts saved, 4 in the model (2 of them on this rank)
