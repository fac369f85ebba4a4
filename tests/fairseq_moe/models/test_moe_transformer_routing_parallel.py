"""Each routing policy under fairseq-train with the experts spread over 2 gloo ranks equals one process.

As in test_expert_parallel.py: same model and global batch (one process uses --update-freq 2), no dropout,
SGD; after a few updates the validation loss and every parameter agree within float rounding. Expert
choice and soft routing mix the tokens of a batch (per rank, and per sentence for soft), so they run in
the encoder only (decoders refuse them); each rank's batch is the one-process run's micro-batch. The soft
case uses Soft MoE's normalised router (a 0-d learned scale, all-reduced like any replicated parameter).
"""
import os

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards

from tests.fairseq_moe.helpers import assert_same_params, run_train, train_argv
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched

ENCODER_ONLY = ("--moe-freq", "0", "--encoder-moe-freq", "2")
# GELU, not ReLU: with every expert on every token (dense) a pre-activation within float rounding of 0
# turns up; ReLU's kink then flips one hidden unit's gradient between 0 and its full size (seen: one row of
# a dense FFN 4e-5 apart after 2 updates, everything else within 1e-7). GELU's gradient is continuous.
SMOOTH = ("--activation-fn", "gelu")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ("--moe-routing", "expert_choice", "--moe-capacity-factor", "1.0", *ENCODER_ONLY),
    ("--moe-routing", "dense"),
    ("--moe-routing", "hash", "--moe-top-k", "1"),
    ("--moe-routing", "soft", "--moe-soft-slots", "2", "--moe-gate", "scaled_cosine", *ENCODER_ONLY),
], ids=["expert_choice", "dense", "hash", "soft"])
def test_two_ranks_equal_one_process(data_bin, tmp_path, extra):
    many, one = tmp_path / "many", tmp_path / "one"
    argv = (*COMMON, *SMOOTH, *extra)
    run = Launched(2, many, train_argv(data_bin, many, *argv))  # runs while the reference trains
    run_train(train_argv(data_bin, one, *argv, "--update-freq", "2"))
    many, _ = run.result()

    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    assert sorted(os.listdir(many)) == sorted(
        f"checkpoint_{n}-{r}.pt" for n in ("last", "best") for r in ("shared", "rank-0", "rank-1"))
    b = shards.assemble(str(many / "checkpoint_last"))
    assert b["extra_state"]["val_loss"] == pytest.approx(a["extra_state"]["val_loss"], rel=1e-5)
    assert_same_params(b["model"], a["model"])
    experts = [key for key in b["model"] if key.endswith("moe.experts.w1")]
    assert experts and all(b["model"][key].shape[0] == 4 for key in experts)  # every expert, not rank 0's
    gates = [key for key in b["model"] if key.endswith(".moe.gate.weight")]
    assert len(gates) == (0 if "hash" in extra else len(experts))  # (hash routing has no router)
