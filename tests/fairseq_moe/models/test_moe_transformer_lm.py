"""moe_transformer_lm: fairseq's transformer_lm with MoE layers, trained, evaluated and decoded.

The ladder: one expert (k=1, dropless) computes exactly the dense LM's FFN; a trained model's
fairseq-eval-lm loss equals its validation loss; step-by-step (incremental) decoding equals the full
forward; the experts spread over 2 gloo ranks train like one process, and the set they save is read
by fairseq-eval-lm on one process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe.models.moe_ffn import moe_blocks

from tests import warm
from tests.fairseq_moe.helpers import assert_same_params, build, eval_lm_argv, lm_train_argv, parse_train, run_eval_lm, run_train

# Dropless at eval (fraction 0): a token's output does not depend on the batch it is evaluated in,
# so fairseq-eval-lm, validation and incremental decoding see the same model.
EVAL_DROPLESS = ("--moe-eval-capacity-token-fraction", "0")
ROUNDED = 5.1e-4  # fairseq keeps the validation loss rounded to 3 decimals in extra_state


def tokens(model, seed=0):
    """[3, 9] tokens of the model's vocabulary, the last row padded after 5."""
    dictionary = model.decoder.dictionary
    x = torch.randint(dictionary.nspecial, len(dictionary), (3, 9), generator=torch.Generator().manual_seed(seed))
    x[2, 5:] = dictionary.pad()
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_equals_the_dense_lm(lm_data_bin, tmp_path, dtype):
    """E=1, k=1, dropless: the MoE block is fc2(relu(fc1(x))) with the dense LM's weights, exactly (in fp32); in
    bf16 (--bf16's model: the router fp32, the expert bf16) within bf16's rounding of fairseq's dense bf16 LM."""
    common = ("--decoder-moe-freq", "1", "--moe-expert-count", "1", "--moe-top-k", "1",
              "--moe-capacity-factor", "0", "--dropout", "0")
    _, moe, _, _ = build(lm_train_argv(lm_data_bin, tmp_path, *common))
    # Plain --arch transformer_lm takes its dataclass defaults, not base_lm_architecture's (which every
    # named transformer_lm arch and ours apply): give it those explicitly.
    argv = lm_train_argv(lm_data_bin, tmp_path, "--dropout", "0", "--decoder-input-dim", "32",
                         "--decoder-output-dim", "32", "--decoder-normalize-before")
    argv[argv.index("moe_language_modeling")] = "language_modeling"
    argv[argv.index("moe_transformer_lm_tiny")] = "transformer_lm"
    argv[argv.index("moe_cross_entropy")] = "cross_entropy"
    # transformer_lm is a dataclass model: build it from the config fairseq-train makes of the flags.
    cfg = convert_namespace_to_omegaconf(parse_train(argv))
    torch.manual_seed(0)
    dense = tasks.setup_task(cfg.task).build_model(cfg.model)
    assert sorted(name for name, _ in moe_blocks(moe)) == ["decoder.layers.0.fc1", "decoder.layers.1.fc1"]

    state = dense.state_dict()
    for i in range(2):
        p = f"decoder.layers.{i}."
        state[p + "fc1.moe.experts.w1"] = state.pop(p + "fc1.weight").t()[None]  # [1, d, f]
        state[p + "fc1.moe.experts.b1"] = state.pop(p + "fc1.bias")[None]
        state[p + "fc1.moe.experts.w2"] = state.pop(p + "fc2.weight").t()[None]  # [1, f, d]
        state[p + "fc1.moe.experts.b2"] = state.pop(p + "fc2.bias")[None]
        state[p + "fc1.moe.gate.weight"] = moe.state_dict()[p + "fc1.moe.gate.weight"]
    moe.load_state_dict(state)  # strict: every parameter of the MoE LM is accounted for
    moe.to(dtype), dense.to(dtype)
    x = tokens(dense)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for train in (True, False):
        moe.train(train), dense.train(train)
        y = moe(x)[0]
        assert y.dtype == dtype
        torch.testing.assert_close(y, dense(x)[0], rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def trained(lm_data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("lm_ckpt")
    stats = save / "load.jsonl"
    run_train(lm_train_argv(lm_data_bin, save, "--max-update", "6", *EVAL_DROPLESS, "--update-freq", "2",
                            "--moe-stats-file", str(stats), "--moe-stats-interval", "3"))
    return save, stats


def test_checkpoint_and_expert_load_file(trained):
    save, stats = trained
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 6
    assert state["model"]["decoder.layers.1.fc1.moe.experts.w1"].shape == (4, 32, 64)
    assert "decoder.layers.0.fc1.weight" in state["model"]  # layer 0 stays dense (--moe-freq 2)
    assert not hasattr(state["cfg"]["model"], "moe_ep")
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    assert [line["update"] for line in lines] == [3, 6]  # one line per interval, whatever --update-freq
    for line in lines:
        assert list(line["layers"]) == ["decoder.layers.1.fc1"]
        assert abs(sum(line["layers"]["decoder.layers.1.fc1"]) - 1) < 1e-9


def test_eval_lm_equals_the_validation_loss(trained, lm_data_bin):
    save, _ = trained
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    result = run_eval_lm(lm_data_bin, save / "checkpoint_last.pt")
    assert float(result["loss"]) == pytest.approx(state["extra_state"]["val_loss"], abs=ROUNDED)


@pytest.mark.slow
def test_incremental_decoding_equals_the_full_forward(trained):
    """Generation runs the MoE layers one token at a time (no padding mask of its own)."""
    save, _ = trained
    (model,), _ = checkpoint_utils.load_model_ensemble([str(save / "checkpoint_last.pt")])
    model.eval()
    x = tokens(model, seed=1)[:2]
    with torch.no_grad():
        full = model(x)[0]  # [B, L, V]
        state = {}
        steps = [model(x[:, :t + 1], incremental_state=state)[0][:, -1] for t in range(x.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_hash_routing_in_incremental_decoding(lm_data_bin, tmp_path):
    """--moe-routing hash: the decoder passes each position's previous token to its MoE layers, one
    token at a time when decoding step by step: the same experts, the same output as the full forward."""
    _, model, _, _ = build(lm_train_argv(lm_data_bin, tmp_path, "--moe-routing", "hash", "--moe-top-k", "1"))
    model.eval()
    x = tokens(model, seed=2)[:2]
    with torch.no_grad():
        full = model(x)[0]
        counts = [block.last_aux.counts.clone() for _, block in moe_blocks(model)]
        state = {}
        steps = [model(x[:, :t + 1], incremental_state=state)[0][:, -1] for t in range(x.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
    E = moe_blocks(model)[0][1].moe.cfg.num_experts
    assert counts[0].tolist() == torch.bincount(x.reshape(-1) % E, minlength=E).tolist()  # token id mod E


def test_moe_lm_task_needs_moe_layers(lm_data_bin, tmp_path):
    argv = lm_train_argv(lm_data_bin, tmp_path)
    argv[argv.index("moe_transformer_lm_tiny")] = "transformer_lm"
    with pytest.raises(ValueError, match="moe_language_modeling"):
        build(argv)


def test_scale_fc_refused(lm_data_bin, tmp_path):
    """NormFormer's layer norm sits between fc1 and fc2, inside what the experts compute."""
    with pytest.raises(ValueError, match="--scale-fc"):
        build(lm_train_argv(lm_data_bin, tmp_path, "--scale-fc"))


def test_no_moe_layer_names_the_flags(lm_data_bin, tmp_path):
    with pytest.raises(ValueError, match="--moe-freq 3 .*--decoder-moe-freq 0.* 2 decoder layers"):
        build(lm_train_argv(lm_data_bin, tmp_path, "--moe-freq", "3"))


TWO_RANKS = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9", "--moe-capacity-factor", "0",
             "--dropout", "0", "--max-update", "4", "--required-batch-size-multiple", "1", *EVAL_DROPLESS)


@pytest.fixture(scope="module")
def one_process_lm(lm_data_bin, tmp_path_factory):
    """TWO_RANKS on one process with --update-freq 2: the reference of the 2-rank runs."""
    one = tmp_path_factory.mktemp("one")
    run_train(lm_train_argv(lm_data_bin, one, *TWO_RANKS, "--update-freq", "2"))
    return torch.load(one / "checkpoint_last.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--checkpoint-activations",)])  # recomputed all-to-alls in backward
def test_two_ranks_equal_one_and_eval_lm_reads_the_set(lm_data_bin, tmp_path, extra, request):
    many = tmp_path / "many"
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-train",
           *lm_train_argv(lm_data_bin, many, *TWO_RANKS, *extra)]
    proc = warm.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    a = request.getfixturevalue("one_process_lm")  # trained here (once) while the ranks run
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    b = shards.assemble(str(many / "checkpoint_last"))
    assert b["extra_state"]["val_loss"] == pytest.approx(a["extra_state"]["val_loss"], rel=1e-5)
    assert_same_params(b["model"], a["model"])

    result = run_eval_lm(lm_data_bin, many / "checkpoint_last-shared.pt")
    assert float(result["loss"]) == pytest.approx(b["extra_state"]["val_loss"], abs=ROUNDED)
    if not extra:  # fairseq-eval-lm on the 2 ranks, the experts spread (spread.py): the loss of the whole set
        small = run_eval_lm(lm_data_bin, many / "checkpoint_last-shared.pt", "--max-tokens", "60")
        out = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-eval-lm",
                        *eval_lm_argv(lm_data_bin, many / "checkpoint_last.pt"), "--max-tokens", "60"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
        lines = [line for line in out.stderr.splitlines() if "Loss (base 2):" in line]
        assert out.returncode == 0 and len(lines) == 1, out.stderr[-3000:]
        loss = float(lines[0].split("Loss (base 2): ")[1].split(",")[0])
        assert loss == pytest.approx(float(small["loss"]), abs=1e-4)


def test_layers_to_keep_prunes_to_the_right_layers(lm_data_bin, tmp_path):
    """--decoder-layers-to-keep (LayerDrop pruning) builds the kept layers renumbered 0, 1, ...: the MoE
    layers among them must stay MoE, so that fairseq's pruned state dict loads into them."""
    _, full, _, _ = build(lm_train_argv(lm_data_bin, tmp_path, "--decoder-layers", "4"))
    assert sorted(name for name, _ in moe_blocks(full)) == ["decoder.layers.1.fc1", "decoder.layers.3.fc1"]
    for keep, moe in (("1,3", ["decoder.layers.0.fc1", "decoder.layers.1.fc1"]), ("0,3", ["decoder.layers.1.fc1"]),
                      ("3,0", ["decoder.layers.1.fc1"])):  # fairseq sorts the list
        _, pruned, _, args = build(lm_train_argv(lm_data_bin, tmp_path, "--decoder-layers", "4",
                                                 "--decoder-layers-to-keep", keep))
        assert sorted(name for name, _ in moe_blocks(pruned)) == moe
        pruned.load_state_dict(full.state_dict(), model_cfg=args)  # strict, after fairseq's pruning
        kept = sorted(int(i) for i in keep.split(","))
        for new, old in enumerate(kept):
            a, b = pruned.decoder.layers[new].state_dict(), full.decoder.layers[old].state_dict()
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--decoder-layers-to-keep 0,2"):
        build(lm_train_argv(lm_data_bin, tmp_path, "--decoder-layers", "4", "--decoder-layers-to-keep", "0,2"))
    # One expert count per MoE layer of the full model: the kept layers keep theirs.
    _, full, _, _ = build(lm_train_argv(lm_data_bin, tmp_path, "--decoder-layers", "4", "--moe-expert-count", "2,6"))
    _, pruned, _, args = build(lm_train_argv(lm_data_bin, tmp_path, "--decoder-layers", "4", "--moe-expert-count",
                                             "2,6", "--decoder-layers-to-keep", "0,3"))
    assert [(name, b.moe.cfg.num_experts) for name, b in moe_blocks(pruned)] == [("decoder.layers.1.fc1", 6)]
    pruned.load_state_dict(full.state_dict(), model_cfg=args)
