"""Journals a save did not write: each row is a file named like moe-commit-SAVEID.json, crafted or copied from
another run, in a folder that holds a complete 2-rank set checkpoint_last and other files. Neither recover() (a
resume, a save) nor a reader (fairseq-generate, reshard: expert_checkpoint.resolve) may act on it: nothing is
renamed or removed, nothing blocks or runs out of memory, and there is one warning naming the journal. The last
rows are the control: a journal of a save stopped in its switch is still finished."""
import hashlib
import json
import logging
import os
import threading

import pytest
import torch

from fairseq_moe.checkpoints import commit
from fairseq_moe.checkpoints import sets as shards

W, E = 2, 2
# the save on disk; another run's; a stopped save of this run; an earlier save of this run
OURS, THEIRS, NEW, EARLIER = "a" * 32, "b" * 32, "c" * 32, "d" * 32


def write_set(folder, name, save_id, staged=False, world_size=W):
    """A real set NAME of world_size ranks as a save with save_id writes it (under staged names if asked)."""
    info = shards.manifest(4, save_id, world_size, {"l.experts.w1": E}, {}, world_size)
    state = {"model": {"shared.w": torch.ones(2), "l.experts.w1": torch.zeros(E, 3)},
             "extra_state": {"moe_checkpoint": info}, "optimizer_history": [{"num_updates": 4}]}
    for rank in range(world_size):
        first, count = (rank * E) // world_size, E // world_size
        part = dict(state, model=dict(state["model"], **{"l.experts.w1": torch.zeros(E, 3)[first:first + count]}))
        shared, mine = shards.split(part, {"l.experts.w1": (first, count)}, rank, info)
        base = os.path.join(folder, name)
        for obj, final in ((mine, shards.rank_path(base, rank)), (shared, shards.shared_path(base))):
            if final.endswith("-shared.pt") and rank:
                continue
            torch.save(obj, shards.staged_path(final, save_id) if staged else final)


def snapshot(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path):
            out[name] = os.readlink(path) if os.path.islink(path) else "special"
        else:
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def journal(**fields):
    return json.dumps(dict({"save_id": THEIRS, "world_size": W, "commit": ["checkpoint_last"], "retire": []},
                           **fields))


def plain(text):
    return lambda path: write(path, text.encode())


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def fifo(path):
    os.mkfifo(path)


def link_to(target):
    return lambda path: os.symlink(target, path)


def staged_link(path):
    """A journal that commits checkpoint_last in a save whose staged shared file is a link to another file."""
    folder = os.path.dirname(path)
    os.symlink(os.path.join(folder, "precious-shared.pt"),
               shards.staged_path(os.path.join(folder, "checkpoint_last-shared.pt"), THEIRS))
    plain(journal())(path)


def beyond_world(path):
    """world_size 1, but this save staged a rank-1 file too."""
    folder = os.path.dirname(path)
    write_set(folder, "checkpoint_1_8", THEIRS, staged=True)
    plain(journal(commit=["checkpoint_1_8"], world_size=1))(path)


def retires_its_own(path):
    """The id of the save on disk, which wrote checkpoint_3_300 and checkpoint_last: commits one, retires the other."""
    write_set(os.path.dirname(path), "checkpoint_3_300", OURS)
    plain(journal(save_id=OURS, commit=["checkpoint_3_300"], retire=["checkpoint_last"]))(path)


