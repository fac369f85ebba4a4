"""python -m fairseq_moe.average: the last N checkpoints of a run, files or expert-parallel sets, averaged into one
file, checked against the same average computed by hand from the consolidated files; what fairseq-generate and
reshard make of it; and bad input as one line, nothing written.

One tiny run (one process, a checkpoint every update) gives the checkpoints; the sets are made from them with
python -m fairseq_moe.reshard, and consolidated back to single files for the average by hand.
"""
import os
import re
import shutil

import pytest
import torch

from fairseq_moe import average, consolidate, reshard
from fairseq_moe.checkpoints import sets as shards

from tests.fairseq_moe.helpers import USER_DIR, one_error_line, run_generate, run_train, train_argv


@pytest.fixture(scope="module")
def run(data_bin, tmp_path_factory):
    """The folder of a 4-update run saved at every update, and its update checkpoints, oldest first."""
    save = tmp_path_factory.mktemp("run")
    run_train(train_argv(data_bin, save, "--max-update", "4", "--save-interval-updates", "1",
                         "--moe-expert-count", "4", "--required-batch-size-multiple", "1"))
    numbered = sorted((int(m.group(1)), f) for f in os.listdir(save) if (m := re.fullmatch(r"checkpoint_\d+_(\d+)\.pt", f)))
    assert len(numbered) >= 3, os.listdir(save)
    return save, [str(save / f) for _, f in numbered]


def as_sets(paths, folder, W=2):
    """Each checkpoint file rewritten as a set of W ranks, under the same name in folder."""
    folder.mkdir(exist_ok=True)
    out = []
    for path in paths:
        out.append(str(folder / os.path.basename(path)))
        assert reshard.main([path, out[-1], "--world-size", str(W)]) == 0
    return out


def by_hand(paths):
    """The average of the checkpoints at paths (single files, read with torch.load), in a plain loop: each floating
    tensor summed in fp32 in this order, divided by their number, cast back; the rest the first's."""
    states = [torch.load(p, weights_only=False) for p in paths]
    out = {}
    for key, t in states[0]["model"].items():
        if not t.is_floating_point():
            out[key] = t
            continue
        total = torch.zeros(t.shape, dtype=torch.float32)
        for s in states:
            total = total + s["model"][key].float()
        out[key] = (total / len(states)).to(t.dtype)
    return out, states[0]


def assert_average_of(out, paths):
    want, first = by_hand(paths)
    got = torch.load(out, weights_only=True)
    assert got["model"].keys() == want.keys()
    for key, t in want.items():
        assert got["model"][key].dtype == t.dtype and torch.equal(got["model"][key], t), key
    assert got["optimizer_history"] == first["optimizer_history"]
    assert got["extra_state"]["train_iterator"] == first["extra_state"]["train_iterator"]
    assert got["cfg"]["model"] == first["cfg"]["model"]
    info = shards.manifest_of(got)
    assert info["world_size"] == 1 and info["experts"] == shards.manifest_of(first)["experts"]
    return got


def test_the_newest_sets_averaged_equal_the_average_by_hand(run, tmp_path, capsys, data_bin):
    save, files = run
    sets = as_sets(files, tmp_path / "sets")
    capsys.readouterr()
    out = str(tmp_path / "out" / "average.pt")
    assert average.main(["--inputs", str(tmp_path / "sets"), "--num-update-checkpoints", "3", "--output", out]) == 0
    newest = sets[::-1][:3]  # newest first, as fairseq's script orders them
    assert capsys.readouterr().out.strip() == f"{out}: the average of 3 checkpoints ({', '.join(newest)})"
    singles = []
    for path in newest:  # the sets consolidated, for the average by hand
        singles.append(str(tmp_path / f"one-{os.path.basename(path)}"))
        assert consolidate.main([path, singles[-1]]) == 0
    got = assert_average_of(out, singles)
    assert not torch.equal(got["model"]["encoder.layers.1.fc1.moe.experts.w1"],
                           torch.load(singles[0], weights_only=True)["model"]["encoder.layers.1.fc1.moe.experts.w1"])
    assert sorted(os.listdir(tmp_path / "out")) == ["average.pt"]
    # and against the files fairseq-train wrote, whose sets these are (no reshard, no consolidate on this side)
    want, _ = by_hand(files[::-1][:3])
    assert got["model"].keys() == want.keys() and all(torch.equal(got["model"][k], t) for k, t in want.items())

    # one file with every expert: fairseq-generate reads it; reshard spreads it over 2 ranks
    scorer = run_generate([data_bin, "--user-dir", USER_DIR, "--path", out, "--task", "moe_translation",
                           "--gen-subset", "test", "--beam", "2", "--cpu"])
    assert "BLEU" in scorer.result_string()
    assert reshard.main([out, str(tmp_path / "spread" / "average.pt"), "--world-size", "2"]) == 0
    back = shards.assemble(str(tmp_path / "spread" / "average"))
    for key, t in got["model"].items():
        assert torch.equal(back["model"][key], t), key


