"""compat.py's fixes. fairseq 0.12 drops the last batch when its size is not a multiple of
--required-batch-size-multiple; the plugin keeps it, so that generation translates every sentence and
training sees every example. Its data modules call NumPy 1 functions that NumPy 2 removed."""
import numpy as np
import pytest
from fairseq.data import data_utils

import fairseq_moe  # noqa: F401  (the plugin, loaded by conftest.py, installs the fixes)


@pytest.mark.parametrize("use_vec", [False, True])
@pytest.mark.parametrize("n, max_sentences, max_tokens, mult", [(20, 8, None, 8), (37, None, 60, 8), (5, 8, None, 8), (16, 8, None, 8)])
def test_every_index_batched_once(use_vec, n, max_sentences, max_tokens, mult):
    lengths = np.random.RandomState(n).randint(1, 6, size=n).astype(np.int64)
    indices = np.argsort(lengths, kind="stable").astype(np.int64)
    batches = data_utils.batch_by_size(
        indices, lambda i: lengths[i], num_tokens_vec=lengths[indices] if use_vec else None,
        max_tokens=max_tokens, max_sentences=max_sentences, required_batch_size_multiple=mult,
    )
    assert np.array_equal(np.concatenate(batches), indices)
    for b in batches:
        assert max_sentences is None or len(b) <= max_sentences
        assert max_tokens is None or len(b) * lengths[b].max() <= max_tokens


def test_numpy_2_datasets():
    """fairseq's eos-block LM dataset and bucketed pair dataset use NumPy 1 calls gone in NumPy 2."""
    import torch
    from fairseq.data import Dictionary, LanguagePairDataset, TokenBlockDataset

    sentences = [torch.tensor([4, 5, 2]), torch.tensor([6, 2]), torch.tensor([7, 8, 9, 2])]
    blocks = TokenBlockDataset(sentences, [3, 2, 4], block_size=None, pad=1, eos=2, break_mode="eos")
    assert [blocks[i].tolist() for i in range(3)] == [s.tolist() for s in sentences]
    d = Dictionary()
    sizes = np.array([3, 2, 4])
    pairs = LanguagePairDataset(sentences, sizes, d, sentences, sizes, d, num_buckets=2)
    assert pairs.buckets is not None and len(pairs) == 3
    assert "compat" not in vars(np) or np.__version__ < "2"  # numpy itself is left as it was


LEAVE = """
import atexit, sys
from fairseq_moe.hooks.compat import leave_together
atexit.register(lambda: print("atexit ran", flush=True))
def main(code):
    print("trained", end="")  # (not flushed yet)
    if code == 3:
        raise RuntimeError("a bug")
    if code:
        raise SystemExit(code)
leave_together(main)(int(sys.argv[1]))
print("after the run")
"""


@pytest.mark.parametrize("code", [0, 1, 2, 3])
@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_leaves_with_its_exit_code_and_output(code, launched):
    """A launched rank leaves right after distributed_main (no interpreter teardown, where gloo ranks can
    abort) with the run's exit code (1 and the traceback for an exception, here code 3), its output flushed
    and its atexit handlers run; elsewhere the program goes on (or exits) as without the plugin."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK") and not k.startswith("SLURM_")}
    if launched:
        env["FAIRSEQ_MOE_LAUNCH_RANK"] = "0"
    out = subprocess.run([sys.executable, "-c", LEAVE, str(code)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == (1 if code == 3 else code), out.stderr[-2000:]
    assert out.stdout.startswith("trained") and "atexit ran" in out.stdout, out.stdout
    assert ("RuntimeError: a bug" in out.stderr) == (code == 3), out.stderr[-2000:]
    assert ("after the run" in out.stdout) == (not launched and code == 0), out.stdout


SLURM_STEP = {"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "5",
              "SLURM_STEP_NODELIST": "gpu[7-9]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}


def test_srun_tasks_get_the_environment_of_torchrun_ranks(monkeypatch, tmp_path):
    """The fifth task of a 5-task srun step on nodes gpu7-gpu9 (2, 2 and 1 tasks): rank 4 of 5, alone on its
    node, meeting on the first node at --distributed-port. In an sbatch script itself (SLURM_NTASKS and
    SLURM_PROCID but no step) nothing is set: that is one process, not a rank. Without the port: one line
    that names the flag. (scontrol is a stand-in here: tests/fairseq_moe/hooks/test_compat_slurm.py runs a real Slurm.)"""
    import os
    import re

    from fairseq_moe.hooks import compat
    from fairseq_moe.errors import FlagError

    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$*" = "show hostnames gpu[7-9]" ] && printf "gpu7\\ngpu8\\ngpu9\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    met = []  # (the tasks' meeting is tests/fairseq_moe/hooks/test_compat_slurm_env.py's: here, where and how many)
    monkeypatch.setattr(compat, "meet_step", lambda step, host, port, seconds: met.append((step.tasks, host, port)))
    for key in (*compat.TORCHRUN_ENV, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID",
                "FAIRSEQ_MOE_LAUNCH_RANK"):
        monkeypatch.setenv(key, "")  # (recorded: what slurm_as_torchrun sets goes at the end of the test)
        monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "0")  # left in the shell that ran srun: Slurm's rank wins
    monkeypatch.setenv("SLURM_NTASKS", "5")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert not compat.slurm_as_torchrun(29500) and not compat.one_rank_of_a_job()  # the sbatch script
    assert "WORLD_SIZE" not in os.environ and os.environ["RANK"] == "0"
    for key, value in SLURM_STEP.items():
        monkeypatch.setenv(key, value)
    assert compat.launcher_rank() == 4  # (not the RANK=0 that srun copied from the shell)
    with pytest.raises(FlagError, match="srun started 5 tasks: add --distributed-port P"):
        compat.slurm_as_torchrun(-1)
    assert compat.slurm_as_torchrun(29500) and compat.one_rank_of_a_job()
    assert {key: os.environ[key] for key in (*compat.TORCHRUN_ENV, "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "MASTER_ADDR": "gpu7", "MASTER_PORT": "29500", "WORLD_SIZE": "5", "RANK": "4", "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1"}
    assert met == [(5, "gpu7", 29500)]
    for layout in ("2(x2)", "2,x"):  # (tasks per node that do not make the step's 5)
        monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", layout)
        with pytest.raises(FlagError, match=f"SLURM_STEP_TASKS_PER_NODE='{re.escape(layout)}' does not"):
            compat.slurm_as_torchrun(29500)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun inside the step: its environment is kept
    assert not compat.slurm_as_torchrun(29501) and os.environ["MASTER_PORT"] == "29500"
