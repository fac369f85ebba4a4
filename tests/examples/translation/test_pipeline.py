"""The translation example's child processes (examples/translation/pipeline.py): the CPU seconds a step reports
are its own child's, and two models run at once with their own thread counts, one's failure stopping the other."""
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "translation"
sys.path.insert(0, str(EXAMPLE))
import pipeline  # noqa: E402

sys.path.remove(str(EXAMPLE))

PY = sys.executable


def busy(seconds, then=""):
    """A child that prints its OMP_NUM_THREADS, spins `seconds` of CPU time, then runs `then`."""
    return [PY, "-c", f"import os, time; print('threads', os.environ['OMP_NUM_THREADS'], flush=True)\n"
                      f"t = time.process_time()\nwhile time.process_time() - t < {seconds}: pass\n{then}"]


def test_a_steps_cpu_seconds_are_its_own_childs(tmp_path, capsys):
    # Another child of this process that finishes meanwhile is not counted (RUSAGE_CHILDREN would count it).
    pipeline.run_logged(busy(0.6), tmp_path / "other.log")
    cpu = pipeline.run_logged(busy(0.3), tmp_path / "one.log")
    assert 0.25 <= cpu < 0.55
    assert (tmp_path / "one.log").read_text().startswith("threads ")


def test_a_failing_step_names_its_log(tmp_path):
    with pytest.raises(pipeline.StepError, match=r"(?s)exit code 3 .*fail\.log"):
        pipeline.run_logged(busy(0, "raise SystemExit(3)"), tmp_path / "fail.log")


def test_two_jobs_run_at_once_with_their_threads_and_prefixes(tmp_path, capsys):
    def run_one(name):
        start = time.time()
        cpu = pipeline.run_logged(busy(0.5, "time.sleep(1.5)"), tmp_path / f"{name}.log")
        return start, time.time(), cpu

    got = pipeline.run_at_once(run_one, ["moe", "dense"], 3)
    assert list(got) == ["moe", "dense"]
    (s1, e1, _), (s2, e2, _) = got.values()
    assert max(s1, s2) < min(e1, e2)  # they overlapped
    out = capsys.readouterr().out
    assert "[moe] threads 3" in out and "[dense] threads 3" in out
    assert (tmp_path / "moe.log").read_text() == "threads 3\n"  # the log has the child's lines, unprefixed


def test_when_one_job_fails_the_others_child_is_stopped(tmp_path):
    def run_one(name):
        if name == "moe":
            pipeline.run_logged(busy(0, "time.sleep(0.5); raise SystemExit(2)"), tmp_path / "moe.log")
        else:
            pipeline.run_logged(busy(0, "time.sleep(60)"), tmp_path / "dense.log")
            pipeline.run_logged(busy(0), tmp_path / "dense-next.log")  # (never: the first step was stopped)

    start = time.time()
    with pytest.raises(pipeline.StepError, match=r"(?s)exit code 2 .*moe\.log"):
        pipeline.run_at_once(run_one, ["moe", "dense"], 1)
    assert time.time() - start < 30
    assert not (tmp_path / "dense-next.log").exists()
