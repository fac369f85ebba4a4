"""A fault in one rank's save of a set (killed mid-write, after the commit, on a full disk, once all agreed or
before): the folder holds a complete set, of the update before or of the one saved, and the resume continues with
the losses of a run without the fault. (Split from test_trainer_damaged_folders: each file is one xdist worker's.)
"""
import os

import pytest

from fairseq_moe.checkpoints import sets as shards

from tests.fairseq_moe.helpers import error_lines, tail
from tests.fairseq_moe.hooks.test_trainer_damaged_folders import SAVES, launch_w, snapshot


@pytest.fixture(scope="module")
def reference_losses(data_bin, tmp_path_factory):
    """W -> {update: losses} of the run without a fault (made once per W)."""
    from tests.fairseq_moe.hooks.test_trainer import losses

    made = {}

    def of(W):
        if W not in made:
            out = launch_w(W, data_bin, tmp_path_factory.mktemp(f"reference{W}"), *SAVES)
            assert out.returncode == 0, tail(out.stdout + out.stderr)
            made[W] = losses(out.stdout + out.stderr)
        return made[W]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("W, fault, victim, resumes_at", [
    (2, "mid-write", 1, 2),   # a rank killed while it writes: the save of update 4 never happened
    (2, "committed", 0, 4),   # rank 0 killed after the commit, before any rename: the resume finishes it
    (2, "disk full", 1, 2),   # a file-size limit on rank 1: every rank stops with one line, nothing replaced
    (2, "full in torch.save", 0, 2),  # the limit met inside torch.save (its RuntimeError hides the OSError)
    (4, "agreed", 3, 4),      # rank 3 killed once all agreed: rank 0 commits and switches without it
    (4, "written", 2, 2),     # rank 2 killed before the agreement: nothing is replaced
])
def test_a_fault_in_a_save_then_resume_continues_exactly(data_bin, tmp_path, reference_losses, W, fault, victim,
                                                         resumes_at):
    """fairseq-train on W ranks, --keep-interval-updates 1, a fault in the save of update 4: the folder
    holds the complete set of update 2 or of update 4, and resuming gives the losses of a run without
    the fault."""
    from tests.fairseq_moe.hooks.test_trainer import losses

    save = tmp_path / "save"
    out = launch_w(W, data_bin, save, *SAVES, fault=fault, victim=victim, script=tmp_path / "faulty.py")
    log = out.stdout + out.stderr
    assert out.returncode != 0, tail(log)
    if fault in ("disk full", "full in torch.save"):
        errors = error_lines(log)
        assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in log, tail(log)
        assert f"failed on rank {victim} of {W}" in errors[0] and "File too large" in errors[0], errors
        assert "nothing was replaced" in errors[0]
    if fault == "full in torch.save":
        assert "torch.save raised RuntimeError: [enforce fail" in log and "unexpected pos" not in errors[0], tail(log)
        assert ".staged: File too large" in errors[0], errors
    before = snapshot(save)
    resumed = launch_w(W, data_bin, save, *SAVES)
    log_resumed = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, tail(log_resumed)
    b = losses(log_resumed)
    assert sorted(b) == list(range(resumes_at + 1, 7)), sorted(b)
    reference = reference_losses(W)
    assert b == {u: reference[u] for u in b}
    last = shards.assemble(str(save / "checkpoint_last"))
    assert [h["num_updates"] for h in last["optimizer_history"]][-2:] == [resumes_at, 6]
    parts = sorted([f"rank-{r}" for r in range(W)] + ["shared"])
    interval = sorted(n for n in os.listdir(save) if n.startswith("checkpoint_1_"))  # --keep-interval-updates 1
    newest = interval[0].split("-")[0]  # (checkpoint_1_6; at 4 ranks update 6 ends the epoch: checkpoint_1_4)
    assert interval == [f"{newest}-{p}.pt" for p in parts], interval
    if resumes_at == 2:  # the set resumed from was on disk as it was saved, and nothing of update 4 stayed
        finals = sorted(k for k in before if k.startswith("checkpoint_1_") and k.endswith(".pt"))
        assert finals == [f"checkpoint_1_2-{p}.pt" for p in parts], finals
