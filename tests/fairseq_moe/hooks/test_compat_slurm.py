"""Under a real Slurm (one node, scripts/slurm_up.sh: Debian's munge, slurmctld and slurmd, which .ci/run starts),
`srun --ntasks 2 fairseq-train ... --distributed-port P` is one expert-parallel job of 2 ranks (compat.py:
slurm_as_torchrun), bit for bit the job that fairseq_moe.launch runs, and `srun --ntasks 2 fairseq-generate` on
its set prints what the launcher's 2 ranks print (spread.py). Without Slurm these skip, unless
FAIRSEQ_MOE_SLURM=required (CI): then a missing cluster fails them."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards

from tests.conftest import free_port
from tests.fairseq_moe.helpers import USER_DIR, tail, train_argv
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, launched  # noqa: F401  (a fixture)
from tests.fairseq_moe.hooks.test_spread import GENERATE, generate, sentences

GLOO = ("--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp")


def _slurm_up():
    if shutil.which("srun") is None:
        return False
    return subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.split()[:1] == ["idle"]


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("FAIRSEQ_MOE_SLURM") != "required" and not _slurm_up(),
    reason="no idle Slurm node here (bash scripts/slurm_up.sh, as root, starts one)")]


def srun(tool, *argv, tasks=2):
    """srun -N1 --ntasks TASKS $(which fairseq-TOOL) ARGV: its CompletedProcess (a failed task stops the step)."""
    program = os.path.join(os.path.dirname(sys.executable), tool)
    return subprocess.run(["srun", "-N1", "--ntasks", str(tasks), "--kill-on-bad-exit=1", program, *map(str, argv)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)


@pytest.fixture(scope="module")
def srun_set(data_bin, tmp_path_factory):
    """The save folder of `srun --ntasks 2 fairseq-train` (COMMON: 4 experts, 4 updates)."""
    save = tmp_path_factory.mktemp("srun")
    out = srun("fairseq-train", *train_argv(data_bin, save, *COMMON), *GLOO, "--distributed-port", free_port())
    assert out.returncode == 0, tail(out.stderr)
    assert "expert parallel: 2 experts per rank on 2 ranks" in out.stdout + out.stderr, tail(out.stderr)
    return save


def test_srun_train_is_the_launchers_job(srun_set, launched):  # noqa: F811
    many, _ = launched.result()
    assert sorted(os.listdir(srun_set)) == sorted(os.listdir(many))  # a set of 2 ranks, no race on one folder
    a, b = (shards.assemble(str(folder / "checkpoint_last")) for folder in (many, srun_set))
    torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=0)
    assert b["optimizer_history"][-1]["num_updates"] == 4


def test_srun_generate_is_the_launchers(srun_set, data_bin):
    path = srun_set / "checkpoint_last.pt"  # (the name of the set)
    out = srun("fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", path, *GENERATE,
               "--distributed-port", free_port())
    assert out.returncode == 0, tail(out.stderr)
    assert "expert parallel: 2 experts per rank on 2 ranks" in out.stderr, tail(out.stderr)
    reference = generate(data_bin, path, 2)
    assert reference.returncode == 0, tail(reference.stderr)
    (lines, bleu), (want, want_bleu) = sentences(out.stdout), sentences(reference.stdout)
    assert len(lines) == 5 * 20 and lines == want and len(bleu) == 1 and bleu == want_bleu  # once per sentence


def test_srun_usage_errors_are_one_line(data_bin, tmp_path):
    """srun's tasks meet at --distributed-port, as in fairseq's Slurm launch: without it, a line that names the
    flag (once, from rank 0), before any work; a usage error too is printed once."""
    out = srun("fairseq-train", *train_argv(data_bin, tmp_path / "save", *COMMON), *GLOO)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("fairseq-train:")]
    assert errors == ["fairseq-train: error: srun started 2 tasks: add --distributed-port P (a free port on the "
                      "step's first node, where the tasks meet), as fairseq's Slurm launch needs"], tail(out.stderr)
    assert not (tmp_path / "save").exists() or not os.listdir(tmp_path / "save")
    out = srun("fairseq-train", *train_argv(data_bin, tmp_path / "save", *COMMON), *GLOO, "--no-such-flag")
    assert out.returncode != 0  # (2, or srun's code for the task it stopped when rank 0 had ended)
    assert [line for line in out.stderr.splitlines() if "unrecognized arguments" in line] == [
        "fairseq-train: error: unrecognized arguments: --no-such-flag"], tail(out.stderr)  # (argparse's, once)


def test_srun_tasks_of_one_procid_are_one_line_each_within_seconds(tmp_path):
    """A real step whose two tasks both say SLURM_PROCID=0 (a wrapper that sets it, as a hand-written script
    might): each task prints one line naming the variable and exits, in seconds, not torch's 30 minutes."""
    from tests.fairseq_moe.hooks.test_compat_slurm_env import ROOT, TASK_SCRIPT

    (tmp_path / "task.py").write_text(TASK_SCRIPT)
    port = free_port()
    out = subprocess.run(["srun", "-N1", "--ntasks", "2", "--chdir", str(tmp_path), "bash", "-c",
                          f'SLURM_PROCID=0 exec "{sys.executable}" task.py {port}'], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("task.py: error:")]
    assert out.returncode != 0 and len(errors) == 2, tail(out.stderr)
    assert all("SLURM_PROCID=0 is on more than one task of the step" in line for line in errors), errors