def test_named_inputs_files_and_sets_in_the_order_given(run, tmp_path, capsys):
    save, files = run
    (tmp_path / "sets").mkdir()
    a_set = as_sets(files[-1:], tmp_path / "sets")[0]
    inputs = [files[0], shards.shared_path(shards.set_base(a_set)), files[1]]  # a set by one of its files too
    out = str(tmp_path / "average.pt")
    assert average.main(["--inputs", *inputs, "--output", out]) == 0
    assert_average_of(out, [files[0], files[-1], files[1]])


def test_epoch_checkpoints_and_the_upper_bound(run, tmp_path, capsys):
    """checkpointEPOCH.pt files and sets by their epoch number; none past --checkpoint-upper-bound; the run's
    other names (checkpoint_last, update checkpoints) are not epoch checkpoints."""
    save, files = run
    folder = tmp_path / "epochs"
    folder.mkdir()
    for epoch, path in zip((1, 2, 10), files):
        shutil.copy(path, folder / f"checkpoint{epoch}.pt")
    as_sets([str(folder / "checkpoint2.pt")], tmp_path / "set2")
    os.remove(folder / "checkpoint2.pt")
    for f in os.listdir(tmp_path / "set2"):
        shutil.move(str(tmp_path / "set2" / f), folder / f)
    shutil.copy(files[-1], folder / "checkpoint_last.pt")
    shutil.copy(files[-1], folder / "checkpoint_9_99.pt")
    capsys.readouterr()
    out = str(tmp_path / "average.pt")
    assert average.main(["--inputs", str(folder), "--num-epoch-checkpoints", "2", "--checkpoint-upper-bound", "9",
                         "--output", out]) == 0
    assert capsys.readouterr().out.strip().endswith(f"({folder}/checkpoint2.pt, {folder}/checkpoint1.pt)")
    assert_average_of(out, [files[1], files[0]])


def other_model(src, path, change):
    state = torch.load(src, weights_only=False)
    change(state)
    torch.save(state, path)
    return path


def set_named(src, path):
    """path (NAME.pt), with the set NAME there (src as 2 ranks), not the file."""
    as_sets([src], path.parent / "x")
    for f in os.listdir(path.parent / "x"):
        os.rename(path.parent / "x" / f, path.parent / f.replace(os.path.basename(src)[:-3], path.name[:-3]))
    return path


def fewer_experts(state):
    for name in shards.manifest_of(state)["experts"]:
        state["model"][name] = state["model"][name][:2].clone()
        state["extra_state"]["moe_checkpoint"]["experts"][name] = 2


def other_width(state):
    state["model"]["encoder.layers.0.fc1.weight"] = torch.zeros(8, 32)


