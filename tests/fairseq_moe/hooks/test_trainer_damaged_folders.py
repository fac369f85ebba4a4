"""Damaged save folders, as a kill or a careless copy leaves them: each gives the right checkpoint or one
clear error naming the file, and every file that was there before is still there, byte for byte.

The sets are cut from a real one-process checkpoint by reshard (what W ranks would have written); the
runs are fairseq-train and fairseq-generate in this process, plus two 2-rank launches for what every
rank must do alike (one error line, exit code 2, no traceback).
"""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe.errors import CheckpointError, MissingCheckpointError
from fairseq_moe.reshard import main as reshard_main

from tests import warm
from tests.fairseq_moe.helpers import USER_DIR, error_lines, run_generate, run_train, tail, train_argv

ARGS = ("--moe-expert-count", "4", "--required-batch-size-multiple", "1")
# The runs whose saves are faulted (here and in test_trainer_save_faults.py): a set every 2 updates, the last kept.
SAVES = (*ARGS, "--max-tokens", "100", "--save-interval-updates", "2", "--keep-interval-updates", "1",
         "--max-update", "6")


def snapshot(folder):
    """{relative path: sha256} of every file under folder."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def make_set(trained, folder, name="checkpoint_last", world_size=2):
    assert reshard_main([str(trained), str(folder / f"{name}.pt"), "--world-size", str(world_size)]) == 0
    return str(folder / name)


def updates(state):
    return state["optimizer_history"][-1]["num_updates"]


@pytest.mark.parametrize("how", ["restore-file", pytest.param("auto-resume", marks=pytest.mark.slow)])
@pytest.mark.parametrize("damage", ["no shared file", "no rank file", "truncated rank file", "empty shared file"])
def test_a_damaged_set_is_an_error_never_a_fresh_start(data_bin, trained_checkpoint, tmp_path, how, damage):
    save = tmp_path / "save"
    base = make_set(trained_checkpoint, save)
    missing_or_bad = {"no shared file": shards.shared_path(base), "no rank file": shards.rank_path(base, 1),
                      "truncated rank file": shards.rank_path(base, 1),
                      "empty shared file": shards.shared_path(base)}[damage]
    if damage.startswith("no "):
        os.remove(missing_or_bad)
    elif damage == "truncated rank file":
        data = open(missing_or_bad, "rb").read()
        open(missing_or_bad, "wb").write(data[:len(data) // 2])
    else:
        open(missing_or_bad, "wb").close()
    before = snapshot(tmp_path)
    extra = ("--restore-file", base + ".pt", "--save-dir", str(tmp_path / "elsewhere")) if how == "restore-file" else ()
    error = MissingCheckpointError if damage.startswith("no ") else CheckpointError
    with pytest.raises(error, match=os.path.basename(missing_or_bad)):
        run_train(train_argv(data_bin, save, *ARGS, "--max-update", "4", "--keep-interval-updates", "1",
                             "--save-interval-updates", "1", *extra))
    assert snapshot(tmp_path) == before  # nothing written, nothing deleted


@pytest.mark.slow
def test_an_explicit_name_loads_what_it_names(data_bin, trained_checkpoint, tmp_path):
    """A set (update 2) and a later single file (update 3) of one name: NAME-shared.pt and NAME-rank-R.pt
    are the set, for generate, restore and reshard alike; the bare NAME.pt is the later save."""
    base = make_set(trained_checkpoint, tmp_path)  # checkpoint_last-{shared,rank-0,rank-1}.pt: update 2
    later = tmp_path / "later"
    run_train(train_argv(data_bin, later, *ARGS, "--max-update", "3", "--restore-file", str(trained_checkpoint)))
    shutil.copy(later / "checkpoint_last.pt", base + ".pt")  # update 3, saved after the set
    before = snapshot(tmp_path)

    from fairseq import checkpoint_utils

    assert updates(checkpoint_utils.load_checkpoint_to_cpu(base + ".pt")) == 3
    for name in (shards.shared_path(base), shards.rank_path(base, 1)):
        assert updates(checkpoint_utils.load_checkpoint_to_cpu(name)) == 2
    assert shards.resolve(base + ".pt")[2] == f"saved later than the set {shards.shared_path(base)}"

    assert reshard_main([shards.shared_path(base), str(tmp_path / "out" / "one.pt"), "--world-size", "1"]) == 0
    assert updates(torch.load(tmp_path / "out" / "one.pt", weights_only=True)) == 2

    for name, expect in ((shards.shared_path(base), 2), (base + ".pt", 3)):
        resumed = tmp_path / f"resumed{expect}"
        run_train(train_argv(data_bin, resumed, *ARGS, "--max-update", str(expect + 1), "--restore-file", name))
        history = torch.load(resumed / "checkpoint_last.pt", weights_only=True)["optimizer_history"]
        assert [h["num_updates"] for h in history][-2:] == [expect, expect + 1]

    scorer = run_generate([data_bin, "--user-dir", USER_DIR, "--path", shards.shared_path(base),
                           "--task", "moe_translation", "--gen-subset", "test", "--beam", "1", "--cpu"])
    assert "BLEU" in scorer.result_string()
    snap = snapshot(tmp_path)
    assert {k: v for k, v in snap.items() if k in before} == before


def test_generate_names_an_unreadable_shared_file(data_bin, trained_checkpoint, tmp_path):
    base = make_set(trained_checkpoint, tmp_path)
    open(shards.shared_path(base), "wb").close()
    with pytest.raises(CheckpointError, match="checkpoint_last-shared.pt is empty"):
        run_generate([data_bin, "--user-dir", USER_DIR, "--path", shards.shared_path(base),
                      "--task", "moe_translation", "--gen-subset", "test", "--cpu"])


@pytest.mark.parametrize("content", ["a list", "an empty dict", "a list named like a shared file",
                                     "a set with a rank tensor of the wrong shape"])
def test_readable_files_of_the_wrong_shape_are_named(trained_checkpoint, tmp_path, content):
    """Files that torch.load reads but that are no fairseq checkpoint: one error naming the file, from
    fairseq's loader (generate, interactive, eval-lm and the hub go through it)."""
    from fairseq import checkpoint_utils

    path = tmp_path / "x.pt"
    if content == "a list":
        torch.save([1, 2, 3], path)
    elif content == "an empty dict":
        torch.save({}, path)
    elif content == "a list named like a shared file":
        path = tmp_path / "x-shared.pt"
        torch.save([1, 2, 3], path)
    else:
        base = make_set(trained_checkpoint, tmp_path, "x")
        shard = torch.load(shards.rank_path(base, 1), weights_only=True)
        name = next(iter(shard["model"]))
        shard["model"][name] = torch.zeros(2)
        torch.save(shard, shards.rank_path(base, 1))
        path = tmp_path / "x-shared.pt"
    with pytest.raises(CheckpointError, match=r"x(-shared)?\.pt|the checkpoint set .*/x-shared\.pt"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


@pytest.mark.slow
def test_another_expert_count_is_named(data_bin, trained_checkpoint, tmp_path):
    for source in (str(trained_checkpoint), make_set(trained_checkpoint, tmp_path / "set") + "-shared.pt"):
        with pytest.raises(CheckpointError, match=r"saved with 4 experts .*\(--moe-expert-count 2\)"):
            run_train(train_argv(data_bin, tmp_path / "two", "--moe-expert-count", "2", "--max-update", "3",
                                 "--restore-file", source))


def launch_2(data_bin, save, *extra):
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-train",
           *train_argv(data_bin, save, *extra)]
    return warm.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bad flag", "other expert count"])
