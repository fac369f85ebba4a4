"""python -m fairseq_moe.plot on a tiny run: every picture written, non-empty, its axes labelled; the log
reader takes both of fairseq's log formats, tee'd or as --log-file writes them; bad input is one line, and
nothing is written over a file or through a link."""
import logging
import os

import pytest

from fairseq_moe import plot

from tests.fairseq_moe.helpers import run_train, train_argv

FAIRSEQ_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"  # (fairseq_cli/train.py's)


@pytest.fixture(scope="module")
def run_dir(data_bin, tmp_path_factory):
    """4 updates with the statistics file and per-layer metrics, the log teed to RUN_DIR/train.log."""
    folder = tmp_path_factory.mktemp("run")
    handler = logging.FileHandler(folder / "train.log")
    handler.setFormatter(logging.Formatter(FAIRSEQ_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        run_train(train_argv(data_bin, folder / "ckpt", "--max-update", "4", "--moe-stats-file",
                             str(folder / "load.jsonl"), "--moe-stats-interval", "1", "--moe-log-per-layer"))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()
    return folder


def test_every_picture_of_a_run(run_dir, tmp_path, capsys):
    out = tmp_path / "png"
    assert plot.main([str(run_dir), str(out)]) == 0
    drawn = plot.plot_run(run_dir / "load.jsonl", run_dir / "train.log", tmp_path / "again")
    assert sorted(drawn) == ["balance_loss.png", "dropped.png", "expert_load.png", "loss.png"]
    for name, panels in drawn.items():
        assert (out / name).stat().st_size > 5000, name  # a picture, not an empty canvas
        assert (tmp_path / "again" / name).stat().st_size > 5000, name
        assert panels and all(x == "update" and y for _, x, y in panels), (name, panels)
    load_panels = [title for title, _, _ in drawn["expert_load.png"]]
    assert load_panels == ["encoder.layers.1.fc1", "decoder.layers.1.fc1"]
    assert sorted(str(out / n) for n in drawn) == sorted(capsys.readouterr().out.split())


def test_log_reader_takes_simple_and_json_formats(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "2026-11-30 14:54:26 | INFO | train_inner | epoch 001:     50 / 603 loss=12.746, nll_loss=12.648, "
        "moe_balance_loss=1.3508, moe_encoder1_balance=1.2, ppl=6416.4, num_updates=50, lr=0.000125087\n"
        "2026-11-30 14:55:26 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.1 | nll_loss 8.7 | "
        "ppl 412.5 | num_updates 603\n"
        '2026-11-30 14:56:26 | INFO | train_inner | {"epoch": 2, "update": 1.5, "loss": "7.5", '
        '"moe_balance_loss": "1.01", "num_updates": "700"}\n'
        '2026-11-30 14:56:30 | INFO | valid | {"epoch": 2, "valid_loss": "7.2", "valid_ppl": "147", '
        '"valid_num_updates": "1206"}\n'
        "2026-11-30 14:56:27 | INFO | fairseq_cli.train | end of epoch 2\n")
    train, valid = plot.read_log(log)
    assert [(r["num_updates"], r["loss"], r["moe_balance_loss"]) for r in train] == [(50, 12.746, 1.3508),
                                                                                  (700, 7.5, 1.01)]
    assert train[0]["moe_encoder1_balance"] == 1.2
    assert [(r["num_updates"], r["loss"], r["ppl"]) for r in valid] == [(603, 9.1, 412.5), (1206, 7.2, 147)]


def test_bad_input_is_one_line(run_dir, tmp_path, capsys):
    def fails(*argv, match):
        assert plot.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.plot: error:") and match in err, err

    fails(tmp_path / "nothing", tmp_path / "out", match="no such folder")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", tmp_path / "out", match="no statistics file")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (two / name).write_text((run_dir / "load.jsonl").read_text())
    fails(two, tmp_path / "out", match="--stats")
    (two / "b.jsonl").write_text('{"not": "stats"}\n')
    fails(two, tmp_path / "out", "--stats", two / "b.jsonl", match="not a --moe-stats-file")


def test_log_file_lines_in_both_formats(tmp_path):
    """--log-file writes the bare messages (no `| train_inner |` tag): simple and json."""
    simple, js = tmp_path / "simple.log", tmp_path / "json.log"
    simple.write_text(
        "Start iterating over samples\n"
        "epoch 001:      1 / 7 loss=5.976, nll_loss=5.95, moe_balance_loss=1.0995, num_updates=1, lr=0.003\n"
        "epoch 001:      2 / 7 loss=5.542, nll_loss=5.457, moe_balance_loss=1.1391, num_updates=2, lr=0.003\n"
        "epoch 001 | valid on 'valid' subset | loss 5.146 | nll_loss 5.021 | ppl 32.47 | num_updates 2\n"
        "epoch 001 | loss 5.657 | nll_loss 5.589 | ppl 48.12 | num_updates 2 | lr 0.003\n")  # epoch summary
    js.write_text(
        '{"epoch": 1, "update": 0.143, "loss": "5.976", "moe_balance_loss": "1.0995", "num_updates": "1"}\n'
        '{"epoch": 1, "valid_loss": "5.146", "valid_ppl": "32.47", "valid_num_updates": "2"}\n'
        '{"epoch": 1, "train_loss": "5.657", "train_num_updates": "2"}\n')
    train, valid = plot.read_log(simple)
    assert [(r["num_updates"], r["loss"]) for r in train] == [(1, 5.976), (2, 5.542)]
    assert [(r["num_updates"], r["loss"]) for r in valid] == [(2, 5.146)]
    train, valid = plot.read_log(js)
    assert [(r["num_updates"], r["loss"], r["moe_balance_loss"]) for r in train] == [(1, 5.976, 1.0995)]
    assert [(r["num_updates"], r["loss"]) for r in valid] == [(2, 5.146)]


def test_a_run_logged_with_log_file_gets_its_loss_pictures(data_bin, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # (as fairseq-train's own process has it; other tests may have raised it)
    try:
        run_train(train_argv(data_bin, run / "ckpt", "--max-update", "2", "--log-file", str(run / "train.log")))
    finally:  # fairseq-train adds a handler for --log-file and never takes it off (a process ends first)
        root.setLevel(level)
        for log in map(logging.getLogger, ("fairseq_cli.train", "fairseq.logging.progress_bar")):
            for handler in [h for h in log.handlers if getattr(h, "baseFilename", "") == str(run / "train.log")]:
                log.removeHandler(handler)
                handler.close()
    drawn = plot.plot_run(None, run / "train.log", tmp_path / "png")
    assert sorted(drawn) == ["balance_loss.png", "loss.png"]


@pytest.mark.parametrize("what", ["a file", "a link", "a dangling link"])
def test_an_existing_picture_or_link_is_refused(run_dir, tmp_path, capsys, what):
    out = tmp_path / "png"
    out.mkdir()
    target = tmp_path / "precious.png"
    target.write_bytes(b"mine")
    if what == "a file":
        (out / "loss.png").write_bytes(b"mine")
    else:
        (out / "loss.png").symlink_to(target if what == "a link" else tmp_path / "gone.png")
    assert plot.main([str(run_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'loss.png'} exists" in err and "OUT_DIR" in err, err
    assert os.listdir(out) == ["loss.png"] and target.read_bytes() == b"mine"
    assert what == "a file" or os.path.islink(out / "loss.png")


@pytest.mark.parametrize("lines, match", [
    (['{"update": 1, "layers": {"l": [0.5, 0.5, 0, 0]}}', '{"update": 2, "layers": {"l": [0.5, 0.5]}}'],
     ":2: layer l has 2 experts here, 4 on earlier lines"),
    (['{"update": 1, "layers": {"l": "x"}}'], ":1: layer l: the shares are not a list of numbers"),
    (['{"update": "soon", "layers": {}}'], ":1: 'update' is no number"),
    (['{"update": 1, "layers": {"l": [1]}, "dropped": {"l": "x"}}'], ":1: a 'dropped' value is no number"),
    (['[1, 2]'], ":1: not a --moe-stats-file line"),
])
def test_malformed_statistics_are_one_line(tmp_path, capsys, lines, match):
    run = tmp_path / "run"
    run.mkdir()
    (run / "load.jsonl").write_text("\n".join(lines) + "\n")
    assert plot.main([str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "out").exists()
