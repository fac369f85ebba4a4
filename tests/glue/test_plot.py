"""python -m fairseq_moe.plot on a tiny run: every picture written, non-empty, its axes labelled; the log
reader takes both of fairseq's log formats; bad input is one line."""
import logging

import pytest

from fairseq_moe import plot

from .helpers import run_train, train_argv

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
    drawn = plot.plot_run(run_dir / "load.jsonl", run_dir / "train.log", out)
    assert sorted(drawn) == ["balance_loss.png", "dropped.png", "expert_load.png", "loss.png"]
    for name, panels in drawn.items():
        assert (out / name).stat().st_size > 5000, name  # a picture, not an empty canvas
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