def test_two_ranks_print_one_error_line_and_exit_2(data_bin, trained_checkpoint, tmp_path, case):
    if case == "bad flag":
        out = launch_2(data_bin, tmp_path / "a", "--moe-expert-ffn-dim", "0")
        expected = "fairseq-train: error: --moe-expert-ffn-dim must be >= 1"
    else:
        source = make_set(trained_checkpoint, tmp_path / "set") + ".pt"
        before = snapshot(tmp_path)
        out = launch_2(data_bin, tmp_path / "b", "--moe-expert-count", "2", "--restore-file", source)
        expected = "fairseq-train: error: "
        assert snapshot(tmp_path / "set") == {k[len("set/"):]: v for k, v in before.items()}
    log = out.stdout + out.stderr
    errors = error_lines(log)
    assert out.returncode == 2, tail(log)
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert "Traceback" not in log
    if case == "other expert count":
        assert "saved with 4 experts" in errors[0] and "--moe-expert-count 2" in errors[0]


# fairseq-train with a fault in one rank's save of checkpoint_1_4: FAULT RANK USER_DIR, then fairseq-train's argv.
FAULTY = """
import os, resource, signal, sys
import fairseq  # first: importing the plugin (from the --user-dir fairseq will name) then registers it
fault, victim, user_dir = sys.argv[1:4]
sys.path.insert(0, os.path.dirname(user_dir))
from fairseq_moe.checkpoints import commit
mine = lambda path: os.environ.get("RANK", "0") == victim and "checkpoint_1_4" in path  # (one process: rank 0)
write, step = commit.write_synced, commit.SetSave._step
def faulty_write(obj, path):
    if mine(path) and fault == "mid-write":
        with open(path, "wb") as f:
            f.write(b"PK half a file")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if mine(path) and fault == "disk full":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    if mine(path) and fault == "full in torch.save":  # inside the file torch.save writes, past its first record
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    return write(obj, path)
if fault == "full in torch.save":  # (says how torch.save itself failed)
    import torch
    torch_save = torch.save
    def noted_save(*args, **kwargs):
        try:
            return torch_save(*args, **kwargs)
        except Exception as e:
            print(f"torch.save raised {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise
    torch.save = noted_save
def faulty_step(self, name):
    if name == fault and any(mine(f) for f in self.staged):
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, name)
commit.write_synced, commit.SetSave._step = faulty_write, faulty_step
from fairseq_cli.train import cli_main
sys.argv = ["fairseq-train"] + sys.argv[4:]
cli_main()
"""


