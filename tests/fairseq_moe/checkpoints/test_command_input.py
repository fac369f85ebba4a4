"""Red-team trials of the commands (python -m fairseq_moe.NAME): every command's bad input is one line
`python -m fairseq_moe.NAME: error: MESSAGE` on stderr naming the flag or the file, exit code 2, no traceback, and
nothing written; a write the disk fails is one line with exit code 1 (issue 30, items 7 and 8).

Each row of TRIALS: the command, a builder of its argv (and of the fragment the line must hold) from the trial's
context, and the exit code. The models are trained once per module, each only when a row asks for it.
"""
import errno
import importlib
import json
import os
import shutil

import pytest
import torch

import fairseq_moe

fairseq_moe.load_plugin()  # (what tests/fairseq_moe/conftest.py does: fairseq has loaded the plugin)

from tests.fairseq_moe.helpers import ML_ARGS, one_error_line, run_train, train_argv  # noqa: E402

# Every command, found by its file: a module at the top of fairseq_moe/ with a main (the door's files have none).
# launch, which runs other programs and is loaded from its file alone, has its own test at the end.
PACKAGE = os.path.dirname(fairseq_moe.__file__)


def has_main(f):
    with open(os.path.join(PACKAGE, f), encoding="utf-8") as source:
        return "\ndef main(" in source.read()


COMMANDS = {f[:-3]: importlib.import_module(f"fairseq_moe.{f[:-3]}") for f in sorted(os.listdir(PACKAGE))
            if f.endswith(".py") and f != "launch.py" and has_main(f)}
# NllbMoe's architecture (what export_hf takes): pre-norm, one shared embedding, every layer MoE
NLLB_LIKE = ("--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
             "--moe-capacity-rounding", "per_choice", "--moe-token-priority", "sentence",
             "--moe-eval-capacity-token-fraction", "0.25", "--moe-freq", "1")


def call(name, argv):
    """The command's exit code: what its main returns, or its SystemExit's (argparse's usage errors)."""
    try:
        return COMMANDS[name].main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def assert_one_line(name, code, capsys, want_code, fragment):
    captured = capsys.readouterr()
    assert code == want_code, captured.err
    line = one_error_line(captured.err, f"python -m fairseq_moe.{name}")  # (one line: no traceback)
    assert fragment in line, line
    return line


