"""The sharded checkpoint format (expert_checkpoint.py) and the reshard/consolidate commands.

A "full" state with E=4 experts is cut the way W training ranks save it; putting the set back together,
at any world size and for any expert range, must give back exactly the full state: expert weights and
their optimizer state. Sets from two different saves, missing and truncated files are refused by name.
"""
import os
import time

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe.errors import CheckpointError
from fairseq_moe_layer.comm import local_experts
from fairseq_moe.reshard import main as reshard_main
from tests import warm

E = 4
EXPERTS = {"enc.moe.experts.w1": (E, 3, 5), "enc.moe.experts.b1": (E, 5)}
ORDER = ["shared.weight", "enc.moe.experts.w1", "enc.moe.experts.b1"]  # the optimizer's param order


def full_state(updates=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"shared.weight": (6, 3), **EXPERTS}
    model = {n: torch.randn(shapes[n], generator=g) for n in ORDER}
    opt = {i: {"step": torch.tensor(float(updates)), "exp_avg": torch.randn(shapes[n], generator=g),
               "exp_avg_sq": torch.rand(shapes[n], generator=g)} for i, n in enumerate(ORDER)}
    return {
        "model": model,
        "last_optimizer_state": {"state": opt, "param_groups": [{"params": [0, 1, 2], "lr": 0.1}]},
        "optimizer_history": [{"num_updates": updates}],
        "extra_state": {"train_iterator": {"epoch": 2, "iterations_in_epoch": 6}, "val_loss": 1.5},
    }


def info(W, updates=7, save_id="s1"):
    return shards.manifest(updates, save_id, W, {n: s[0] for n, s in EXPERTS.items()},
                           {n: ORDER.index(n) for n in EXPERTS}, W)


def save_as_ranks(folder, W, state=None, save_id="s1"):
    """Write the files W ranks of a training run write (what checkpoint.py does at each save)."""
    state = state or full_state()
    base = str(folder / "checkpoint_last")
    for r in range(W):
        spread = {n: local_experts(E, W, r) for n in EXPERTS}
        mine = shards.cut_for_rank(dict(state, extra_state=dict(state["extra_state"], moe_checkpoint=info(W))),
                                   {n: (f, c, E) for n, (f, c) in spread.items()})
        shared, shard = shards.split(mine, spread, r, info(W, save_id=save_id))
        torch.save(shard, shards.rank_path(base, r))
        if r == 0:
            torch.save(shared, shards.shared_path(base))
    return base


def assert_same(state, ref):
    torch.testing.assert_close(state["model"], ref["model"], rtol=0, atol=0)
    torch.testing.assert_close(state["last_optimizer_state"]["state"], ref["last_optimizer_state"]["state"],
                               rtol=0, atol=0)
    assert state["last_optimizer_state"]["param_groups"] == ref["last_optimizer_state"]["param_groups"]


@pytest.mark.parametrize("W", [1, 2, 4, 8])  # 8 > E: two replicas of each expert
def test_set_assembles_to_full_state(tmp_path, W):
    base = save_as_ranks(tmp_path, W)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["checkpoint_last-shared.pt"] + [f"checkpoint_last-rank-{r}.pt" for r in range(W)])
    shard = torch.load(shards.rank_path(base, W - 1), weights_only=True)
    assert shard["model"]["enc.moe.experts.w1"].shape[0] == max(E // W, 1)
    assert "enc.moe.experts.w1" not in torch.load(shards.shared_path(base), weights_only=True)["model"]
    assert_same(shards.assemble(base), full_state())


@pytest.mark.parametrize("W, W_new", [(2, 4), (4, 1), (4, 8), (8, 2)])
def test_each_new_rank_reads_its_experts(tmp_path, W, W_new):
    base = save_as_ranks(tmp_path, W)
    full = full_state()
    for r in range(W_new):
        first, count = local_experts(E, W_new, r)
        state = shards.assemble(base, want={n: (first, first + count) for n in EXPERTS})
        for n in EXPERTS:
            i = ORDER.index(n)
            assert torch.equal(state["model"][n], full["model"][n][first:first + count])
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state["last_optimizer_state"]["state"][i][k],
                                   full["last_optimizer_state"]["state"][i][k][first:first + count])
            assert state["last_optimizer_state"]["state"][i]["step"] == 7


def test_names_of_a_set(tmp_path):
    base = save_as_ranks(tmp_path, 2)
    for name in ("checkpoint_last.pt", "checkpoint_last-shared.pt", "checkpoint_last-rank-1.pt",
                 "checkpoint_last-rank-5.pt"):  # a rank of a larger new world size
        assert shards.locate(str(tmp_path / name)) == ("set", base)
    assert shards.locate(str(tmp_path / "checkpoint_best.pt")) is None  # fairseq: a fresh start
    torch.save({}, tmp_path / "plain.pt")
    assert shards.locate(str(tmp_path / "plain.pt")) == ("file", str(tmp_path / "plain.pt"))