def launch_w(W, data_bin, save, *extra, fault=None, victim=None, script=None):
    """fairseq-train on W ranks; with a fault: through FAULTY at `script`."""
    program, preload = ["fairseq-train"], []
    if fault is not None:
        script.write_text(FAULTY)
        program = [sys.executable, str(script), fault, str(victim), USER_DIR]
        preload = ["--preload", "fairseq_cli.train", "--preload", "torch._dynamo"]  # (imported once, not per rank)
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--grace-seconds", "5", *preload, "--",
           *program, *train_argv(data_bin, save, *extra)]
    return warm.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    timeout=600)


@pytest.mark.slow
def test_a_set_this_run_did_not_write_survives_its_saves(data_bin, tmp_path):
    """A partial set in the save folder (no rank-0 file: being copied in, or restored in part) is left alone
    by every save; --keep-* only retires what its rules drop."""
    save = tmp_path / "save"
    save.mkdir()
    for name in ("checkpoint_best_old-shared.pt", "checkpoint_1_99-rank-1.pt", "checkpoint3-shared.pt"):
        (save / name).write_bytes(b"partial")
    out = launch_w(2, data_bin, save, *ARGS, "--max-update", "3", "--save-interval-updates", "1",
                   "--keep-interval-updates", "5", "--max-tokens", "100")
    assert out.returncode == 0, tail(out.stdout + out.stderr)
    for name in ("checkpoint_best_old-shared.pt", "checkpoint_1_99-rank-1.pt", "checkpoint3-shared.pt"):
        assert (save / name).read_bytes() == b"partial"


@pytest.mark.slow
def test_a_usage_error_is_printed_by_rank_0_alone(data_bin, tmp_path):
    """argparse's own errors (a value that is no int) come before the ranks know of each other: under the
    launcher, only rank 0 prints the usage and the error."""
    out = launch_2(data_bin, tmp_path, "--moe-expert-count", "abc")
    errors = error_lines(out.stdout + out.stderr)
    assert out.returncode == 2
    assert errors == ["fairseq-train: error: argument --moe-expert-count: 'abc' is not a count nor a comma-separated "
                      "list of counts"]


