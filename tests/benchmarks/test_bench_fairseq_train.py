"""benchmarks/bench_fairseq_train.py at tiny sizes (four fairseq-train start-ups): that it runs, reports each run,
and that the allocator changes no loss. Its figures are measured by running the script (benchmarks/README.md)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.slow
def test_four_runs_and_their_ratios(tmp_path):
    out = tmp_path / "train.json"
    got = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fairseq_train.py"), "--smoke",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    result = json.loads(out.read_text())
    assert sorted(result["rows"]) == ["dense glibc", "dense keep", "moe glibc", "moe keep"]
    for row in result["rows"].values():
        assert row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 100 and len(row["rounds"]) == 1
    assert len(result["ratios"]) == 4 and "time per token, moe / dense" in got.stdout
    # Where blocks come from does not change a number: the same losses with the flag (or the env) as without.
    rows = result["rows"]
    assert all(row["loss"] is not None for row in rows.values())
    # The flag reached the run's Trainer (its log line), and only that run's.
    assert [name for name, row in rows.items() if row["flag_logged"]] == ["moe keep"]
    assert rows["moe glibc"]["loss"] == rows["moe keep"]["loss"]
    assert rows["dense glibc"]["loss"] == rows["dense keep"]["loss"]


def _one_pass_here():
    from fairseq_moe_kernels import cpu_adam

    return os.environ.get("FAIRSEQ_MOE_CPU_ADAM") == "required" or cpu_adam.available()


@pytest.mark.slow
@pytest.mark.parametrize("precision", [
    pytest.param("bf16", marks=pytest.mark.skipif("not _one_pass_here()", reason="no C compiler for cpu_adam here")),
    "fp32"])
def test_the_breakdown_times_each_part_of_an_moe_update(precision):
    """benchmarks/train_breakdown.py --smoke: one tiny MoE fairseq-train in its process, bf16 and fp32 (fairseq's
    optimizers, not FP16Optimizer's); every timer printed, the MoE layer's too, and its expert counts sum to the
    tokens of a batch (top-1)."""
    got = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_breakdown.py"), "--smoke"]
                         + (["--fp32"] if precision == "fp32" else []), capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    assert f"  {precision}, MoE" in got.stdout
    for part in ("train_step", "forward+backward", "backward", "clip_grad_norm", "step", "decoder layer 0",
                 "decoder layer 1", "MoE layer 0 ", "MoE layer 0 on random input",
                 "MoE layer 0 on its last training input and output gradient"):
        assert part in got.stdout, part
    counts = got.stdout.split("tokens per expert in its last training forward, sorted: ")[1].splitlines()[0]
    counts = json.loads(counts)
    assert len(counts) == 4 and sum(counts) > 0 and counts == sorted(counts)


@pytest.mark.parametrize("flag", ["--rounds=2", "--roun=2", "--json", "--bf16", "--bf"])
def test_the_breakdown_refuses_the_benchmarks_flags_it_would_ignore(flag, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_breakdown

    with pytest.raises(SystemExit) as exit:
        train_breakdown.main([flag] + (["out.json"] if flag == "--json" else []))
    assert exit.value.code == 2
    name = {"--roun": "--rounds", "--bf": "--bf16"}.get(flag.split("=")[0], flag.split("=")[0])
    assert f"{name} is bench_fairseq_train.py's" in capsys.readouterr().err


@pytest.mark.parametrize("other", ["--dense", "--fp32"])
def test_the_breakdown_refuses_no_one_pass_where_it_means_nothing(other, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_breakdown

    with pytest.raises(SystemExit) as exit:
        train_breakdown.main(["--no-one-pass", other])
    assert exit.value.code == 2 and "not with --dense or --fp32" in capsys.readouterr().err