def test_missing_stale_and_truncated_files_are_named(tmp_path):
    base = save_as_ranks(tmp_path, 4)
    os.remove(shards.rank_path(base, 2))
    with pytest.raises(FileNotFoundError, match="checkpoint_last-rank-2.pt is missing"):
        shards.assemble(base)

    # A crash in the middle of a save: rank 2 wrote the new update, the others did not.
    later = tmp_path / "later"
    later.mkdir()
    save_as_ranks(later, 4, full_state(updates=9), save_id="s2")
    os.replace(shards.rank_path(str(later / "checkpoint_last"), 2), shards.rank_path(base, 2))
    with pytest.raises(ValueError, match=r"rank-2.pt does not belong with .*shared.pt: its save_id"):
        shards.assemble(base)

    with open(shards.rank_path(base, 2), "wb") as f:
        f.write(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="rank-2.pt cannot be read"):
        shards.assemble(base)

    os.remove(shards.shared_path(base))
    with pytest.raises(FileNotFoundError, match="checkpoint_last-shared.pt is missing.*found 4 rank files"):
        shards.assemble(base)


def test_iterator_position_moves_with_the_world_size():
    state = dict(full_state(), extra_state={"train_iterator": {"epoch": 2, "iterations_in_epoch": 6},
                                            "moe_checkpoint": info(2)})
    pos = lambda W: shards.rescale_iterator(state, W, "x.pt")["extra_state"]["train_iterator"]  # noqa: E731
    assert pos(1)["iterations_in_epoch"] == 12 and pos(4)["iterations_in_epoch"] == 3
    assert pos(2)["iterations_in_epoch"] == 6
    with pytest.raises(CheckpointError, match="x.pt: written by 2 ranks after 6 batches.*--reset-dataloader"):
        pos(5)  # (one line at the command line, like every CheckpointError)


def test_reshard_and_consolidate_commands(tmp_path, capsys):
    (tmp_path / "w2").mkdir()
    base = save_as_ranks(tmp_path / "w2", 2)
    four = str(tmp_path / "w4" / "ckpt.pt")
    assert reshard_main([base + ".pt", four, "--world-size", "4"]) == 0
    assert len(capsys.readouterr().out.split()) == 5  # 4 rank files and the shared file
    one = str(tmp_path / "one.pt")
    assert reshard_main([four, one], prog="consolidate", world_size=1) == 0
    consolidated = torch.load(one, weights_only=True)
    assert_same(consolidated, full_state())
    assert consolidated["extra_state"]["moe_checkpoint"]["world_size"] == 1
    # and back from the single file to a set
    assert reshard_main([one, str(tmp_path / "w8" / "ckpt.pt"), "--world-size", "8"]) == 0
    assert_same(shards.assemble(str(tmp_path / "w8" / "ckpt")), full_state())

    assert reshard_main([base + ".pt", four, "--world-size", "4"]) == 2  # never overwrites
    assert "ckpt-rank-0.pt exists" in capsys.readouterr().err
    assert reshard_main([base + ".pt", str(tmp_path / "w3.pt"), "--world-size", "3"]) == 2
    assert "--world-size 3" in capsys.readouterr().err
    assert reshard_main([str(tmp_path / "nothing.pt"), str(tmp_path / "x.pt"), "--world-size", "2"]) == 2
    assert "nothing.pt: no such checkpoint" in capsys.readouterr().err


def test_a_set_file_name_never_means_a_single_file(tmp_path):
    """NAME-rank-R.pt / NAME-shared.pt name the set NAME; with only the single file NAME.pt there, they
    name nothing (the trainer maps fairseq's per-rank NAME-rank-R.pt back to the user's NAME.pt)."""
    torch.save(full_state(updates=5), tmp_path / "ckpt.pt")
    assert shards.locate(str(tmp_path / "ckpt.pt")) == ("file", str(tmp_path / "ckpt.pt"))
    assert shards.locate(str(tmp_path / "ckpt-rank-1.pt")) is None
    assert shards.locate(str(tmp_path / "ckpt-shared.pt")) is None


