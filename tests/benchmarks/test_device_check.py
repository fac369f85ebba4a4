"""benchmarks/gpu_check.sh and device_check.py: the device check rehearsed on the CPU, so that the first GPU run is not
the first run (issue 33)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import device_check  # noqa: E402

STEPS = ("kernel-tests", "translate-fp32", "translate-bf16", "selftest", "kernels", "layer")


@pytest.mark.slow
def test_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu_check.sh"), "--device", "cpu", str(out),
                           "--work", str(tmp_path / "work")],
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1500)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + summary
    lines = summary.splitlines()
    assert lines[0].startswith("device check (cpu, ") and "fairseq 0.12" in lines[0]
    verdicts = {ln.split()[1]: ln.split()[0] for ln in lines[1:-1]}
    assert list(verdicts) == list(STEPS), summary
    # No CUDA here: the kernels' GPU tests skip (and say so); every other step ran and passed.
    assert verdicts.pop("kernel-tests") == "SKIP" and "skipped" in lines[1], summary
    assert set(verdicts.values()) == {"PASS"}, summary
    translate = next(ln for ln in lines if ln.split()[1] == "translate-bf16")
    assert "tokens/s MoE" in translate and "BLEU MoE" in translate and "loss MoE" in translate, translate
    selftest = next(ln for ln in lines if ln.split()[1] == "selftest")
    assert "fp16 PASS" in selftest and "bf16 PASS" in selftest, selftest
    assert lines[-1].startswith("PASS: the device check")
    # What comes back from the device: at most 8 files, none in subfolders.
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).is_file() for f in files), files
    assert {"summary.txt", "translate.log", "selftest.log", "kernels.json", "layer.json"} <= set(files), files


def test_a_step_past_its_limit_is_a_fail_line_and_exit_1(tmp_path, monkeypatch):
    """The run past its limit is ended (its process group: SIGTERM, then SIGKILL) and is that step's FAIL line."""
    monkeypatch.setitem(device_check.LIMITS, "layer", 0.01)  # (3x on a CPU: still far less than a start-up)
    status = device_check.main(["--device", "cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"),
                                "--skip", "kernel-tests", "translate", "selftest", "kernels"])
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert status == 1
    assert [ln.split()[:2] for ln in lines[1:-1]] == [
        ["SKIP", "kernel-tests"], ["SKIP", "translate-fp32"], ["SKIP", "translate-bf16"], ["SKIP", "selftest"],
        ["SKIP", "kernels"], ["FAIL", "layer"]]
    assert "timed out" in lines[-2] and lines[-1].startswith("FAIL: the device check")


def test_train_figures_from_fairseq_logs(tmp_path):
    inner = tmp_path / "inner.log"
    inner.write_text("".join(
        f"2026 | INFO | train_inner | epoch 001:  {u} / 9 loss={loss}, nll_loss=1, ppl=2, wps={wps}, ups=1, wpb=9\n"
        for u, loss, wps in ((50, 9.5, 100.0), (100, 8.0, 300.0), (150, 7.25, 500.0), (200, 7.0, 400.0))))
    assert device_check.train_figures(inner) == ([9.5, 8.0, 7.25, 7.0], 400.0)  # (the warm-up's 100 left out)
    epochs = tmp_path / "epochs.log"
    epochs.write_text("2026 | INFO | train | epoch 001 | loss 9.1 | nll_loss 9 | wps 120 | ups 1\n"
                      "2026 | INFO | train | epoch 002 | loss 8.4 | nll_loss 8 | wps 150 | ups 1\n")
    assert device_check.train_figures(epochs) == ([9.1, 8.4], 150.0)


def test_bad_input_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/device_check.py"), "--device", "cpu", "--out",
                           str(tmp_path), "--budget-s", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--budget-s must be positive" in proc.stderr


def test_a_spent_budget_skips_the_steps_left(tmp_path):
    status = device_check.main(["--device", "cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"),
                                "--budget-s", "1e-9"])
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert status == 1 and all(ln.startswith("SKIP") and "no time left" in ln for ln in lines[1:-1]), lines
    assert len(lines) == 8 and lines[-1].startswith("INCOMPLETE: the device check")
