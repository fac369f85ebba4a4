"""fairseq-train with the experts spread over W gloo processes equals the same run on one process.

Same model, same global batch (one process uses --update-freq W), dropless, no dropout: after a few
updates the loss and the parameters agree within float rounding. The W-rank run saves a set of files
(NAME-shared.pt + NAME-rank-R.pt) that holds every expert and its optimizer state; it loads on one
process for fairseq-generate and resumes training on one process exactly where the W ranks stopped.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards

from tests import warm
from tests.conftest import free_port
from tests.fairseq_moe.helpers import USER_DIR, assert_same_params, run_generate, run_train, tail, train_argv

# SGD, not Adam: the key-projection biases have an exactly-zero gradient (softmax ignores a shift),
# and Adam would turn float rounding there into full-size steps of random sign.
COMMON = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9",
          "--moe-capacity-factor", "0", "--dropout", "0", "--attention-dropout", "0",
          "--max-update", "4", "--moe-expert-count", "4", "--required-batch-size-multiple", "1")


def launch(world_size, save_dir, *argv):
    """python -m fairseq_moe.launch --nproc W -- fairseq-train ...: the Popen, started."""
    cmd = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(world_size), "--", "fairseq-train", *argv]
    return warm.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))


def finish(proc):
    out = subprocess.CompletedProcess(proc.args, None, *proc.communicate(timeout=600))
    assert proc.returncode == 0, tail(out.stderr)
    return out


class Launched:
    """A W-rank run started now; result() waits for it: (its save dir, its CompletedProcess)."""

    def __init__(self, world_size, save_dir, argv):
        self.save_dir, self.proc, self.out = save_dir, launch(world_size, save_dir, *argv), None

    def result(self):
        if self.out is None:
            self.out = finish(self.proc)
        return self.save_dir, self.out


def stats(path):
    return ("--moe-stats-file", str(path), "--moe-stats-interval", "2")


@pytest.fixture(scope="module")
def launched(data_bin, tmp_path_factory):
    """The 2-rank run of COMMON under fairseq_moe.launch (the torchrun test compares with it too), with
    its statistics file beside the save folder."""
    many = tmp_path_factory.mktemp("many")
    run = Launched(2, many, train_argv(data_bin, many, *COMMON, *stats(many.parent / "many-stats.jsonl")))
    run.stats = many.parent / "many-stats.jsonl"
    return run


@pytest.mark.slow
@pytest.mark.parametrize("world_size, extra", [
    (2, ()),
    (2, ("--moe-a2a-overlap-degree", "3", "--moe-score", "sigmoid", "--moe-bias-update-rate", "0.01")),
    (4, ("--moe-a2a-local-size", "2", "--moe-shared-expert-count", "1")),
    # Every rank skips the same layers. (No momentum: a skipped layer's gradient is None on one process but
    # zeros after the ranks' all-reduce, and momentum would still move it.)
    (2, ("--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.5", "--momentum", "0")),
    (2, ("--store-ema", "--ema-decay", "0.8", "--ema-fp32")),  # each rank's EMA of its experts, in the set
    # DeepSeek's sequence-wise balance loss: each sentence's alone, so W ranks are one process's micro-batches
    (2, ("--moe-balance-loss-scope", "sequence", "--moe-gate-loss-wt", "0.1", "--use-moe-pad-mask")),
    # Each MoE layer its own count: the encoder's 2 experts have 2 replicas on 4 ranks, the decoder's 8 two per rank.
    (4, ("--moe-expert-count", "2,8")),
])
def test_w_ranks_equal_one_rank(data_bin, tmp_path, world_size, extra, request):
    # The W ranks run while the 1-process reference trains here (tests use one thread: two cores).
    many = tmp_path / "many"
    run = (request.getfixturevalue("launched") if (world_size, extra) == (2, ())
           else Launched(world_size, many, train_argv(data_bin, many, *COMMON, *extra)))
    one = tmp_path / "one"
    reference_stats = tmp_path / "one-stats.jsonl"
    run_train(train_argv(data_bin, one, *COMMON, *extra, "--update-freq", str(world_size),  # (a2a flags: no-ops)
                         *(stats(reference_stats) if (world_size, extra) == (2, ()) else ())))
    many, out = run.result()
    if "--moe-a2a-local-size" in extra:
        assert "hierarchical 2x2 all-to-all" in out.stderr + out.stdout

    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    base = str(many / "checkpoint_last")
    assert sorted(os.listdir(many)) == sorted(
        [f"checkpoint_{n}-{r}.pt" for n in ("last", "best") for r in ["shared"] + [f"rank-{i}" for i in range(world_size)]])
    b = shards.assemble(base)
    # The validation loss after the last update (the valid set is split over the W ranks).
    assert b["extra_state"]["val_loss"] == pytest.approx(a["extra_state"]["val_loss"], rel=1e-5)
    assert_same_params(b["model"], a["model"])
    want = [2, 8] if "2,8" in extra else [4, 4]  # every expert of each layer, not rank 0's
    assert [b["model"][f"{side}.layers.1.fc1.moe.experts.w1"].shape[0] for side in ("encoder", "decoder")] == want
    if "--store-ema" in extra:
        check_ema(data_bin, tmp_path, one, base, extra, a, b)
    if world_size > 2 or extra:
        return
    # The statistics file counts the tokens of every rank: the same lines as the 1-process run's.
    a_lines, b_lines = ([json.loads(line) for line in path.read_text().splitlines()] for path in
                        (reference_stats, run.stats))
    assert [line["update"] for line in b_lines] == [2, 4] and len(a_lines) == len(b_lines)
    for x, y in zip(a_lines, b_lines):
        assert x["tokens"] == y["tokens"] and x.keys() == y.keys()
        for key in ("layers", "dropped", "entropy"):
            for name in x[key]:
                assert x[key][name] == pytest.approx(y[key][name], rel=1e-5, abs=1e-9), (key, name)

    # fairseq-generate on one process reads the set through its shared file.
    scorer = run_generate([data_bin, "--user-dir", USER_DIR, "--path", base + "-shared.pt",
                           "--task", "moe_translation", "--gen-subset", "test", "--beam", "2", "--cpu"])
    assert "BLEU" in scorer.result_string()

    # Resharding: the W-rank set resumes on 1 process (experts, momentum, data position) and continues
    # exactly as the 1-process run does.
    run_train(train_argv(data_bin, one, *COMMON, "--update-freq", str(world_size), "--max-update", "6"))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    run_train(train_argv(data_bin, resumed, *COMMON, "--update-freq", str(world_size), "--max-update", "6",
                         "--restore-file", base + ".pt"))
    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    c = torch.load(resumed / "checkpoint_last.pt", weights_only=True)
    # Resumed (a fresh start would have one entry, and the same parameters as the 1-process run).
    assert [h["num_updates"] for h in c["optimizer_history"]] == [4, 6]
    assert_same_params(c["model"], a["model"])
    torch.testing.assert_close(c["last_optimizer_state"], a["last_optimizer_state"], rtol=1e-5, atol=1e-6)

    # And back: the 1-process checkpoint (update 6) resumes on W ranks, each cutting out its experts
    # and their momentum, and continues exactly like the 1-process run.
    run_train(train_argv(data_bin, one, *COMMON, "--update-freq", str(world_size), "--max-update", "8"))
    finish(launch(world_size, tmp_path / "again", *train_argv(
        data_bin, resumed, *COMMON, "--max-update", "8", "--restore-file", str(resumed / "checkpoint_last.pt"),
        "--save-dir", str(tmp_path / "again"))))
    d = shards.assemble(str(tmp_path / "again" / "checkpoint_last"))
    assert [h["num_updates"] for h in d["optimizer_history"]][-2:] == [6, 8]
    assert_same_params(d["model"], torch.load(one / "checkpoint_last.pt", weights_only=True)["model"])


def check_ema(data_bin, tmp_path, one, base, extra, a, b):
    """--store-ema on 2 ranks: the EMA copy (and its fp32 copy) of every expert and shared parameter equals the
    1-process run's; the set resumes on one process (its EMA experts put back together) and, 4 + 2 updates,
    equals 6 uninterrupted updates."""
    for part in ("ema", "ema_fp32_params"):
        assert b["extra_state"][part]["encoder.layers.1.fc1.moe.experts.w1"].shape[0] == 4
        assert_same_params(b["extra_state"][part], a["extra_state"][part])
    resumed = tmp_path / "ema-resumed"
    run_train(train_argv(data_bin, one, *COMMON, *extra, "--update-freq", "2", "--max-update", "6"))
    run_train(train_argv(data_bin, resumed, *COMMON, *extra, "--update-freq", "2", "--max-update", "6",
                         "--restore-file", base + ".pt"))
    a6 = torch.load(one / "checkpoint_last.pt", weights_only=True)
    c = torch.load(resumed / "checkpoint_last.pt", weights_only=True)
    assert [h["num_updates"] for h in c["optimizer_history"]] == [4, 6]
    for part in ("ema", "ema_fp32_params"):
        assert_same_params(c["extra_state"][part], a6["extra_state"][part])
    # The EMA weights of the 2-rank set as a model of their own (reshard --ema), for generation.
    from fairseq_moe import reshard

    assert reshard.main([base + ".pt", str(tmp_path / "ema.pt"), "--world-size", "1", "--ema"]) == 0
    e = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert_same_params(e["model"], b["extra_state"]["ema"])
    assert e.get("last_optimizer_state") is None and "ema" not in e["extra_state"]
    scorer = run_generate([data_bin, "--user-dir", USER_DIR, "--path", str(tmp_path / "ema.pt"), "--task",
                           "moe_translation", "--gen-subset", "test", "--beam", "2", "--cpu"])
    assert "BLEU" in scorer.result_string()


@pytest.mark.slow
def test_the_global_balance_loss_trains_on_ranks(data_bin, tmp_path):
    """--moe-balance-loss-scope global on 2 ranks, 2 micro-batches an update: every micro-batch all-reduces the counts
    and the sample size (the epochs' dummy batches included, which count on no rank); the run ends, its balance loss
    logged. (Its gradient against one process holding both ranks' batches at once:
    tests/fairseq_moe/criterions/test_moe_loss.py; the pooling of an update's micro-batches: test_losses.py.)"""
    _, out = Launched(2, tmp_path, train_argv(data_bin, tmp_path, *COMMON, "--moe-balance-loss-scope", "global",
                                              "--max-update", "6", "--update-freq", "2")).result()
    assert "moe_balance_loss" in out.stdout + out.stderr
    assert (tmp_path / "checkpoint_last-rank-1.pt").exists()


def test_torchrun_environment_on_cpu(monkeypatch):
    """Under torchrun on CPU the ranks join one job of WORLD_SIZE (fairseq 0.12 would train N independent
    models, or divide by the CUDA device count); NCCL and PyTorch DDP are refused by name; a world size
    that disagrees with the launcher's is refused."""
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.distributed import utils as distributed_utils
    from omegaconf import OmegaConf

    from fairseq_moe.errors import FlagError

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29555"), ("WORLD_SIZE", "2"), ("RANK", "1")):
        monkeypatch.setenv(key, value)

    def infer(**flags):
        cfg = OmegaConf.structured(FairseqConfig()).distributed_training
        for key, value in flags.items():
            cfg[key] = value
        distributed_utils.infer_init_method(cfg)
        return cfg

    cfg = infer(distributed_backend="gloo", ddp_backend="legacy_ddp")
    assert (cfg.distributed_init_method, cfg.distributed_world_size, cfg.distributed_rank,
            cfg.distributed_no_spawn) == ("env://", 2, 1, True)
    with pytest.raises(FlagError, match="--distributed-backend nccl and --ddp-backend pytorch_ddp cannot run"):
        infer()
    with pytest.raises(FlagError, match="--distributed-world-size 4 but the launcher started WORLD_SIZE=2"):
        infer(distributed_world_size=4, distributed_backend="gloo", ddp_backend="legacy_ddp")


@pytest.mark.slow
def test_torchrun_equals_the_launcher(data_bin, tmp_path, launched):
    """torchrun --nproc-per-node 2 fairseq-train ... --cpu, and two torchrun "nodes" of one rank each that
    meet by c10d rendezvous: one expert-parallel job each, the same as python -m fairseq_moe.launch
    --nproc 2 gives (bit for bit)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    gloo = ("--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp")
    bin_dir = os.path.dirname(sys.executable)
    torchrun, train = os.path.join(bin_dir, "torchrun"), os.path.join(bin_dir, "fairseq-train")
    one_node = [[torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), train,
                 *train_argv(data_bin, tmp_path / "one_node", *COMMON), *gloo]]
    endpoint = f"127.0.0.1:{free_port()}"
    two_nodes = [[torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend",
                  "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "moe", train,
                  *train_argv(data_bin, tmp_path / "two_nodes", *COMMON), *gloo] for node in (0, 1)]
    many, _ = launched.result()
    a = shards.assemble(str(many / "checkpoint_last"))
    for name, commands in (("one_node", one_node), ("two_nodes", two_nodes)):
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for c in commands]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), tail(logs[0])
        assert sorted(os.listdir(tmp_path / name)) == sorted(os.listdir(many))
        b = shards.assemble(str(tmp_path / name / "checkpoint_last"))
        torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=0)
        assert b["optimizer_history"][-1]["num_updates"] == 4