def test_generate_and_eval_lm_take_a_set_by_its_name(data_bin, lm_data_bin, trained_checkpoint, tmp_path):
    """--path NAME.pt of an expert-parallel set, as fairseq-train and inspect take it; a path naming
    nothing is one error naming it."""
    from tests.fairseq_moe.helpers import lm_train_argv, run_eval_lm

    base = make_set(trained_checkpoint, tmp_path / "mt")
    generate = [data_bin, "--user-dir", USER_DIR, "--task", "moe_translation", "--gen-subset", "test", "--beam", "1",
                "--cpu", "--path"]
    assert "BLEU" in run_generate([*generate, base + ".pt"]).result_string()
    with pytest.raises(MissingCheckpointError, match=f"{tmp_path}/none.pt: no such checkpoint"):
        run_generate([*generate, str(tmp_path / "none.pt")])

    run_train(lm_train_argv(lm_data_bin, tmp_path / "lm", "--max-update", "1", "--moe-expert-count", "4"))
    lm = make_set(tmp_path / "lm" / "checkpoint_last.pt", tmp_path / "lm-set")
    one = run_eval_lm(lm_data_bin, tmp_path / "lm" / "checkpoint_last.pt")
    ppl = float(run_eval_lm(lm_data_bin, lm + ".pt")["perplexity"])
    assert ppl == pytest.approx(float(one["perplexity"]), rel=1e-5)


@pytest.mark.slow
def test_a_resume_takes_the_newest_complete_set_when_checkpoint_last_is_damaged(data_bin, trained_checkpoint,
                                                                               tmp_path, caplog):
    """checkpoint_last's rank file is gone (a copy restored in part): the automatic resume moves the damaged
    set aside, takes the newest complete set of the run's names, says both in one line, and nothing on disk is
    removed or replaced."""
    save = tmp_path / "save"
    older = make_set(trained_checkpoint, save, "checkpoint_1_1")
    newer = make_set(trained_checkpoint, save, "checkpoint_1_2")
    other = make_set(trained_checkpoint, save, "checkpoint_9_9-x")  # another suffix: not this run's
    for base, saved_at in ((older, 1.0), (other, 1e12)):  # saved before / "after" checkpoint_1_2
        shared = torch.load(shards.shared_path(base), weights_only=True)
        shared["extra_state"]["moe_checkpoint"]["saved_at"] = saved_at
        torch.save(shared, shards.shared_path(base))
    make_set(trained_checkpoint, save, "checkpoint_last")
    os.remove(save / "checkpoint_last-rank-1.pt")
    damaged = {k: v for k, v in snapshot(save).items() if k.startswith("checkpoint_last-")}
    caplog.set_level("WARNING", logger="fairseq_moe.hooks.trainer")
    run_train(train_argv(data_bin, save, *ARGS, "--max-update", "3"))
    lines = [r.getMessage() for r in caplog.records if "newest complete set" in r.getMessage()]
    assert len(lines) == 1 and "checkpoint_last-rank-1.pt is missing" in lines[0], lines
    assert f"resuming from the expert-parallel set {shards.shared_path(newer)} + rank files" in lines[0]
    assert "instead (update 2)" in lines[0]
    aside = {k: v for k, v in snapshot(save).items() if ".damaged-" in k}
    assert sorted(v for v in aside.values()) == sorted(damaged.values()), (aside, damaged)
    shared = next(k for k in aside if k.endswith("-shared.pt"))
    assert f"moved aside as {save / shared} and -rank-R.pt" in lines[0], lines
    assert [h["num_updates"] for h in torch.load(save / "checkpoint_last.pt", weights_only=True)
            ["optimizer_history"]][-2:] == [2, 3]
    for base in (older, newer, other):
        shards.check_set(base)


