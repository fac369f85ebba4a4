"""Kill a 2-rank expert-parallel run with SIGKILL; resumed from its mid-epoch checkpoint at update 4, it
continues exactly as the run did before it was killed: the same losses at updates 5-8 and the same
parameters and optimizer state at update 8.

fairseq reseeds every update (seed + update number), the iterator restarts mid-epoch where the
checkpoint says, and each rank gets back its own experts and their Adam moments from its rank file.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards

from tests import warm
from tests.fairseq_moe.helpers import tail, train_argv

W = 2
ARGS = ("--moe-expert-count", "4", "--max-tokens", "100", "--dropout", "0.1", "--activation-dropout", "0.1",
        "--save-interval-updates", "2", "--required-batch-size-multiple", "1", "--moe-eval-capacity-token-fraction", "0")


def launch(data_bin, save_dir, *extra, **popen):
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--",
           "fairseq-train", *train_argv(data_bin, save_dir, *ARGS, *extra)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def losses(log):
    """{update: the train_inner fields that do not measure time} from fairseq's simple log."""
    out = {}
    for line in log.splitlines():
        if "| train_inner |" in line:
            fields = dict(re.findall(r"(\w+)=([^,\s]+)", line.split("| train_inner |", 1)[1]))
            out[int(fields["num_updates"])] = {k: v for k, v in fields.items() if k in KEEP}
    return out


KEEP = ("loss", "nll_loss", "moe_balance_loss", "moe_dropped", "gnorm", "lr", "wpb", "bsz")


def complete(base):
    return all(os.path.exists(p) for p in [shards.shared_path(base)] +
               [shards.rank_path(base, r) for r in range(W)])


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_continues_exactly(data_bin, tmp_path):
    save = tmp_path / "save"
    four, eight = str(save / "checkpoint_1_4"), str(save / "checkpoint_1_8")
    # No --max-update: only the kill stops it, once its set at update 8 is written (the reference).
    # Its own process group, so that SIGKILL reaches every rank.
    killed = launch(data_bin, save, start_new_session=True)
    deadline = time.time() + 600
    while not complete(eight) and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    log_killed, _ = killed.communicate(timeout=60)
    assert complete(eight), "the run stopped before its checkpoint at update 8: " + tail(log_killed)
    itr = torch.load(shards.shared_path(four), weights_only=True)["extra_state"]["train_iterator"]
    assert itr["epoch"] == 1 and itr["iterations_in_epoch"] > 0  # mid-epoch
    ref = shards.assemble(eight)

    resumed = launch(data_bin, save, "--max-update", "8", "--restore-file", four + ".pt",
                     "--keep-interval-updates", "2")
    log_resumed, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, tail(log_resumed)
    # fairseq deleted the older interval checkpoints on every rank; their shared files went with them.
    names = os.listdir(save)
    interval = sorted(n[:-len("-shared.pt")] for n in names if n.endswith("-shared.pt") and n.count("_") == 2)
    assert interval == ["checkpoint_1_6", "checkpoint_1_8"] and all(complete(str(save / n)) for n in interval), names
    assert len([n for n in names if "-rank-" in n]) == W * (len(interval) + 2), names  # + last and best

    a, b = losses(log_killed), losses(log_resumed)
    assert sorted(b) == [5, 6, 7, 8] and all(u in a for u in b)
    assert all(set(KEEP) <= set(b[u]) for u in b)
    assert {u: b[u] for u in b} == {u: a[u] for u in b}
    got = shards.assemble(str(save / "checkpoint_last"))
    assert [h["num_updates"] for h in got["optimizer_history"]][-2:] == [4, 8]
    torch.testing.assert_close(got["model"], ref["model"], rtol=0, atol=0)
    torch.testing.assert_close(got["last_optimizer_state"]["state"], ref["last_optimizer_state"]["state"],
                               rtol=0, atol=0)