# (id, argv from (run's files, folder), fragment of the one line)
BAD = [
    ("fewer checkpoints than N", lambda f, d: ["--inputs", os.path.dirname(f[0]), "--num-update-checkpoints", "99",
                                              "--output", d / "a.pt"],
     "--num-update-checkpoints 99: {run} has {n} checkpoints named checkpoint_EPOCH_UPDATE.pt (files or sets), "
     "fewer than 99"),
    ("no epoch checkpoints", lambda f, d: ["--inputs", os.path.dirname(f[0]), "--num-epoch-checkpoints", "1",
                                          "--output", d / "a.pt"], "has 0 checkpoints named checkpointEPOCH.pt"),
    ("N below 1", lambda f, d: ["--inputs", os.path.dirname(f[0]), "--num-update-checkpoints", "0", "--output",
                                d / "a.pt"], "--num-update-checkpoints 0: must be >= 1"),
    ("two folders with N", lambda f, d: ["--inputs", d, d, "--num-update-checkpoints", "1", "--output", d / "a.pt"],
     "--num-update-checkpoints: give --inputs one folder (the run's --save-dir), not 2 paths"),
    ("a folder without N", lambda f, d: ["--inputs", d, "--output", d / "a.pt"],
     "--inputs {d} is a folder: give --num-epoch-checkpoints N or --num-update-checkpoints N"),
    ("the bound without N", lambda f, d: ["--inputs", f[0], "--checkpoint-upper-bound", "3", "--output", d / "a.pt"],
     "--checkpoint-upper-bound goes with --num-epoch-checkpoints or --num-update-checkpoints"),
    ("other expert counts", lambda f, d: ["--inputs", f[0], other_model(f[1], d / "e2.pt", fewer_experts),
                                          "--output", d / "a.pt"],
     "e2.pt: decoder.layers.1.fc1.moe.experts.b1 has 2 experts, in {f0} 4: not the same model"),
    ("another shape", lambda f, d: ["--inputs", f[0], other_model(f[1], d / "w.pt", other_width), "--output",
                                    d / "a.pt"], "w.pt: encoder.layers.0.fc1.weight is (8, 32) torch.float32, in "),
    ("a parameter missing", lambda f, d: ["--inputs", f[0], other_model(
        f[1], d / "k.pt", lambda s: s["model"].pop("decoder.layers.0.fc1.bias")), "--output", d / "a.pt"],
     "k.pt has no decoder.layers.0.fc1.bias: not the same model as {f0}"),
    ("a missing input", lambda f, d: ["--inputs", f[0], d / "none.pt", "--output", d / "a.pt"],
     "none.pt: no such checkpoint"),
    ("an output that exists", lambda f, d: ["--inputs", f[0], "--output", shutil.copy(f[1], d / "a.pt")],
     "a.pt exists; choose another --output (nothing is overwritten)"),
    ("the set of the output's name exists", lambda f, d: ["--inputs", f[0], "--output", set_named(f[0], d / "s.pt")],
     "s-shared.pt exists; choose another --output"),
    ("an output not NAME.pt", lambda f, d: ["--inputs", f[0], "--output", d / "average"],
     "--output {d}/average: name the checkpoint NAME.pt"),
]


@pytest.mark.parametrize("build,fragment", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_input_is_one_line_and_nothing_is_written(run, tmp_path, capsys, build, fragment):
    save, files = run
    argv = [str(a) for a in build(files, tmp_path)]
    before, run_before = sorted(os.listdir(tmp_path)), sorted(os.listdir(save))
    capsys.readouterr()
    assert average.main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "python -m fairseq_moe.average")
    assert fragment.format(d=tmp_path, run=save, n=len(files), f0=files[0]) in line, line
    assert sorted(os.listdir(tmp_path)) == before
    assert sorted(os.listdir(save)) == run_before


def test_bf16_weights_are_summed_in_fp32_and_stay_bf16(run, tmp_path):
    """A model saved in bf16: the average is summed in fp32 and cast back (fairseq's script would sum in bf16)."""
    save, files = run
    halves = []
    for path in files[-2:]:
        state = torch.load(path, weights_only=True)
        state["model"] = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in state["model"].items()}
        halves.append(str(tmp_path / f"bf16-{os.path.basename(path)}"))
        torch.save(state, halves[-1])
    out = str(tmp_path / "average.pt")
    assert average.main(["--inputs", *halves[::-1], "--output", out]) == 0
    got = torch.load(out, weights_only=True)["model"]
    want, _ = by_hand(halves[::-1])
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want.items())
    assert got["encoder.layers.1.fc1.moe.experts.w1"].dtype == torch.bfloat16