DAMAGED_RESUME = (*ARGS, "--max-tokens", "100", "--save-interval-updates", "3", "--keep-interval-updates", "1",
                  "--max-update", "8", "--disable-validation")
SHARDING = {"legacy_ddp": (), "zero": ("--zero-sharding", "os", "--clip-norm", "0.5"),
            "fsdp": ("--ddp-backend", "fully_sharded", "--min-params-to-wrap", "0", "--clip-norm", "0.5")}


@pytest.mark.slow
@pytest.mark.parametrize("W, damage, sharding", [(2, "missing", "legacy_ddp"), (4, "truncated", "legacy_ddp"),
                                                 (2, "truncated", "zero"), (2, "missing", "fsdp")])
def test_a_resume_never_saves_over_a_damaged_checkpoint_last(data_bin, tmp_path, W, damage, sharding):
    """W ranks save checkpoint_last at update 8 (and checkpoint_E_6); its rank-1 file is then missing or half
    copied (a folder being copied or restored). The same command resumes from checkpoint_E_6 and saves a new
    checkpoint_last, but the damaged set is moved aside first, byte for byte: once its rank-1 file is back under
    the new name, it is the whole update-8 state again."""
    save = tmp_path / "save"
    argv = (*DAMAGED_RESUME, *SHARDING[sharding])
    first = launch_w(W, data_bin, save, *argv)
    assert first.returncode == 0, tail(first.stdout + first.stderr)
    interval = sorted({k.split("-")[0] for k in os.listdir(save) if k.startswith("checkpoint_") and "last" not in k})
    assert len(interval) == 1, sorted(os.listdir(save))  # --keep-interval-updates 1: the set to fall back to
    fallback = updates(shards.assemble(str(save / interval[0])))
    rank1 = save / "checkpoint_last-rank-1.pt"
    whole = rank1.read_bytes()
    if damage == "missing":
        os.remove(rank1)
    else:
        rank1.write_bytes(whole[:len(whole) // 2])
    damaged = {k: v for k, v in snapshot(save).items() if k.startswith("checkpoint_last-")}
    resumed = launch_w(W, data_bin, save, *argv)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, tail(log)
    lines = [line for line in log.splitlines() if "cannot be resumed" in line]
    assert len(lines) == 1 and "moved aside as" in lines[0] and f"{interval[0]}-shared.pt" in lines[0], lines
    aside = {k: v for k, v in snapshot(save).items() if ".damaged-" in k}
    assert sorted(k.split(".damaged-")[1][8:] for k in aside) == sorted(k[len("checkpoint_last"):] for k in damaged)
    assert sorted(aside.values()) == sorted(damaged.values())
    base = str(save / next(k for k in aside if k.endswith("-shared.pt"))[:-len("-shared.pt")])
    with open(shards.rank_path(base, 1), "wb") as f:
        f.write(whole)  # the copy finished: the update-8 set is whole again
    shards.check_set(base)
    assert updates(shards.assemble(base)) == 8
    last = shards.assemble(str(save / "checkpoint_last"))
    assert [h["num_updates"] for h in last["optimizer_history"]][-2:] == [fallback, 8]


@pytest.mark.slow
def test_a_full_disk_inside_torch_save_on_one_process_is_one_line(data_bin, tmp_path):
    """One process (fairseq's own save, which tries torch.save three times and logs its traceback): the file-size
    limit met inside torch.save is one line naming the file, exit 1, and the previous checkpoints are as they
    were, with no temporary left."""
    save = tmp_path / "save"
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    cmd = [sys.executable, str(script), "full in torch.save", "0", USER_DIR, *train_argv(data_bin, save, *SAVES)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    log = out.stdout + out.stderr
    errors = error_lines(log)
    assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in log, tail(log)
    assert "torch.save raised RuntimeError: [enforce fail" in log, tail(log)
    assert f"checkpoint_1_4.pt.tmp: File too large" in errors[0] and "nothing was replaced" in errors[0], errors
    assert sorted(os.listdir(save)) == ["checkpoint_1_2.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    assert updates(torch.load(save / "checkpoint_last.pt", weights_only=True)) == 2