@pytest.mark.parametrize("set_first", [True, False])
def test_set_and_single_file_of_one_name_the_later_save_wins(tmp_path, set_first):
    """Training in one folder on 1 process, then on 2, then on 1 again (maybe with --reset-optimizer,
    which restarts the update count): the checkpoint saved last is the one resumed."""
    base = str(tmp_path / "checkpoint_last")
    for step in ("set", "file") if set_first else ("file", "set"):
        if step == "set":
            save_as_ranks(tmp_path, 2)  # update 7
        else:
            state = full_state(updates=3)
            state["extra_state"]["moe_checkpoint"] = {"saved_at": time.time()}
            torch.save(state, base + ".pt")
        time.sleep(0.01)
    wins = "file" if set_first else "set"
    assert shards.locate(base + ".pt")[0] == wins
    assert shards.resolve(base + ".pt")[2] == ("saved later than the set " + shards.shared_path(base)
                                               if set_first else f"saved later than the single file {base}.pt")
    for name in (shards.rank_path(base, 1), shards.shared_path(base)):  # named explicitly: the set
        assert shards.locate(name) == ("set", base)


def test_single_files_with_set_like_names_are_single_files(tmp_path):
    for name in ("model-rank-1.pt", "model-shared.pt"):
        torch.save(full_state(), tmp_path / name)
        assert shards.locate(str(tmp_path / name)) == ("file", str(tmp_path / name))
    one = str(tmp_path / "w2" / "ckpt.pt")
    (tmp_path / "w2").mkdir()
    save_as_ranks(tmp_path / "w2", 2)
    reshard_main([str(tmp_path / "w2" / "checkpoint_last.pt"), str(tmp_path / "c-shared.pt"),
                  "--world-size", "1"])  # a consolidated file named like a shared file
    assert shards.locate(str(tmp_path / "c-shared.pt")) == ("file", str(tmp_path / "c-shared.pt"))
    assert shards.locate(one) is None


def test_state_that_is_not_per_expert_is_refused(tmp_path):
    """Adafactor keeps column statistics of a [E, f] bias that mix the experts: no exact cut exists."""
    state = full_state()
    state["last_optimizer_state"]["state"][2]["exp_avg_sq_col"] = torch.ones(5)
    state["extra_state"]["moe_checkpoint"] = info(2)
    with pytest.raises(ValueError, match="'exp_avg_sq_col' of shape \\(5,\\) is not per expert"):
        shards.cut_for_rank(state, {n: (0, 2, E) for n in EXPERTS})


def test_assembled_state_is_not_backed_by_the_files(tmp_path):
    """What is loaded gets trained on: overwriting the checkpoint files later must not change it."""
    base = save_as_ranks(tmp_path, 2)
    state = shards.assemble(base)
    before = {k: v.clone() for k, v in state["model"].items()}
    later = tmp_path / "later"
    later.mkdir()
    other = save_as_ranks(later, 2, full_state(seed=1))
    for f in os.listdir(later):  # overwrite in place, as fairseq's copy to checkpoint_last does
        with open(later / f, "rb") as src, open(tmp_path / f, "r+b") as dst:
            dst.write(src.read())
    assert other and all(torch.equal(state["model"][k], v) for k, v in before.items())


# ----- with fairseq-train ---------------------------------------------------------------------------

SGD = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9", "--moe-capacity-factor", "0",
       "--dropout", "0", "--required-batch-size-multiple", "1")


@pytest.mark.slow
def test_fine_tuning_flag_does_not_hide_a_set_to_resume(data_bin, tmp_path):
    """A save folder whose checkpoint_last exists only as a set: fairseq would take the run for a first
    launch and start --finetune-from-model over it. It resumes instead."""
    from tests.fairseq_moe.helpers import run_train, train_argv

    run_train(train_argv(data_bin, tmp_path / "a", *SGD, "--max-update", "2"))
    for name in ("b", "c"):
        assert reshard_main([str(tmp_path / "a" / "checkpoint_last.pt"),
                             str(tmp_path / name / "checkpoint_last.pt"), "--world-size", "2"]) == 0
    run_train(train_argv(data_bin, tmp_path / "b", *SGD, "--max-update", "3"))
    run_train(train_argv(data_bin, tmp_path / "c", *SGD, "--max-update", "3",
                         "--finetune-from-model", str(tmp_path / "a" / "checkpoint_last.pt")))
    b = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=True)
    c = torch.load(tmp_path / "c" / "checkpoint_last.pt", weights_only=True)
    torch.testing.assert_close(c["model"], b["model"], rtol=0, atol=0)
    torch.testing.assert_close(c["last_optimizer_state"], b["last_optimizer_state"], rtol=0, atol=0)

    # --finetune-from-model NAME.pt of a set (fairseq checks that the path exists): the same run as
    # fine-tuning from the single file the set was cut from.
    assert reshard_main([str(tmp_path / "a" / "checkpoint_last.pt"), str(tmp_path / "s" / "model.pt"),
                         "--world-size", "2"]) == 0
    assert not (tmp_path / "s" / "model.pt").exists()
    for name, source in (("f", tmp_path / "s" / "model.pt"), ("g", tmp_path / "a" / "checkpoint_last.pt")):
        run_train(train_argv(data_bin, tmp_path / name, *SGD, "--max-update", "2",
                             "--finetune-from-model", str(source)))
    f = torch.load(tmp_path / "f" / "checkpoint_last.pt", weights_only=True)
    g = torch.load(tmp_path / "g" / "checkpoint_last.pt", weights_only=True)
    torch.testing.assert_close(f["model"], g["model"], rtol=0, atol=0)


