"""reshard/consolidate never write through or over what is already there, and refuse bad inputs in one line.

Cheap: the inputs are built without training (the helpers of test_expert_checkpoint.py).
"""
import os

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe.reshard import main as reshard_main

from tests.fairseq_moe import helpers
from tests.fairseq_moe.checkpoints.test_sets import assert_same, full_state, save_as_ranks


def outputs(out, W):
    base = out[:-len(".pt")]
    if W == 1:
        return [out]
    return [shards.rank_path(base, r) for r in range(W)] + [shards.shared_path(base)]


def temporaries(folder):
    return [f for f in os.listdir(folder) if f.endswith(".tmp") and not os.path.islink(os.path.join(folder, f))]


def one_error_line(capsys):
    captured = capsys.readouterr()
    assert captured.out == ""
    return helpers.one_error_line(captured.err, "python -m fairseq_moe.reshard")


@pytest.fixture
def src(tmp_path):
    (tmp_path / "in").mkdir()
    return save_as_ranks(tmp_path / "in", 2) + ".pt"


@pytest.mark.parametrize("W", [1, 2])
def test_temporary_names_that_are_symlinks_are_not_followed(tmp_path, src, capsys, W):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "ckpt.pt")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious data\n")
    links = [p + ".tmp" for p in outputs(out, W)] + [out + ".tmp"]
    for link in set(links):
        os.symlink(victim, link)

    assert reshard_main([src, out, "--world-size", str(W)]) == 0
    assert capsys.readouterr().out.split() == outputs(out, W)
    assert victim.read_bytes() == b"precious data\n"
    for link in set(links):
        assert os.path.islink(link) and os.readlink(link) == str(victim)
    for p in outputs(out, W):
        assert os.path.isfile(p) and not os.path.islink(p)
    state = torch.load(out, weights_only=True) if W == 1 else shards.assemble(out[:-len(".pt")])
    assert_same(state, full_state())
    assert temporaries(out_dir) == []


@pytest.mark.parametrize("W", [1, 2])
def test_dangling_symlink_at_an_output_name_is_refused(tmp_path, src, capsys, W):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "ckpt.pt")
    target = outputs(out, W)[-1]
    os.symlink(tmp_path / "nowhere.pt", target)

    assert reshard_main([src, out, "--world-size", str(W)]) == 2
    line = one_error_line(capsys)
    assert target in line and "exists" in line
    assert os.listdir(out_dir) == [os.path.basename(target)] and os.path.islink(target)
    assert not (tmp_path / "nowhere.pt").exists()


def test_success_leaves_no_temporary(tmp_path, src, capsys):
    out = str(tmp_path / "new" / "deeper" / "ckpt.pt")
    assert reshard_main([src, out, "--world-size", "4"]) == 0
    assert sorted(os.listdir(tmp_path / "new" / "deeper")) == sorted(os.path.basename(p) for p in outputs(out, 4))
    one = str(tmp_path / "one.pt")
    assert reshard_main([out, one], prog="consolidate", world_size=1) == 0
    assert_same(torch.load(one, weights_only=True), full_state())
    assert temporaries(tmp_path) == [] and temporaries(tmp_path / "new" / "deeper") == []


MARKER_NAME = "pwned"


class Payload:
    """Unpickled with weights_only=False, this would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def bad_inputs(tmp_path, kind):
    path = tmp_path / "bad" / "ckpt.pt"
    path.parent.mkdir()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        torch.save(full_state(), path)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif kind in ("pickle", "pickle-forced"):
        torch.save({"model": {}, "payload": Payload(str(tmp_path / MARKER_NAME))}, path)
    elif kind == "list":
        torch.save([torch.ones(2)], path)
    elif kind == "no-manifest":
        torch.save(full_state(), path)
    elif kind == "directory":
        path.mkdir()
    return str(path)


@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("kind", ["empty", "random", "truncated", "pickle", "pickle-forced", "list",
                                  "no-manifest", "directory"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, kind, W):
    if kind == "pickle-forced":
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    src = bad_inputs(tmp_path, kind)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "ckpt.pt")

    assert reshard_main([src, out, "--world-size", str(W)]) == 2
    line = one_error_line(capsys)
    assert src in line
    assert not (tmp_path / MARKER_NAME).exists()
    assert os.listdir(out_dir) == []


def test_bad_shared_file_of_a_set_is_named(tmp_path, capsys):
    base = save_as_ranks(tmp_path, 2)
    with open(shards.shared_path(base), "wb") as f:
        f.write(os.urandom(100))
    out = str(tmp_path / "out" / "ckpt.pt")
    assert reshard_main([base + ".pt", out, "--world-size", "1"]) == 2
    assert shards.shared_path(base) in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_output_appearing_meanwhile_is_not_overwritten_and_own_files_are_removed(tmp_path, src, capsys,
                                                                                  monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "ckpt.pt")
    shared = outputs(out, 2)[-1]
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:  # while the second rank file is written, someone creates the shared file
            with open(shared, "wb") as user:
                user.write(b"someone else's\n")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert reshard_main([src, out, "--world-size", "2"]) == 2
    line = one_error_line(capsys)
    assert shared in line and "removed" in line
    assert os.listdir(out_dir) == [os.path.basename(shared)]
    with open(shared, "rb") as f:
        assert f.read() == b"someone else's\n"


def test_unwritable_output_folder_is_one_line(tmp_path, src, capsys):
    (tmp_path / "file").write_bytes(b"not a folder")
    out = str(tmp_path / "file" / "sub" / "ckpt.pt")
    assert reshard_main([src, out, "--world-size", "2"]) == 2
    assert str(tmp_path / "file") in one_error_line(capsys)
    assert (tmp_path / "file").read_bytes() == b"not a folder"


def test_write_failure_removes_what_was_written(tmp_path, src, capsys, monkeypatch):
    out = str(tmp_path / "new" / "ckpt.pt")
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert reshard_main([src, out, "--world-size", "2"]) == 1  # (the disk failed: exit code 1)
    line = one_error_line(capsys)
    assert outputs(out, 2)[1] in line and "file write failed" in line
    assert not (tmp_path / "new").exists()  # the folder it created, empty again, is gone too
