"""fairseq-train, resume, fairseq-generate on a toy corpus; checkpoints load with weights_only=True."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fairseq import checkpoint_utils

from fairseq_moe.errors import CheckpointError

from tests.fairseq_moe.helpers import USER_DIR, run_generate, run_train, train_argv


@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("ckpt")
    stats = save / "load.jsonl"
    run_train(train_argv(data_bin, save, "--max-update", "6", "--moe-stats-file", str(stats),
                         "--moe-stats-interval", "3", "--moe-z-loss-wt", "0.001"))
    return save, stats


def test_checkpoint_loads_with_weights_only(trained):
    save, _ = trained
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 6
    assert state["model"]["encoder.layers.1.fc1.moe.experts.w1"].shape == (4, 32, 64)
    assert state["model"]["decoder.layers.1.fc1.moe.gate.weight"].dtype == torch.float32
    assert not hasattr(state["cfg"]["model"], "moe_ep")  # no process group in the saved config


@pytest.mark.slow
def test_without_the_plugin_the_checkpoint_is_refused(trained):
    """The registration is what makes it load: a bare torch refuses fairseq's pickled Namespace."""
    save, _ = trained
    code = f"import torch; torch.load({str(save / 'checkpoint_last.pt')!r}, weights_only=True)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "Namespace" in out.stderr


def test_malicious_pickle_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "args": Evil()}, path)
    with pytest.raises(CheckpointError, match="evil.pt is refused by safe loading"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not marker.exists()


def test_expert_load_file(trained):
    _, stats = trained
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    assert [line["update"] for line in lines] == [3, 6]
    for line in lines:
        assert set(line["layers"]) == set(line["dropped"]) == set(line["entropy"]) == set(line["tokens"]) == {
            "encoder.layers.1.fc1", "decoder.layers.1.fc1"}
        for name, fractions in line["layers"].items():
            assert len(fractions) == 4 and abs(sum(fractions) - 1) < 1e-9
            assert 0 <= line["dropped"][name] < 1 and 0 < line["entropy"][name] <= math.log(4) + 1e-9
            assert line["tokens"][name] > 0


@pytest.mark.slow
def test_resume_and_generate(trained, data_bin, tmp_path):
    save, _ = trained
    resumed = tmp_path / "resumed"
    shutil.copytree(save, resumed)
    run_train(train_argv(data_bin, resumed, "--max-update", "8"))
    state = torch.load(resumed / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 8
    assert "last_optimizer_state" in state

    scorer = run_generate([
        data_bin, "--user-dir", USER_DIR, "--path", str(resumed / "checkpoint_last.pt"),
        "--task", "moe_translation", "--gen-subset", "test", "--beam", "2", "--batch-size", "8",
        "--cpu", "--results-path", str(tmp_path / "gen"),
    ])
    assert "BLEU" in scorer.result_string()
    hyps = [line for line in (tmp_path / "gen" / "generate-test.txt").read_text().splitlines()
            if line.startswith("H-")]
    assert len(hyps) == 20


@pytest.mark.slow
def test_cli_user_dir_after_pip_install(data_bin, tmp_path):
    """`fairseq-train --user-dir fairseq_moe` outside the checkout finds the installed package."""
    import fairseq

    installed = os.path.join(os.path.dirname(os.path.dirname(fairseq.__file__)), "fairseq_moe")
    if not os.path.isdir(installed):
        pytest.skip("fairseq_moe is not installed next to fairseq (scripts/test.sh installs it)")
    argv = train_argv(data_bin, tmp_path / "ckpt", "--max-update", "2")
    argv[argv.index("--user-dir") + 1] = "fairseq_moe"
    cli = os.path.join(os.path.dirname(sys.executable), "fairseq-train")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([cli, *argv], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moe_balance_loss" in out.stderr + out.stdout


@pytest.mark.slow
def test_interactive_loads_the_checkpoint(trained, data_bin, tmp_path, capsys):
    from fairseq import options
    from fairseq_cli import interactive

    save, _ = trained
    source = tmp_path / "input.txt"
    source.write_text("a b c\nd e f g\n")
    parser = options.get_interactive_generation_parser()
    args = options.parse_args_and_arch(parser, [
        data_bin, "--user-dir", USER_DIR, "--path", str(save / "checkpoint_last.pt"),
        "--task", "moe_translation", "--source-lang", "src", "--target-lang", "tgt",
        "--input", str(source), "--beam", "2", "--cpu",
    ])
    interactive.main(args)
    hyps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("H-")]
    assert len(hyps) == 2
