"""checkpoint.check_fits through fairseq-train: a checkpoint resumed with flags that give its MoE layers other
weights is refused in one line naming the flags as saved and as given, before any weight is loaded (fairseq
would stop at a size mismatch or a missing key, once per rank); flags that only steer the routing are
accepted, and one log line says what changed."""
import logging

import pytest
import torch

from fairseq_moe.errors import CheckpointError

from tests.fairseq_moe.helpers import run_train, train_argv

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


def test_another_expert_kind_is_named_by_its_flag(data_bin, trained_checkpoint, tmp_path):
    with pytest.raises(CheckpointError) as e:
        run_train(train_argv(data_bin, tmp_path / "x", *ARGS, "--restore-file", str(trained_checkpoint),
                             "--moe-expert-kind", "swiglu"))
    assert str(e.value) == (f"{trained_checkpoint} was saved with --moe-expert-kind ffn; this model has "
                            f"--moe-expert-kind swiglu. Resume with --moe-expert-kind ffn, or train into another "
                            f"--save-dir")
    assert not (tmp_path / "x" / "checkpoint_last.pt").exists()


def test_routing_flags_changed_on_resume_are_one_log_line(data_bin, trained_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fairseq_moe.checkpoints.fits")
    run_train(train_argv(data_bin, tmp_path / "x", *ARGS, "--restore-file", str(trained_checkpoint),
                         "--moe-top-k", "1", "--moe-score", "sigmoid", "--moe-bias-update-rate", "0.001"))
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_moe.checkpoints.fits"]
    assert len(lines) == 1, lines
    assert ("saved with --moe-bias-update-rate 0.0, --moe-eval-top-k 2, --moe-score softmax, --moe-top-k 2; this "
            "run has --moe-bias-update-rate 0.001, --moe-eval-top-k 1, --moe-score sigmoid, --moe-top-k 1: the "
            "weights load as saved") in lines[0]  # (an unset eval top-k is the top-k)


def test_the_balancing_bias_may_be_turned_off_on_resume(data_bin, tmp_path, caplog):
    biased = tmp_path / "biased"
    run_train(train_argv(data_bin, biased, *ARGS, "--moe-score", "sigmoid", "--moe-bias-update-rate", "0.001"))
    caplog.set_level(logging.WARNING, logger="fairseq_moe.checkpoints.fits")
    run_train(train_argv(data_bin, tmp_path / "x", *ARGS[:-1], "4", "--restore-file",
                         str(biased / "checkpoint_last.pt"), "--moe-score", "sigmoid"))
    assert "saved with --moe-bias-update-rate 0.001; this run has --moe-bias-update-rate 0.0" in caplog.text


def test_the_flag_that_places_the_moe_layers_is_named():
    """A language model has no --encoder-moe-freq; a side's 0 means --moe-freq, which is then the flag."""
    from argparse import Namespace

    from fairseq_moe.checkpoints.fits import flag_changes

    lm = dict(decoder_layers=2, decoder_ffn_embed_dim=64, encoder_moe_freq=0, decoder_moe_freq=0,
              moe_expert_ffn_dim=None)
    assert flag_changes(Namespace(**lm, moe_freq=2), Namespace(**lm, moe_freq=1)) == {"--moe-freq": (2, 1)}
    mt = dict(lm, encoder_layers=2, encoder_ffn_embed_dim=256, moe_freq=0)
    dense_encoder = Namespace(**dict(mt, decoder_moe_freq=2))
    assert flag_changes(dense_encoder, Namespace(**dict(mt, decoder_moe_freq=1))) == {"--decoder-moe-freq": (2, 1)}
    # An unset expert width is the width of the sides with MoE layers (the dense encoder's 256 is not one).
    assert flag_changes(dense_encoder, Namespace(**dict(mt, decoder_moe_freq=2, moe_expert_ffn_dim=64))) == {}


def test_store_ema_resumes_a_checkpoint_saved_without_one(data_bin, tmp_path):
    """--store-ema switched on at a resume (or a set from before the EMA was kept): the EMA starts from the
    loaded weights (fairseq 0.12 would read state["model"] after deleting it: KeyError)."""
    from tests.fairseq_moe.helpers import run_train, train_argv

    common = ("--moe-expert-count", "4", "--required-batch-size-multiple", "1")
    run_train(train_argv(data_bin, tmp_path, *common, "--max-update", "2"))
    run_train(train_argv(data_bin, tmp_path, *common, "--max-update", "3", "--store-ema", "--ema-decay", "0.9"))
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 3 and "ema" in state["extra_state"]