# (case, how the journal is made, what its warning says)
CRAFTED = [
    ("retires another name", plain(journal(retire=["precious"])), "'precious' is not a checkpoint name of this run"),
    ("retires checkpoint_last, commits nothing", plain(journal(commit=[], retire=["checkpoint_last"])),
     "it commits no set"),
    ("copied from another run, retires checkpoint_last", plain(journal(commit=["checkpoint_1_2"],
                                                                       retire=["checkpoint_last"])),
     "checkpoint_1_2-shared.pt is not this save's"),
    ("world_size 1 over a 2-rank set", plain(journal(world_size=1)), "checkpoint_last-shared.pt is not this save's"),
    ("world_size 1 with a rank-1 file staged", beyond_world, "was staged by this save but is not one of the 1 ranks'"),
    ("world_size 10**9", plain(journal(world_size=10 ** 9)), "world_size (1..65536)"),
    ("world_size true", plain(journal(world_size=True)), "world_size (1..65536)"),
    ("commits and retires one name", plain(journal(retire=["checkpoint_last"])), "both commits and retires"),
    ("a name with a folder", plain(journal(commit=["../checkpoint_last"])), "is not a checkpoint name of this run"),
    ("another suffix's name", plain(journal(commit=["checkpoint_last-x"])), "is not a checkpoint name of this run"),
    ("save_id not its name's", plain(journal(save_id=OURS)), "is not the one in its name"),
    ("a staged file that is a link", staged_link, "is not a regular file (a link?)"),
    ("a FIFO", fifo, "not a regular file"),
    ("a link to the zero device", link_to("/dev/zero"), "a symbolic link"),
    ("a link to a real journal", link_to("elsewhere.json"), "a symbolic link"),
    ("deeply nested JSON", plain("[" * 200000), "not JSON (RecursionError)"),
    ("2 MB of JSON", plain(json.dumps({"pad": "x" * (2 << 20)})), "more than a journal's"),
    ("not UTF-8", lambda path: write(path, b"\xff\xfe{}"), "not JSON"),
    ("a list", plain("[]"), "not a journal"),
    ("names that are no strings", plain(journal(commit=[1])), "not a journal"),
    # with the id of the save on disk (read off its files): the world size must still be the files'
    ("the set's own id, world_size 1", plain(journal(save_id=OURS, world_size=1)), "of this save of 2 ranks, not 1"),
    ("the set's own id, world_size 3", plain(journal(save_id=OURS, world_size=3)), "of this save of 2 ranks, not 3"),
    ("the set's own id, retiring a real set", plain(journal(save_id=OURS, world_size=1, retire=["checkpoint_1_2"])),
     "of this save of 2 ranks, not 1"),
    ("the set's own id, retiring a set of that save", retires_its_own, "checkpoint_last-shared.pt, which is this save's"),
]
JOURNAL_ID = {case: OURS for case, *_ in CRAFTED if case.startswith("the set's own id")}


@pytest.fixture
def folder(tmp_path):
    write_set(str(tmp_path), "checkpoint_last", OURS)
    write_set(str(tmp_path), "precious", OURS)
    (tmp_path / "elsewhere.json").write_text(journal())
    return tmp_path


