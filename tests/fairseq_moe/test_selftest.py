"""python -m fairseq_moe.selftest on this CPU (gloo): every feature passes on 2 ranks against one process, one line
each (the 2-D all-to-all, which needs 4 ranks, skipped there and passed on 4); with the all-to-all sabotaged (the
rows it delivers scaled by 1.01 on every group of 2 ranks or more, through a sitecustomize every process loads)
training, resuming and generating on the ranks FAIL with exit status 1; bad input is one line and exit status 2
before anything runs."""
import os
import re
import subprocess
import sys

import pytest
import torch

from fairseq_moe import selftest

LINE = re.compile(r"^(PASS|FAIL|SKIP)  (\S+)\s+(.*)$")
SABOTAGE = """\
import torch.distributed as dist

_real = dist.all_to_all_single


def all_to_all_single(output, input, *args, **kwargs):
    work = _real(output, input, *args, **kwargs)
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    if output.is_floating_point() and dist.get_world_size(group) > 1:
        output.mul_(1.01)
    return work


dist.all_to_all_single = all_to_all_single
"""


def selftest_run(tmp_path, *argv, env=None):
    """The command as a user runs it; -> (exit status, {feature: (status, rest of its line)}, output)."""
    out = subprocess.run([sys.executable, "-m", "fairseq_moe.selftest", "--device", "cpu", "--work",
                          str(tmp_path / "work"), *argv], capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, **(env or {})))
    lines = {m.group(2): (m.group(1), m.group(3)) for m in map(LINE.match, out.stdout.splitlines()) if m}
    return out.returncode, lines, out.stdout + out.stderr


def difference(rest):
    return float(re.search(r"largest relative difference (\S+)", rest).group(1))


@pytest.mark.slow
def test_every_feature_passes_on_two_gloo_ranks(tmp_path):
    code, lines, log = selftest_run(tmp_path, "--nproc", "2")
    assert code == 0, log
    assert list(lines) == [f.name for f in selftest.FEATURES], log
    for feature in selftest.FEATURES:
        status, rest = lines[feature.name]
        if feature.name == "a2a-2d":
            assert status == "SKIP" and "4 ranks or more" in rest
            continue
        assert status == "PASS" and difference(rest) <= feature.tolerance, (feature.name, rest)
    assert not os.path.exists(tmp_path / "work" / "spread" / "ranks" / "checkpoint_last.pt")  # (a set: 2 ranks)
    assert os.path.exists(tmp_path / "work" / "spread" / "ranks" / "checkpoint_last-rank-1.pt")


@pytest.mark.slow
def test_the_2d_all_to_all_passes_on_four_ranks(tmp_path):
    code, lines, log = selftest_run(tmp_path, "--nproc", "4", "--only", "a2a-2d")
    assert code == 0 and lines["a2a-2d"][0] == "PASS", log
    assert "hierarchical 2x2 all-to-all" in (tmp_path / "work" / "a2a-2d" / "ranks.log").read_text()


@pytest.mark.slow
def test_a_sabotaged_all_to_all_fails(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SABOTAGE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    code, lines, log = selftest_run(tmp_path, "--nproc", "2", "--only", "spread", "reshard", "generate", "eval-lm",
                                    env={"PYTHONPATH": path})
    assert code == 1, log
    for name in ("spread", "reshard", "eval-lm"):
        status, rest = lines[name]
        assert status == "FAIL" and difference(rest) > selftest.FP32 and " in " in rest, (name, rest)
    status, rest = lines["generate"]  # (the same set on both: only the W ranks' generation goes through it)
    assert status == "FAIL" and ("differ" in rest or difference(rest) > selftest.FP32), rest
    assert "4 of 4 features failed" in log
    assert os.path.exists(tmp_path / "work" / "spread" / "ranks.log")  # (kept: the runs' logs are named)


def one_line(capsys, argv):
    assert selftest.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m fairseq_moe.selftest: error: "), err
    return err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_bad_input_is_one_line_before_anything_runs(capsys, tmp_path):
    assert "--device cuda" in one_line(capsys, ["--device", "cuda"])
    assert "--backend nccl with --device cpu" in one_line(capsys, ["--backend", "nccl", "--device", "cpu"])
    assert "--nproc must be >= 1" in one_line(capsys, ["--nproc", "0"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "--work" in one_line(capsys, ["--work", str(tmp_path / "full")])
    assert os.listdir(tmp_path / "full") == ["x"]


def test_list_names_every_feature(capsys):
    assert selftest.main(["--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [f.name for f in selftest.FEATURES]


def test_experts_are_a_multiple_of_the_ranks():
    for W in range(1, 17):
        E = selftest.experts(W)
        assert E % W == 0 and E >= 4 and (E == W or W < 4 or E == 4), (W, E)
