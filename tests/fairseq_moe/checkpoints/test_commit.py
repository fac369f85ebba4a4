"""commit.py: a save of W ranks replaces the previous sets as a whole, whichever rank is killed at
whichever step, or when one rank's disk is full.

W processes (forked, so no import costs) with a gloo group save twice what a run with
--save-interval-updates 2 --keep-interval-updates 1 saves, the way checkpoint.py drives commit.SetSave:
each rank writes its file of checkpoint_1_U (rank 0 the shared file too), copies it to checkpoint_last
and retires checkpoint_1_{U-2}. In the second save one rank is killed with SIGKILL at one step, or writes
under a file-size limit. Then the folder, recovered as a resume recovers it, must hold for every name a
complete set, byte-identical to the files of the first save or of the second (which one is fixed by the
step), that loads to exactly the state saved, and nothing else.
"""
import hashlib
import io
import json
import multiprocessing
import os
import resource
import signal
import time
from datetime import timedelta

import pytest
import torch

from fairseq_moe.checkpoints import commit
from fairseq_moe.checkpoints import sets as shards
from fairseq_moe.errors import SaveError
from fairseq_moe_layer.comm import local_experts

from tests.conftest import free_port

E = 4
EXPERTS = {"layer.experts.w1": (E, 3, 5), "layer.experts.b1": (E, 5)}
ORDER = ["shared.weight", *EXPERTS]
NAMES = ("checkpoint_1_{}", "checkpoint_last")


def full_state(updates):
    """What a 1-process trainer would save at this update: model and Adam state (the data fix the update)."""
    g = torch.Generator().manual_seed(updates)
    shapes = {"shared.weight": (6, 3), **EXPERTS}
    return {"model": {n: torch.randn(shapes[n], generator=g) for n in ORDER},
            "last_optimizer_state": {"state": {i: {"step": torch.tensor(float(updates)),
                                                   "exp_avg": torch.randn(shapes[n], generator=g)}
                                               for i, n in enumerate(ORDER)},
                                     "param_groups": [{"params": [0, 1, 2]}]},
            "optimizer_history": [{"num_updates": updates}], "extra_state": {}}


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def save_once(folder, rank, W, updates, gather, on_step=None):
    """One save of rank `rank`, as checkpoint.py makes it."""
    save_id = gather(shards.new_save_id())[0]
    sets = commit.SetSave(folder, save_id, rank, W, gather, on_step=on_step)
    spread = {n: local_experts(E, W, rank) for n in EXPERTS}
    info = shards.manifest(updates, save_id, W, {n: E for n in EXPERTS}, {n: ORDER.index(n) for n in EXPERTS}, W)
    state = shards.cut_for_rank(dict(full_state(updates), extra_state={"moe_checkpoint": info}),
                                {n: (f, c, E) for n, (f, c) in spread.items()})
    shared, mine = shards.split(state, spread, rank, info)
    first, last = (os.path.join(folder, n.format(updates)) for n in NAMES)
    error = None
    try:
        sets.write(mine, first + f"-rank-{rank}.pt")
        if rank == 0:
            sets.write(shared, shards.shared_path(first))
        # What was written, for the test to compare with (recorded before the agreement).
        written = {os.path.basename(f): sha(shards.staged_path(f, save_id)) for f in sets.staged}
        with open(os.path.join(folder, "..", f"written-{updates}-{rank}.json"), "w") as f:
            json.dump(written, f)
        sets.copy(first + f"-rank-{rank}.pt", last + f"-rank-{rank}.pt")
        if rank == 0:
            sets.copy(shards.shared_path(first), shards.shared_path(last))
        if updates > 2:  # --keep-interval-updates 1
            sets.retire(os.path.join(folder, NAMES[0].format(updates - 2) + f"-rank-{rank}.pt"))
    except OSError as e:
        error = e
    sets.finish(error)


def half_a_file_then_die(obj, f, *args, **kwargs):
    buffer = io.BytesIO()
    torch.serialization.save(obj, buffer)  # (the module's own: torch.save is this function here)
    f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def rank_main(folder, rank, W, port, fault, victim):
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=timedelta(seconds=30))

    def gather(obj):
        out = [None] * W
        dist.all_gather_object(out, obj)
        return out

    save_once(folder, rank, W, 2, gather)
    gather(None)  # the first save is done everywhere
    on_step = None
    if rank == victim:
        if fault == "mid-write":
            torch.save = half_a_file_then_die
        elif fault == "disk full":
            resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
        else:
            on_step = lambda step: step == fault and os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    try:
        save_once(folder, rank, W, 4, gather, on_step)
        outcome = "saved"
    except SaveError as e:
        outcome = f"SaveError: {e}"
    with open(os.path.join(folder, "..", f"outcome-{rank}"), "w") as f:
        f.write(outcome)