def within(seconds, fn):
    """fn() in a thread that must end within seconds (a FIFO would block it for ever)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still running after {seconds} s"
    return out[0]


@pytest.mark.parametrize("case, make, why", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_journal_this_run_did_not_write_is_left_alone(folder, caplog, case, make, why):
    write_set(str(folder), "checkpoint_1_2", EARLIER)  # (a set a journal could commit or retire)
    path = shards.journal_path(str(folder), JOURNAL_ID.get(case, THEIRS))
    make(path)
    before = snapshot(folder)
    caplog.set_level(logging.WARNING)
    getattr(shards, "_warned", set()).clear()  # (each case warns afresh)
    within(20, lambda: commit.recover(str(folder), ""))  # a resume, or before a save
    within(20, lambda: shards.resolve(str(folder / "checkpoint_last.pt")))  # a reader
    within(20, lambda: commit.recover(str(folder), ""))
    assert snapshot(folder) == before
    shards.check_set(str(folder / "checkpoint_last"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: not acted on, left as it is: "), warnings
    assert why in warnings[0], warnings


def test_a_journal_of_this_run_stopped_before_its_renames_is_finished(folder, caplog):
    """The control: this run's save of checkpoint_last, stopped at its commit (staged files and the journal
    on disk, retiring checkpoint_1_2): recover() switches it; so does a reader, for the set it opens."""
    write_set(str(folder), "checkpoint_last", NEW, staged=True)
    write_set(str(folder), "checkpoint_1_2", OURS)
    commit.write_journal(str(folder), NEW, "", W, ["checkpoint_last"], ["checkpoint_1_2"])
    reader = folder / "copy"
    os.mkdir(reader)
    for name in os.listdir(folder):
        if os.path.isfile(folder / name):
            os.link(folder / name, reader / name)
    caplog.set_level(logging.WARNING)
    assert shards.resolve(str(reader / "checkpoint_last.pt"))[:2] == ("set", str(reader / "checkpoint_last"))
    assert not [n for n in os.listdir(reader) if n.endswith(".staged")]
    commit.recover(str(folder), "")
    assert not [n for n in os.listdir(folder) if n.endswith(".staged") or n.startswith("moe-commit-")]
    assert not shards.set_files(str(folder / "checkpoint_1_2"))
    for where in (folder, reader):
        assert shards.manifest_of(torch.load(where / "checkpoint_last-shared.pt", weights_only=True))["save_id"] == NEW
        shards.check_set(str(where / "checkpoint_last"))
    assert not caplog.records


def test_a_journal_stopped_in_its_deletions_is_finished(folder):
    """The control: every committed file renamed already (each carries the save's id), a retired set half
    deleted: recover() finishes the deletions and removes the journal."""
    write_set(str(folder), "checkpoint_1_2", EARLIER)  # (an earlier save's)
    os.remove(folder / "checkpoint_1_2-rank-0.pt")
    commit.write_journal(str(folder), OURS, "", W, ["checkpoint_last"], ["checkpoint_1_2"])
    commit.recover(str(folder), "")
    assert sorted(os.listdir(folder)) == sorted(["checkpoint_last-shared.pt", "checkpoint_last-rank-0.pt",
                                                 "checkpoint_last-rank-1.pt", "precious-shared.pt",
                                                 "precious-rank-0.pt", "precious-rank-1.pt", "elsewhere.json"])


def test_a_read_only_folder_names_the_staged_file_not_yet_renamed(folder, monkeypatch):
    """A reader in a folder it cannot change (a read-only mount: os.replace fails with EROFS, even for a name
    that is gone), the save's shared file renamed already, its rank files not: the one line names a staged file
    that is there."""
    import errno

    from fairseq_moe.errors import CheckpointError

    write_set(str(folder), "checkpoint_last", NEW, staged=True)
    shared = str(folder / "checkpoint_last-shared.pt")
    os.replace(shards.staged_path(shared, NEW), shared)
    commit.write_journal(str(folder), NEW, "", W, ["checkpoint_last"], [])

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system", src)

    monkeypatch.setattr(shards.os, "replace", read_only)
    with pytest.raises(CheckpointError) as e:
        shards.resolve(str(folder / "checkpoint_last.pt"))
    assert f"{shards.staged_path(str(folder / 'checkpoint_last-rank-0.pt'), NEW)} cannot be renamed" in str(e.value)
    assert "Read-only file system" in str(e.value)


def test_a_file_of_a_set_moved_aside_that_arrives_later_is_never_replaced(tmp_path, caplog):
    """checkpoint_last's rank-1 file is missing because a copy is still running: the resume moves the set aside
    (commit.set_aside), then the copy lands the file under its old name; this run's next save of checkpoint_last
    moves it to the set's new name instead of renaming over it, and both sets are whole."""
    folder = str(tmp_path)
    write_set(folder, "checkpoint_last", OURS)
    late = (tmp_path / "checkpoint_last-rank-1.pt").read_bytes()
    os.remove(tmp_path / "checkpoint_last-rank-1.pt")
    aside = commit.set_aside(str(tmp_path / "checkpoint_last"))
    assert aside == str(tmp_path / f"checkpoint_last.damaged-{OURS[:8]}")
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint_last.damaged-{OURS[:8]}-{p}.pt" for p in ("rank-0", "shared")]
    (tmp_path / "checkpoint_last-rank-1.pt").write_bytes(late)  # the copy finishes
    write_set(folder, "checkpoint_last", NEW, staged=True)  # the next save, committed
    path, journal = commit.write_journal(folder, NEW, "", W, ["checkpoint_last"], [])
    caplog.set_level(logging.WARNING)
    commit.switch(folder, journal, path)
    assert (tmp_path / f"checkpoint_last.damaged-{OURS[:8]}-rank-1.pt").read_bytes() == late
    shards.check_set(aside)
    shards.check_set(str(tmp_path / "checkpoint_last"))
    assert shards.saved_by(str(tmp_path / "checkpoint_last-rank-1.pt")) == NEW
    assert "checkpoint_last-rank-1.pt belongs to the set moved aside" in caplog.text


def test_a_move_aside_stopped_half_way_goes_on_under_the_same_name(tmp_path):
    """Killed during set_aside: the shared file renamed, the rank-0 file linked to its new name but not yet
    unlinked. The next move finishes under the same name (the set's save id), losing nothing."""
    folder = str(tmp_path)
    write_set(folder, "checkpoint_last", OURS)
    aside = str(tmp_path / f"checkpoint_last.damaged-{OURS[:8]}")
    os.rename(tmp_path / "checkpoint_last-shared.pt", aside + "-shared.pt")
    os.link(tmp_path / "checkpoint_last-rank-0.pt", aside + "-rank-0.pt")
    assert commit.set_aside(str(tmp_path / "checkpoint_last")) == aside
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint_last.damaged-{OURS[:8]}-{p}.pt"
                                            for p in ("rank-0", "rank-1", "shared")]
    shards.check_set(aside)