@pytest.mark.slow
def test_two_ranks_resume_a_four_rank_set_and_clean_up_only_its_files(data_bin, tmp_path):
    """--restore-file in a folder whose name holds ".pt" (fairseq's suffix replace would miss it), a set
    of an earlier 4-rank run overwritten by 2 ranks (its rank files 2 and 3 go), a partial set this run
    never wrote and a user's file that merely ends in -shared.pt (they stay)."""
    import subprocess
    import sys

    from tests.fairseq_moe.helpers import run_train, tail, train_argv

    run_train(train_argv(data_bin, tmp_path / "a", *SGD, "--max-update", "2"))
    save = tmp_path / "run.pt2" / "save"
    assert reshard_main([str(tmp_path / "a" / "checkpoint_last.pt"), str(save / "checkpoint_last.pt"),
                         "--world-size", "4"]) == 0
    torch.save({"mine": torch.ones(1)}, save / "notes-shared.pt")
    # What a killed earlier run left: a temporary of a save (the next save removes it), and a set without
    # its rank-0 file (being copied in, or restored in part: no save of this run retired it, so it stays),
    # and a user's look-alike files (they stay).
    for name in ("checkpoint_last-rank-1.pt.tmp", "checkpoint_1_1-shared.pt", "checkpoint_1_1-rank-1.pt",
                 "notes.pt.tmp", "checkpoint_1_1-rank-1.pt.bak"):
        (save / name).write_bytes(b"x")
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-train",
           *train_argv(data_bin, save, *SGD, "--max-update", "3", "--no-save-optimizer-state",
                       "--restore-file", str(save / "checkpoint_last.pt"))]
    out = warm.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                   timeout=600)
    assert out.returncode == 0, tail(out.stderr)
    state = shards.assemble(str(save / "checkpoint_last"))
    assert [h["num_updates"] for h in state["optimizer_history"]][-2:] == [2, 3]  # resumed at 2
    assert sorted(os.listdir(save)) == sorted(
        ["notes-shared.pt", "notes.pt.tmp", "checkpoint_1_1-rank-1.pt.bak", "checkpoint_1_1-shared.pt",
         "checkpoint_1_1-rank-1.pt"]
        + [f"checkpoint_{n}-{r}.pt" for n in ("last", "best") for r in ("shared", "rank-0", "rank-1")])

    missing = str(tmp_path / "nothing.pt")
    with pytest.raises(FileNotFoundError, match=f"--restore-file {missing}: no such checkpoint"):
        run_train(train_argv(data_bin, tmp_path / "d", *SGD, "--restore-file", missing))


def test_files_without_save_times_compare_by_update(tmp_path):
    base = save_as_ranks(tmp_path, 2)  # update 7, with a save time
    shared = torch.load(shards.shared_path(base), weights_only=True)
    del shared["extra_state"]["moe_checkpoint"]["saved_at"]  # as written before save times existed
    torch.save(shared, shards.shared_path(base))
    for updates, wins in ((5, "set"), (9, "file")):
        torch.save(full_state(updates=updates), base + ".pt")
        assert shards.locate(base + ".pt")[0] == wins


def test_a_rank_file_without_its_ema_experts_is_refused(tmp_path):
    """--store-ema: a set whose shared file holds the EMA of the shared parameters but one of whose rank files
    lacks its experts' EMA (a damaged set) is an error naming that file, not an EMA silently restarted."""
    from fairseq_moe.errors import CheckpointError

    E, W = 4, 2
    name = "encoder.layers.1.fc1.moe.experts.w1"
    model = {name: torch.randn(E, 3, 2), "encoder.norm.weight": torch.randn(3)}
    state = {"model": model, "extra_state": {"ema": {k: v + 1 for k, v in model.items()}}, "args": None}
    info = shards.manifest(1, shards.new_save_id(), W, {name: E}, {}, W)
    base = str(tmp_path / "set")
    for r in range(W):
        shared, shard = shards.split(shards.cut_for_rank(state, {name: (2 * r, 2, E)}), {name: (2 * r, 2)}, r, info)
        if r == 1:
            del shard["ema"][name]
        torch.save(shard, shards.rank_path(base, r))
        if r == 0:
            torch.save(shared, shards.shared_path(base))
    with pytest.raises(CheckpointError, match=r"set-rank-1\.pt lacks the ema"):
        shards.assemble(base)