def run_ranks(tmp_path, W, fault, victim):
    folder = tmp_path / "save"
    folder.mkdir()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(str(folder), r, W, port, fault, victim)) for r in range(W)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for p in procs:  # the survivors of a kill fail in their next collective; a launcher stops any that wait
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return folder, [p.exitcode for p in procs]


# Which save the folder holds after a kill at each step: the commit (rank 0's journal) decides.
RANK_0_STEPS = {"writing": 2, "mid-write": 2, "written": 2, "agreed": 2, "committed": 4, "switched": 4, "done": 4}
OTHER_STEPS = {"writing": 2, "mid-write": 2, "written": 2, "agreed": 4, "done": 4}


def cases(W):
    out = [(0, step, expect) for step, expect in RANK_0_STEPS.items()]
    out += [(r, step, expect) for r in range(1, W) for step, expect in OTHER_STEPS.items()]
    return out + [(r, "disk full", 2) for r in range(W)]


def check_folder(tmp_path, folder, W, expect):
    """After recovery: one complete set per name, all of the save `expect`, byte for byte, nothing else."""
    commit.recover(str(folder), "")
    names = (NAMES[0].format(expect), NAMES[1])  # (checkpoint_1_2 retired by the second save)
    assert sorted(os.listdir(folder)) == sorted(f"{n}-{part}.pt" for n in names
                                                for part in ["shared"] + [f"rank-{r}" for r in range(W)])
    written = {}
    for r in range(W):
        with open(tmp_path / f"written-{expect}-{r}.json") as f:
            written.update(json.load(f))
    for name in names:
        base = str(folder / name)
        shards.check_set(base)
        for path in shards.set_files(base):
            interval = os.path.basename(path).replace(NAMES[1], NAMES[0].format(expect))
            assert sha(path) == written[interval], path
        state = shards.assemble(base)
        ref = full_state(expect)
        torch.testing.assert_close(state["model"], ref["model"], rtol=0, atol=0)
        torch.testing.assert_close(state["last_optimizer_state"]["state"], ref["last_optimizer_state"]["state"],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("W", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_save_is_made_whole_or_not_at_all(tmp_path, W):
    for victim, fault, expect in cases(W):
        case = tmp_path / f"rank{victim}-{fault.replace(' ', '-')}"
        case.mkdir()
        folder, codes = run_ranks(case, W, fault, victim)
        msg = f"rank {victim} {fault}: exit codes {codes}"
        if fault == "disk full":
            assert codes == [0] * W, msg
            outcomes = [(case / f"outcome-{r}").read_text() for r in range(W)]
            assert all(o.startswith("SaveError: ") and f"failed on rank {victim} of {W}" in o
                       and "File too large" in o for o in outcomes), outcomes
            assert not [n for n in os.listdir(folder) if n.endswith(".staged")], msg  # each rank took its own back
        else:
            assert codes[victim] == -signal.SIGKILL, msg
        check_folder(case, folder, W, expect)


def test_a_reader_finishes_the_renames_of_a_committed_save(tmp_path):
    """Rank 0 killed after the commit: fairseq-generate (resolve) reads the new set without a resume."""
    folder, _ = run_ranks(tmp_path, 2, "committed", 0)
    assert any(n.endswith(".staged") for n in os.listdir(folder))
    base = str(folder / "checkpoint_last")
    assert shards.resolve(base + ".pt")[:2] == ("set", base)
    shards.check_set(base)
    assert shards.assemble(base)["optimizer_history"][-1]["num_updates"] == 4
    assert [n for n in os.listdir(folder) if n.startswith("moe-commit-")]  # the deletions wait for a resume
    check_folder(tmp_path, folder, 2, 4)


def test_recover_leaves_what_is_not_a_stopped_save_of_this_run(tmp_path):
    """Staged files and temporaries of this run's names go; a partial set (no rank-0 file: being copied in),
    other runs' names and suffixes, and a file merely named like a journal stay."""
    stale = ["checkpoint_last.pt.tmp", "checkpoint_1_4-rank-1.pt.tmp", "checkpoint3-shared.pt.tmp",
             f"checkpoint_last-rank-1.pt.{'a' * 32}.staged", f"checkpoint.best_loss_3.21-shared.pt.{'b' * 32}.staged"]
    kept = ["checkpoint_1_2-shared.pt", "checkpoint_1_2-rank-1.pt", "checkpoint_1_4-rank-0.pt",
            "notes.pt.tmp", "mycheckpoint_last.pt.tmp", "checkpoint_last.pt", "model-rank-1.pt",
            "checkpoint_last-x.pt.tmp", f"model.pt.{'c' * 32}.staged", f"moe-commit-{'d' * 32}.json"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    commit.recover(str(tmp_path), "")
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_keep_best_counts_the_same_sets_on_every_rank(tmp_path):
    """fairseq's --keep-best-checkpoints rule runs on every rank over the names with that rank's suffix: sets
    of an earlier 2-rank run have no -rank-3 file, yet rank 3 of 4 must stage and retire what rank 0 does
    (else the ranks disagree and no save is made). fairseq's own save_checkpoint decides here."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import CheckpointConfig
    from omegaconf import OmegaConf

    from fairseq_moe import patches
    from fairseq_moe.hooks.trainer import OsDuringSave, SaveInProgress

    for loss in ("3.0000", "4.0000"):  # the two best of the earlier run
        for part in ("shared", "rank-0", "rank-1"):
            (tmp_path / f"checkpoint.best_loss_{loss}-{part}.pt").write_bytes(b"x")
    fairseq_save = patches.original("fairseq.checkpoint_utils", "save_checkpoint")
    cfg = OmegaConf.structured(CheckpointConfig(save_dir=str(tmp_path), keep_best_checkpoints=2,
                                                no_epoch_checkpoints=True))

    def decide(rank):
        sets = commit.SetSave(str(tmp_path), "0" * 32, rank, 4, gather=None)

        class Trainer:
            data_parallel_rank, checkpoint_suffix, task = rank, f"-rank-{rank}", None
            should_save_checkpoint_on_current_rank, always_call_state_dict_during_save_checkpoint = True, False

            def consolidate_optimizer(self):
                pass

            def get_num_updates(self):
                return 500

            def save_checkpoint(self, filename, extra_state):
                sets.write({"x": 1}, filename)
                if rank == 0:
                    sets.write({"x": 1}, shards.shared_path(shards.set_base(filename)))
                return filename

        class Epochs:
            epoch = 3

            def end_of_epoch(self):
                return True

            def state_dict(self):
                return {}

        save = SaveInProgress(checkpoint_utils.PathManager, sets, rank == 0)
        checkpoint_utils.save_checkpoint.best = 2.0  # (fairseq keeps the best score on the function)
        try:
            with patches.scoped(checkpoint_utils, "PathManager", save), \
                    patches.scoped(checkpoint_utils, "os", OsDuringSave(save)):
                fairseq_save(cfg, Trainer(), Epochs(), 3.5)  # better than 4.0, not than 3.0
        finally:
            del checkpoint_utils.save_checkpoint.best
            sets._discard()
        return sorted({os.path.basename(shards.set_base(f)) for f in sets.staged}), sorted(sets.retired)

    staged, retired = decide(0)
    assert [n for n in staged if n.startswith("checkpoint.best_loss_3.5")]
    assert retired == ["checkpoint.best_loss_4.0000"]
    assert all(decide(rank) == (staged, retired) for rank in (1, 2, 3))


def one_rank(folder, save_id="1" * 32):
    return commit.SetSave(str(folder), save_id, 0, 1, gather=lambda obj: [obj])


def test_a_failed_write_is_one_line_and_a_bug_keeps_its_traceback(tmp_path):
    (tmp_path / "checkpoint_last-shared.pt").write_bytes(b"old")
    for error, raised in ((OSError(28, "No space left on device"), SaveError),
                          (RuntimeError("[enforce fail at inline_container.cc] file write failed"), SaveError),
                          (AttributeError("a bug"), AttributeError)):
        sets = one_rank(tmp_path)
        sets.write({"x": 1}, str(tmp_path / "checkpoint_last-shared.pt"))
        with pytest.raises(raised) as e:
            sets.finish(error)
        assert e.value is error or "failed on rank 0 of 1" in str(e.value)
        assert os.listdir(tmp_path) == ["checkpoint_last-shared.pt"]  # staged file taken back
        assert (tmp_path / "checkpoint_last-shared.pt").read_bytes() == b"old"


def test_a_staged_file_gone_before_the_commit_replaces_nothing(tmp_path):
    (tmp_path / "checkpoint_last-shared.pt").write_bytes(b"old")
    sets = one_rank(tmp_path)
    sets.write({"x": 1}, str(tmp_path / "checkpoint_last-shared.pt"))
    sets.write({"x": 1}, str(tmp_path / "checkpoint_last-rank-0.pt"))
    os.remove(shards.staged_path(str(tmp_path / "checkpoint_last-rank-0.pt"), sets.save_id))
    with pytest.raises(SaveError, match="could not be committed on rank 0 .*rank-0.pt.* is gone.*nothing was replaced"):
        sets.finish()
    assert os.listdir(tmp_path) == ["checkpoint_last-shared.pt"]
    assert (tmp_path / "checkpoint_last-shared.pt").read_bytes() == b"old"


def test_a_reader_renaming_during_the_switch_does_not_fail_the_save(tmp_path):
    """fairseq-generate opens checkpoint_last while rank 0 switches (after the journal): whichever renames a
    file, the save is made."""
    base = str(tmp_path / "checkpoint_last")
    sets = commit.SetSave(str(tmp_path), "2" * 32, 0, 1, gather=lambda obj: [obj],
                          on_step=lambda step: step == "committed" and shards.finish_renames(base))
    sets.write({"x": 1}, shards.shared_path(base))
    sets.write({"x": 2}, shards.rank_path(base, 0))
    sets.finish()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last-rank-0.pt", "checkpoint_last-shared.pt"]


def test_recover_leaves_a_committed_save_whose_file_is_gone_and_what_it_retires(tmp_path, caplog):
    """A committed save one of whose staged files is gone (removed by hand): its set cannot be completed, so
    nothing is renamed or removed: the sets it retires stay for the resume to fall back to, and so do the
    journal and the staged files of its save."""
    sid = "3" * 32
    for name in ("checkpoint_1_2-shared.pt", "checkpoint_1_2-rank-0.pt", f"checkpoint_1_4-shared.pt.{sid}.staged"):
        (tmp_path / name).write_bytes(b"x")
    commit.write_journal(str(tmp_path), sid, "", 1, ["checkpoint_1_4"], ["checkpoint_1_2"])
    caplog.set_level("WARNING")
    commit.recover(str(tmp_path), "")
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint_1_2-shared.pt", "checkpoint_1_2-rank-0.pt",
                                                   f"checkpoint_1_4-shared.pt.{sid}.staged", f"moe-commit-{sid}.json"])
    assert f"moe-commit-{sid}.json: not acted on, left as it is: " in caplog.text
    assert "checkpoint_1_4-rank-0.pt is missing (neither staged by this save nor renamed)" in caplog.text
    assert len(caplog.records) == 1, caplog.text  # (not a second line saying it "does not read as one")


def test_set_names_for_fairseqs_model_loader(tmp_path):
    """--path A.pt:B.pt with --checkpoint-suffix -S, A-S a set and B-S.pt a file: fairseq gets A-S's shared
    file and B-S.pt (the suffix in both names, none passed on); a path naming nothing is one error."""
    from fairseq_moe.hooks.trainer import models_by_set_name
    from fairseq_moe.errors import MissingCheckpointError

    for name in ("a-S-shared.pt", "a-S-rank-0.pt", "b-S.pt", "c.pt"):
        (tmp_path / name).write_bytes(b"x")
    seen = []
    load = models_by_set_name(lambda *args: seen.append(args))
    load([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")], None, None, True, "-S", 1, None)
    assert seen[-1][0] == [str(tmp_path / "a-S-shared.pt"), str(tmp_path / "b-S.pt")] and seen[-1][4] == ""
    load([str(tmp_path / "c.pt")], None, None, True, "", 1, None)  # what fairseq finds: as given
    assert seen[-1][0] == [str(tmp_path / "c.pt")]
    with pytest.raises(MissingCheckpointError, match="d-S.pt: no such checkpoint"):
        load([str(tmp_path / "d.pt")], None, None, True, "-S", 1, None)