@pytest.mark.parametrize("copy", ["another file", "the same bytes"])
def test_a_late_file_whose_new_name_is_taken_is_kept_beside_it(tmp_path, copy):
    """The set was moved aside whole (a truncated rank file), then a copy lands every file under the old names
    again: a save moves each file that differs from the one kept aside to NAME.damaged-ID.late-1 (before its
    commit), and leaves one of the same bytes to be replaced; the save is made, nothing of either is lost."""
    folder = str(tmp_path)
    write_set(folder, "checkpoint_last", OURS)
    whole = {p: (tmp_path / f"checkpoint_last-{p}.pt").read_bytes() for p in ("shared", "rank-0", "rank-1")}
    (tmp_path / "checkpoint_last-rank-1.pt").write_bytes(whole["rank-1"][:len(whole["rank-1"]) // 2])
    aside = commit.set_aside(str(tmp_path / "checkpoint_last"))
    if copy == "the same bytes":  # (the aside rank-1 file is the whole one)
        (tmp_path / f"checkpoint_last.damaged-{OURS[:8]}-rank-1.pt").write_bytes(whole["rank-1"])
    for part, data in whole.items():
        (tmp_path / f"checkpoint_last-{part}.pt").write_bytes(data)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if ".damaged-" in n}
    sets = commit.SetSave(folder, NEW, 0, 1, gather=lambda obj: [obj])
    write_set(folder, "checkpoint_last", NEW, staged=True, world_size=1)
    sets.staged = [str(tmp_path / "checkpoint_last-shared.pt"), str(tmp_path / "checkpoint_last-rank-0.pt")]
    sets.finish()
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    late = sorted(n for n in os.listdir(tmp_path) if ".late-" in n)
    if copy == "another file":
        assert late == [f"checkpoint_last.damaged-{OURS[:8]}.late-1-rank-1.pt"], late
        assert (tmp_path / late[0]).read_bytes() == whole["rank-1"]
    else:
        assert late == []
    shards.check_set(aside) if copy == "the same bytes" else None
    shards.check_set(str(tmp_path / "checkpoint_last"))
    assert shards.saved_by(str(tmp_path / "checkpoint_last-shared.pt")) == NEW


def test_a_reader_finishing_a_switch_keeps_a_late_file_too(tmp_path):
    """A save killed after its commit, a late file of the moved-aside set under its old name: fairseq-generate (a
    reader) finishing the renames moves the late file to the set's name first."""
    folder = str(tmp_path)
    write_set(folder, "checkpoint_last", OURS)
    late = (tmp_path / "checkpoint_last-rank-1.pt").read_bytes()
    os.remove(tmp_path / "checkpoint_last-rank-1.pt")
    aside = commit.set_aside(str(tmp_path / "checkpoint_last"))
    (tmp_path / "checkpoint_last-rank-1.pt").write_bytes(late)
    write_set(folder, "checkpoint_last", NEW, staged=True)
    commit.write_journal(folder, NEW, "", W, ["checkpoint_last"], [])
    assert shards.resolve(str(tmp_path / "checkpoint_last.pt"))[:2] == ("set", str(tmp_path / "checkpoint_last"))
    shards.check_set(aside)
    assert shards.saved_by(str(tmp_path / "checkpoint_last-rank-1.pt")) == NEW
