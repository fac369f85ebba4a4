"""fairseq-train with the experts spread over W gloo processes equals the same run on one process.

Same model, same global batch (one process uses --update-freq W), dropless, no dropout: after a few
updates the loss and the parameters agree within float rounding. Rank 0's checkpoint holds the shared parameters
and rank 0's experts, which must equal the first E/W experts of the one-process model.
"""
import os
import subprocess
import sys

import pytest
import torch

from .helpers import run_train, train_argv

# SGD, not Adam: the key-projection biases have an exactly-zero gradient (softmax ignores a shift),
# and Adam would turn float rounding there into full-size steps of random sign.
COMMON = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9",
          "--moe-capacity-factor", "0", "--dropout", "0", "--attention-dropout", "0",
          "--max-update", "4", "--moe-expert-count", "4", "--required-batch-size-multiple", "1")


@pytest.mark.slow
@pytest.mark.parametrize("world_size, extra", [(2, ()), (4, ("--moe-a2a-local-size", "2"))])
def test_w_ranks_equal_one_rank(data_bin, tmp_path, world_size, extra):
    one = tmp_path / "one"
    run_train(train_argv(data_bin, one, *COMMON, "--update-freq", str(world_size)))
    many = tmp_path / "many"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(world_size), "--",
           "fairseq-train", *train_argv(data_bin, many, *COMMON, *extra)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if extra:
        assert "hierarchical 2x2 all-to-all" in out.stderr + out.stdout

    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    b = torch.load(many / "checkpoint_last.pt", weights_only=True)
    # The validation loss after the last update (the valid set is split over the W ranks).
    assert b["extra_state"]["val_loss"] == pytest.approx(a["extra_state"]["val_loss"], rel=1e-5)
    a, b = a["model"], b["model"]
    assert set(a) == set(b)
    local = 4 // world_size
    for name, pa in a.items():
        pb = b[name]
        if ".experts." in name:
            pa = pa[:local]  # rank 0 holds experts 0 .. E/W - 1
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=name)
