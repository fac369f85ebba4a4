"""python -m fairseq_moe.inspect: every token's experts and weights per MoE layer (the weights the layer
used), a heat map per layer, the tokens each expert receives; the same from a single file and from the
expert-parallel set it is resharded into."""
import re

import pytest

from fairseq_moe import inspect, reshard


def test_routing_of_every_token(trained_checkpoint, data_bin, tmp_path, capsys):
    corpus = trained_checkpoint.parent  # (the toy corpus: raw text beside the data-bin)
    src, tgt = (f"{data_bin}/../test.{side}" for side in ("src", "tgt"))
    out = tmp_path / "single"
    assert inspect.main([str(trained_checkpoint), "--data", data_bin, "--input", src, "--target", tgt,
                         "--out", str(out), "--show", "2"]) == 0
    names = ["decoder.layers.1.fc1", "encoder.layers.1.fc1"]
    assert sorted(p.name for p in out.iterdir()) == sorted([f"heatmap-{n}.png" for n in names] + ["routing.txt"])
    assert all((out / f"heatmap-{n}.png").stat().st_size > 3000 for n in names)
    report = (out / "routing.txt").read_text()
    first_src = open(src).readline().split()
    block = report.split("sentence 1, encoder.layers.1.fc1:\n")[1].split("\n")[:len(first_src) + 1]
    assert [row.split()[0] for row in block] == first_src + ["</s>"]  # every token, eos included
    for row in block:  # top-2 at eval, dropless (tiny archs): two experts whose weights sum to 1
        weights = [float(w) for w in re.findall(r"e\d:([\d.]+)", row)]
        assert len(weights) == 2 and sum(weights) == pytest.approx(1, abs=0.011), row
    assert "sentence 3," not in report and "over 20 sentences" in report
    shares = [float(x) for x in re.findall(r"expert +\d+ +([\d.]+)%", report)]
    assert len(shares) == 8 and sum(shares[:4]) == pytest.approx(100, abs=0.3)

    # The same checkpoint resharded into a 2-rank set: the same report.
    reshard.main([str(trained_checkpoint), str(tmp_path / "set" / "checkpoint.pt"), "--world-size", "2"])
    out2 = tmp_path / "from-set"
    inspect.main([str(tmp_path / "set" / "checkpoint.pt"), "--data", data_bin, "--input", src, "--target", tgt,
                  "--out", str(out2), "--show", "2"])
    assert (out2 / "routing.txt").read_text() == report


def test_a_model_whose_layers_have_their_own_expert_counts(data_bin, tmp_path):
    """--moe-expert-count 2,6: each layer's report and heat map has its own experts; the set it is resharded into (2
    ranks: the encoder's one expert each, the decoder's three) gives the same report."""
    from tests.fairseq_moe.helpers import run_train, train_argv

    run_train(train_argv(data_bin, tmp_path / "train", "--max-update", "2", "--moe-expert-count", "2,6"))
    src = f"{data_bin}/../test.src"
    out = tmp_path / "out"
    assert inspect.main([str(tmp_path / "train" / "checkpoint_last.pt"), "--data", data_bin, "--input", src,
                         "--out", str(out)]) == 0
    report = (out / "routing.txt").read_text()
    shares = [int(e) for e in re.findall(r"expert +(\d+) +[\d.]+%", report)]
    assert sorted(shares) == sorted([0, 1] + list(range(6))), report
    reshard.main([str(tmp_path / "train" / "checkpoint_last.pt"), str(tmp_path / "set" / "checkpoint.pt"),
                  "--world-size", "2"])
    inspect.main([str(tmp_path / "set" / "checkpoint.pt"), "--data", data_bin, "--input", src, "--out",
                  str(tmp_path / "from-set")])
    assert (tmp_path / "from-set" / "routing.txt").read_text() == report


def test_one_layer_and_bad_input(trained_checkpoint, data_bin, tmp_path, capsys):
    src = f"{data_bin}/../test.src"
    out = tmp_path / "one"
    inspect.main([str(trained_checkpoint), "--data", data_bin, "--input", src, "--layer", "0", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["heatmap-encoder.layers.1.fc1.png", "routing.txt"]
    assert inspect.main([str(trained_checkpoint), "--data", data_bin, "--input", src, "--layer", "7"]) == 2
    assert "--layer 7: the MoE layers are 0 (encoder.layers.1.fc1)" in capsys.readouterr().err
    assert inspect.main([str(trained_checkpoint), "--data", data_bin, "--input", str(tmp_path / "none.txt")]) == 2
    assert f"--input {tmp_path / 'none.txt'}: no such file" in capsys.readouterr().err


def test_language_model_reads_eos_first(lm_data_bin, tmp_path):
    """An LM's layers see '</s> w1 .. wn' (what fairseq's LM datasets feed it), each token with its k experts."""
    from tests.fairseq_moe.helpers import lm_train_argv, run_train

    run_train(lm_train_argv(lm_data_bin, tmp_path / "lm", "--max-update", "1", "--moe-expert-count", "4"))
    text = f"{lm_data_bin}/../test.txt"
    out = tmp_path / "out"
    inspect.main([str(tmp_path / "lm" / "checkpoint_last.pt"), "--data", lm_data_bin, "--input", text,
                  "--out", str(out), "--show", "1"])
    words = open(text).readline().split()
    report = (out / "routing.txt").read_text()
    block = report.split("sentence 1, decoder.layers.1.fc1:\n")[1].split("\n")[:len(words) + 1]
    assert [row.split()[0] for row in block] == ["</s>"] + words
    assert all(len(re.findall(r"e\d:", row)) == 2 for row in block)


@pytest.mark.parametrize("what", ["routing.txt", "a link to a file", "--out a file"])
def test_nothing_is_written_over_a_file_or_through_a_link(trained_checkpoint, data_bin, tmp_path, capsys, what):
    src = f"{data_bin}/../test.src"
    out, precious = tmp_path / "out", tmp_path / "precious.txt"
    precious.write_text("mine")
    if what == "--out a file":
        out = precious
    else:
        out.mkdir()
        if what == "routing.txt":
            (out / "routing.txt").write_text("mine")
        else:
            (out / "heatmap-encoder.layers.1.fc1.png").symlink_to(precious)
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    assert inspect.main([str(trained_checkpoint), "--data", data_bin, "--input", src, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err, err
    assert ("is a file, not a folder" if what == "--out a file" else " exists") in err
    assert precious.read_text() == "mine"
    if before is not None:
        assert sorted(p.name for p in out.iterdir()) == before


def test_the_data_of_another_task_is_one_line(trained_checkpoint, lm_data_bin, tmp_path, capsys):
    """A translation checkpoint with a language model's data-bin (no dict.src.txt), and with a folder that is
    not there: one line naming --data, nothing written."""
    text = f"{lm_data_bin}/../test.txt"
    for data, match in ((lm_data_bin, "has no dict.SRC.txt and dict.TGT.txt"),
                        (str(tmp_path / "none"), "no such folder")):
        assert inspect.main([str(trained_checkpoint), "--data", data, "--input", text, "--out",
                             str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--data {data}" in err and match in err, err
    assert not (tmp_path / "o").exists()
