"""checkpoint.check_fits through fairseq-train: a checkpoint resumed with flags that give its MoE layers other
weights is refused in one line naming the flags as saved and as given, before any weight is loaded (fairseq
would stop at a size mismatch or a missing key, once per rank); flags that only steer the routing are
accepted, and one log line says what changed."""
import logging

import pytest

from fairseq_moe.errors import CheckpointError

from .helpers import run_train, train_argv

ARGS = ("--moe-expert-count", "4", "--required-batch-size-multiple", "1", "--max-update", "3")


@pytest.mark.parametrize("flags, saved, given", [
    (("--moe-expert-ffn-dim", "32"), "--moe-expert-ffn-dim 64", "--moe-expert-ffn-dim 32"),  # (64: the FFN width)
    (("--moe-shared-expert-count", "1"), "--moe-shared-expert-count 0", "--moe-shared-expert-count 1"),
    (("--moe-routing", "hash", "--moe-top-k", "1"), "--moe-routing topk", "--moe-routing hash"),
    (("--moe-expert-ffn-dim", "64", "--moe-shared-expert-count", "1"), "--moe-shared-expert-count 0",
     "--moe-shared-expert-count 1"),  # (64: the FFN width, as saved: no change)
    (("--moe-gate", "cosine"), "--moe-gate linear", "--moe-gate cosine"),
])
def test_other_weights_are_named_by_their_flags(data_bin, trained_checkpoint, tmp_path, flags, saved, given):
    for reset in ((), ("--reset-optimizer",)):
        with pytest.raises(CheckpointError) as e:
            run_train(train_argv(data_bin, tmp_path / "x", *ARGS, "--restore-file", str(trained_checkpoint), *flags,
                                 *reset))
        msg = str(e.value)
        assert msg.startswith(f"{trained_checkpoint} does not fit this model (") and "\n" not in msg, msg
        assert f"saved with {saved}, this run has {given};" in msg, msg
    assert not (tmp_path / "x" / "checkpoint_last.pt").exists()


def test_routing_flags_changed_on_resume_are_one_log_line(data_bin, trained_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fairseq_moe.fits")
    run_train(train_argv(data_bin, tmp_path / "x", *ARGS, "--restore-file", str(trained_checkpoint),
                         "--moe-top-k", "1", "--moe-score", "sigmoid", "--moe-bias-update-rate", "0.001"))
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_moe.fits"]
    assert len(lines) == 1, lines
    assert ("saved with --moe-bias-update-rate 0.0, --moe-score softmax, --moe-top-k 2; this run has "
            "--moe-bias-update-rate 0.001, --moe-score sigmoid, --moe-top-k 1: the weights load as saved") in lines[0]