@pytest.fixture(scope="module")
def nllb_like(data_bin, tmp_path_factory):
    """A moe_transformer that export_hf takes (2 updates): checkpoint_last.pt."""
    save = tmp_path_factory.mktemp("nllb_like")
    run_train(train_argv(data_bin, save, "--max-update", "2", "--moe-expert-count", "4", *NLLB_LIKE))
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def multilingual(ml_data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("ml")
    run_train(train_argv(ml_data_bin, save, *ML_ARGS, "--share-all-embeddings", "--max-update", "2",
                         "--moe-expert-count", "4"))
    return save / "checkpoint_last.pt"


class Trial:
    """What a row's builder gets: a fresh folder, monkeypatch, and the fixtures it asks for by name."""

    def __init__(self, request, tmp_path, monkeypatch):
        self.request, self.tmp, self.monkeypatch = request, tmp_path, monkeypatch

    def __getattr__(self, fixture):
        return self.request.getfixturevalue(fixture)

    def file(self, name, content):
        path = self.tmp / name
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return path

    def changed(self, ckpt, **task):
        """A copy of a checkpoint with these task settings saved."""
        state = torch.load(ckpt, weights_only=False)
        cfg_task = state["cfg"]["task"]
        for key, value in task.items():
            if isinstance(cfg_task, dict):
                cfg_task[key] = value
            else:
                setattr(cfg_task, key, value)
        torch.save(state, self.tmp / "changed.pt")
        return self.tmp / "changed.pt"

    def data_like(self, data, keep):
        """A copy of the data-bin with only the files keep(name) says."""
        folder = self.tmp / "data"
        folder.mkdir()
        for f in os.listdir(data):
            if keep(f):
                shutil.copy(os.path.join(data, f), folder)
        return folder


def deep_json(depth=100000):
    """A JSON object nested past Python's recursion limit (json.loads raises RecursionError)."""
    return '{"a": ' * depth + "1" + "}" * depth


def disk_full(t):
    """torch.save fails as a full disk does, inside the writer."""
    def save(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    t.monkeypatch.setattr(torch, "save", save)


def reshard_onto_a_full_disk(t):
    src = t.tmp / "one.pt"
    shutil.copy(t.nllb_like, src)
    disk_full(t)
    return [src, t.tmp / "out" / "set.pt", "--world-size", "2"], "cannot write it"


def lm_data(t):
    """The data-bin of a language model (dict.txt) beside the translation one's training files."""
    folder = t.data_like(t.data_bin, lambda f: f.startswith("train."))
    shutil.copy(os.path.join(t.data_bin, "dict.src.txt"), folder / "dict.txt")
    return folder


def bad_dictionaries(t):
    """The translation data-bin with dictionaries of words without counts."""
    folder = t.data_like(t.data_bin, lambda f: f.startswith("train."))
    for side in ("src", "tgt"):
        (folder / f"dict.{side}.txt").write_text("a\nb\n")
    return folder


def plot_run(folder, stats=None, log=None):
    run = folder / "run"
    run.mkdir()
    if stats is not None:
        (run / "stats.jsonl").write_text(stats)
    if log is not None:
        (run / "train.log").write_text(log)
    return run


# (id, command, build(trial) -> (argv, fragment of the one line), exit code)
TRIALS = [
    # item 7: what was a traceback
    ("export_hf --data of a language model", "export_hf", lambda t: (
        [t.nllb_like, t.tmp / "hf", "--data", lm_data(t)],
        "has no dict.SRC.txt and dict.TGT.txt: the checkpoint is of a translation task"), 2),
    ("export_hf --data a raw text folder", "export_hf", lambda t: (
        [t.nllb_like, t.tmp / "hf", "--data", t.file("train.src", "a b c\n").parent],
        "has no dict.SRC.txt and dict.TGT.txt: the checkpoint is of a translation task"), 2),
    ("export_hf --data with dictionaries that are not", "export_hf", lambda t: (
        [t.nllb_like, t.tmp / "hf", "--data", bad_dictionaries(t)],
        "the checkpoint's task cannot read its dictionaries"), 2),
    ("prune --subset nosuch, multilingual", "prune", lambda t: (
        [t.multilingual, t.tmp / "out.pt", "--data", t.ml_data_bin, "--subset", "nosuch", "--keep", "0.5"],
        "--subset nosuch: "), 2),
    ("inspect --by-lang-pair --subset nosuch", "inspect", lambda t: (
        [t.multilingual, "--data", t.ml_data_bin, "--by-lang-pair", "--subset", "nosuch", "--out", t.tmp / "o"],
        "has no nosuch split of en-xx (its splits: test, train, valid)"), 2),
    ("inspect --input Latin-1", "inspect", lambda t: (
        [t.nllb_like, "--data", t.data_bin, "--input", t.file("latin1.txt", "caf\xe9 a b\n".encode("latin-1")),
         "--out", t.tmp / "o"], "latin1.txt is not UTF-8 text (byte 3: b'\\xe9'"), 2),
    ("plot: a deeply nested statistics line", "plot", lambda t: (
        [plot_run(t.tmp, stats=deep_json() + "\n"), t.tmp / "o"], "stats.jsonl:1: not a statistics line"), 2),
    ("inspect: saved eval_bleu_args not JSON", "inspect", lambda t: (
        [t.changed(t.nllb_like, eval_bleu=True, eval_bleu_args="{beam: 4"), "--data", t.data_bin, "--input",
         t.file("in.txt", "a b\n"), "--out", t.tmp / "o"], "changed.pt: cfg.task.eval_bleu_args = '{beam: 4'"), 2),
    ("prune: saved eval_bleu_args not JSON", "prune", lambda t: (
        [t.changed(t.nllb_like, eval_bleu=True, eval_bleu_args="[1]"), t.tmp / "out.pt", "--data", t.data_bin,
         "--keep", "0.5"], "changed.pt: cfg.task.eval_bleu_args = '[1]' is not a JSON object"), 2),
    # item 8: what the messages say
    ("inspect --input a folder", "inspect", lambda t: (
        [t.nllb_like, "--data", t.data_bin, "--input", t.tmp, "--out", t.tmp / "o"],
        "is a folder, not a text file"), 2),
    ("prune --lang-pairs, a model without languages", "prune", lambda t: (
        [t.changed(t.nllb_like, source_lang=None, target_lang=None), t.tmp / "out.pt", "--data", t.data_bin,
         "--lang-pairs", "en-fr", "--keep", "0.5"], "the model's task translates src-tgt only"), 2),
    ("inspect --data a file", "inspect", lambda t: (
        [t.nllb_like, "--data", t.file("in.txt", "a b\n"), "--input", t.tmp / "in.txt", "--out", t.tmp / "o"],
        "in.txt: a file, not a folder"), 2),
    ("reshard --world-size that does not fit", "reshard", lambda t: (
        [t.nllb_like, t.tmp / "out.pt", "--world-size", "3"], "--world-size 3: "), 2),
    ("plot --stats a folder", "plot", lambda t: (
        [plot_run(t.tmp, log=""), t.tmp / "o", "--stats", t.tmp], "a folder, not a file"), 2),
    ("reshard onto a full disk", "reshard", reshard_onto_a_full_disk, 1),
    ("inspect --spm with --by-lang-pair", "inspect", lambda t: (
        [t.tmp / "none.pt", "--data", t.tmp, "--by-lang-pair", "--spm", t.tmp / "m.model"],
        "--spm goes with --input, not with --by-lang-pair"), 2),
    ("average: two models", "average", lambda t: (
        ["--inputs", t.nllb_like, t.multilingual, "--output", t.tmp / "avg.pt"], "not the same model"), 2),
    ("average --num-update-checkpoints more than there are", "average", lambda t: (
        ["--inputs", t.file("checkpoint_1_2.pt", t.nllb_like.read_bytes()).parent, "--num-update-checkpoints", "2",
         "--output", t.tmp / "avg.pt"], "--num-update-checkpoints 2: "), 2),
]


@pytest.mark.parametrize("name,build,code", [row[1:] for row in TRIALS], ids=[row[0] for row in TRIALS])
def test_odd_input_is_one_line(request, tmp_path, monkeypatch, capsys, name, build, code):
    t = Trial(request, tmp_path, monkeypatch)
    argv, fragment = build(t)
    before = sorted(os.listdir(tmp_path))
    line = assert_one_line(name, call(name, argv), capsys, code, fragment)
    assert "None-None" not in line
    assert sorted(os.listdir(tmp_path)) == before  # nothing written (nor a folder for it)


# Every command, its input missing: (command, argv from the folder, the file the line names)
MISSING = [
    ("reshard", lambda d: [d / "none.pt", d / "out.pt", "--world-size", "2"], "none.pt: no such checkpoint"),
    ("consolidate", lambda d: [d / "none.pt", d / "out.pt"], "none.pt: no such checkpoint"),
    ("upcycle", lambda d: [d / "none.pt", d / "out.pt", "--experts", "2"], "none.pt is missing"),
    ("convert_moe_branch", lambda d: [d / "none", d / "out.pt"], "none-shared.pt is missing"),
    ("export_hf", lambda d: [d / "none.pt", d / "hf"], "none.pt: no such checkpoint"),
    ("import_hf", lambda d: [d / "none", d / "out.pt"], "HF_DIR " + "{d}/none: no such folder"),
    ("prune", lambda d: [d / "none.pt", d / "out.pt", "--data", d, "--keep", "0.5"], "none.pt: no such checkpoint"),
    ("grow", lambda d: [d / "none.pt", d / "out.pt", "--add", "2"], "none.pt: no such checkpoint"),
    ("inspect", lambda d: [d / "none.pt", "--data", d, "--input", d / "in.txt", "--out", d / "o"],
     "none.pt: no such checkpoint"),
    ("plot", lambda d: [d / "none", d / "o"], "RUN_DIR " + "{d}/none: no such folder"),
    ("average", lambda d: ["--inputs", d / "none.pt", "--output", d / "out.pt"], "none.pt: no such checkpoint"),
    ("selftest", lambda d: ["--device", "cpu", "--work", d / "in.txt"], "in.txt: not a folder"),
]


def test_every_command_has_its_rows():
    """A new command (fairseq_moe/NAME.py with a main) is in COMMANDS by its file; its row of MISSING is the one
    line here that names it (docs/architecture.md, "A command")."""
    assert "reshard" in COMMANDS and "average" in COMMANDS
    assert sorted(name for name, _, _ in MISSING) == sorted(COMMANDS)


@pytest.mark.parametrize("name,argv,fragment", MISSING, ids=[row[0] for row in MISSING])
def test_every_command_names_a_missing_input_in_one_line(tmp_path, capsys, name, argv, fragment):
    (tmp_path / "in.txt").write_text("a b\n")
    line = assert_one_line(name, call(name, argv(tmp_path)), capsys, 2, fragment.format(d=tmp_path))
    assert str(tmp_path) in line
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_a_deeply_nested_log_line_is_not_a_log_line(tmp_path, capsys):
    """plot reads a training log's JSON lines; one nested past Python's limit is no line fairseq logged: skipped
    like any other, the pictures of the rest drawn."""
    stats = {"update": 1, "layers": {"encoder.layers.1.fc1": [0.5, 0.5]}, "dropped": {"encoder.layers.1.fc1": 0}}
    run = plot_run(tmp_path, stats=json.dumps(stats) + "\n", log=deep_json() + "\n" + json.dumps({"loss": 2.0, "num_updates": 1}) + "\n")
    assert call("plot", [run, tmp_path / "o"]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == ["dropped.png", "expert_load.png", "loss.png"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, fragment", [(["--nproc", "0", "--", "true"], "--nproc must be >= 1, got 0"),
                                            (["--nproc", "2"], "no command given after --")])
def test_the_launcher_keeps_the_commands_convention(capsys, argv, fragment):
    """python -m fairseq_moe.launch's usage errors: argparse's usage, then the same PROG: error: line, exit 2."""
    from fairseq_moe import launch

    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if "error" in line] == [f"python -m fairseq_moe.launch: error: {fragment}"]
