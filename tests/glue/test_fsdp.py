"""--ddp-backend fully_sharded with the experts spread (fsdp.py, torch's FSDP): W ranks, each holding about 1/W of
every dense parameter, its gradient and its optimizer state, and its own experts whole, train as one process does
with --update-freq W on the same global batches (clipping on; --eval-bleu: tests/glue/test_spread_generate.py); the
set they save is a plain
set: it resumes (3 + 3 updates == 6, on the ranks and on one process without the flag), reshards 4 -> 2 ranks and
continues as the 4 ranks do, consolidates and generates. --memory-efficient-fp16 agrees with legacy_ddp's to fp16's
precision; a non-pointwise optimizer is one line."""
import re
import subprocess

import pytest
import torch

from fairseq_moe import reshard

from .helpers import USER_DIR, assert_same_params, run_generate, run_train, tail, train_argv
from .test_expert_parallel import COMMON, Launched, finish, launch
from .test_optim import CLIP, assert_same_optimizer_state, full, resumes_and_reshards

FSDP = ("--ddp-backend", "fully_sharded", "--min-params-to-wrap", "0", *CLIP)


def sharded_line(log, W):
    """fsdp.shard's line: how many dense tensors were cut over how many ranks, the experts left whole, and the
    settings: (tensors, parameters, units, experts, resharded after forward, dtype of the reduction)."""
    found = re.findall(r"fully_sharded \(torch's FSDP\): (\d+) dense tensors \((\d+) parameters\) in (\d+) units cut "
                       rf"over {W} ranks; (\d+) expert tensors left whole; layers resharded after forward: (\w+); "
                       r"gradients reduced in (float32|their dtype)", log)
    assert found, tail(log)
    *counts, reshard, dtype = found[0]
    return [int(x) for x in counts] + [reshard, dtype]


@pytest.mark.slow
def test_fully_sharded_with_spread_experts(data_bin, tmp_path):
    def argv(save, *extra, updates=3):
        return train_argv(data_bin, save, *COMMON, *FSDP, "--max-update", str(updates), *extra)

    # 2 and 4 ranks (the layers kept gathered from forward to backward) run while the 1-process references train here
    two = Launched(2, tmp_path / "two", argv(tmp_path / "two"))
    run_train(train_argv(data_bin, tmp_path / "one2", *COMMON, *CLIP, "--max-update", "3", "--update-freq", "2"))
    _, out = two.result()
    four = Launched(4, tmp_path / "four", argv(tmp_path / "four", "--no-reshard-after-forward"))
    run_train(train_argv(data_bin, tmp_path / "one4", *COMMON, *CLIP, "--max-update", "3", "--update-freq", "4"))
    _, out4 = four.result()
    for W, one, log, kept in ((2, "one2", out.stdout + out.stderr, "True"),
                              (4, "one4", out4.stdout + out4.stderr, "False")):
        tensors, _, units, experts, resharded, _ = sharded_line(log, W)
        assert tensors > 50 and units == 5 and experts == 8  # 4 layers of their own, 2 MoE layers x 4 tensors
        assert resharded == kept
        a = torch.load(tmp_path / one / "checkpoint_last.pt", weights_only=True)
        b = full(tmp_path / ("two" if W == 2 else "four") / "checkpoint_last")
        assert_same_params(b["model"], a["model"])
        assert_same_optimizer_state(b, a)

    # 3 + 3 updates == 6, on one process without the flag and on 2 ranks; 4 ranks resharded to 2 continue alike
    resumes_and_reshards(data_bin, tmp_path, argv)

    # Consolidated, it generates what the 1-process run's checkpoint of the same updates generates.
    assert reshard.main([str(tmp_path / "two" / "checkpoint_last.pt"), str(tmp_path / "whole.pt"),
                         "--world-size", "1"]) == 0
    scores = [run_generate([data_bin, "--user-dir", USER_DIR, "--path", str(path), "--task", "moe_translation",
                            "--gen-subset", "test", "--beam", "2", "--batch-size", "8", "--cpu", "--quiet"])
              .result_string() for path in (tmp_path / "whole.pt", tmp_path / "one2" / "checkpoint_last.pt")]
    assert scores[0] == scores[1] and scores[0].startswith("BLEU"), scores


@pytest.mark.slow
def test_fully_sharded_fp16_and_refused_optimizers(data_bin, tmp_path):
    """--memory-efficient-fp16 (--fp32-reduce-scatter) on 2 ranks: the parameters after 3 updates, and after a resume
    to 5, are legacy_ddp's to fp16's precision (FSDP reduce-scatters where legacy_ddp all-reduces: the sums round
    differently), the Adam state fp32 through the resume; the attention's key biases, whose gradient is 0 up to
    rounding, left out. --optimizer adafactor: one line before any update."""
    adam = [x for x in COMMON if x not in ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9")]
    fp16 = ("--optimizer", "adam", "--lr", "0.003", "--fp16", "--memory-efficient-fp16")
    for updates in (3, 5):
        runs = {name: launch(2, tmp_path / name, *train_argv(data_bin, tmp_path / name, *adam, *fp16, *extra,
                                                             "--max-update", str(updates)))
                for name, extra in (("legacy", CLIP), ("fsdp", (*FSDP, "--fp32-reduce-scatter")))}
        out = {name: finish(proc) for name, proc in runs.items()}
        assert sharded_line(out["fsdp"].stdout + out["fsdp"].stderr, 2)[5] == "float32"
        a, b = (full(tmp_path / name / "checkpoint_last") for name in ("legacy", "fsdp"))
        assert [h["num_updates"] for h in b["optimizer_history"]][-1] == updates
        assert a["last_optimizer_state"]["loss_scale"] == b["last_optimizer_state"]["loss_scale"] > 0  # (fp16 ran)
        assert {v.dtype for e in b["last_optimizer_state"]["state"].values() for v in e.values()
                if torch.is_tensor(v) and v.dim()} == {torch.float32}
        errors = {k: ((b["model"][k].float() - v.float()).norm() / v.float().norm()).item()
                  for k, v in a["model"].items() if not k.endswith("k_proj.bias")}
        assert max(errors.values()) < 3e-3, sorted(errors.items(), key=lambda kv: kv[1])[-3:]

    bad = launch(2, tmp_path / "ada", *train_argv(data_bin, tmp_path / "ada", *adam, "--optimizer", "adafactor",
                                                  "--lr", "0.01", *FSDP))
    out = subprocess.CompletedProcess(bad.args, None, *bad.communicate(timeout=600))
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert bad.returncode != 0 and len(errors) == 1, tail(out.stderr)
    assert "--optimizer adafactor cannot be used with --ddp-backend fully_sharded" in errors[0]
    assert not list((tmp_path / "ada").glob("*.pt"))


def _fp16_state_resumes(rank, W):
    """A sharded fp16 model (a dense and an expert tensor) under fairseq's MemoryEfficientFP16Optimizer: its state
    dict holds whole fp32 tensors; loaded into a new optimizer, the dense state is this rank's rows (DTensors) and
    every entry stays fp32 (torch casts to the fp16 parameter's dtype; fairseq's own hack would put back whole
    tensors), and it steps."""
    from types import SimpleNamespace

    from fairseq.optim.adam import FairseqAdam
    from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
    from omegaconf import OmegaConf
    from torch.distributed import group
    from torch.distributed.tensor import DTensor

    from fairseq_moe import fsdp

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense, self.expert = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.randn(2, 4))
            self.expert.expert = True

        def forward(self, x):
            return self.dense(x) @ self.expert.t()

    torch.manual_seed(0)
    model = Model().half()
    fsdp.shard(model, group.WORLD, torch.device("cpu"),
               SimpleNamespace(no_reshard_after_forward=False, fp32_reduce_scatter=False))
    params = list(model.parameters())
    adam = OmegaConf.create(dict(adam_betas="(0.9, 0.98)", adam_eps=1e-8, weight_decay=0.0, use_old_adam=False,
                                 fp16_adam_stats=False, tpu=False, lr=[0.001]))
    cfg = OmegaConf.create(dict(common=dict(fp16_init_scale=128, fp16_scale_window=None, fp16_scale_tolerance=0.0,
                                            threshold_loss_scale=None, min_loss_scale=1e-4, bf16=False,
                                            memory_efficient_bf16=False, model_parallel_size=1),
                                distributed_training=dict(distributed_world_size=W), optimization=dict(update_freq=[1])))

    def build():
        optimizer = MemoryEfficientFP16Optimizer(cfg, params, FairseqAdam(adam, params))
        fsdp.shard_optimizer_state(fsdp.torch_optimizer(optimizer))
        return optimizer

    def step(optimizer):
        optimizer.zero_grad()
        optimizer.backward(model(torch.randn(3, 4).half()).float().sum())
        optimizer.clip_grad_norm(0.0)
        optimizer.step()

    first = build()
    step(first)
    saved = first.state_dict()
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for e in saved["state"].values()
               for v in e.values() if torch.is_tensor(v))
    second = build()
    second.load_state_dict(saved)
    state = fsdp.torch_optimizer(second).state
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[p][key].dtype == torch.float32 and isinstance(state[p][key], DTensor) == (p is not
                                                                                                  model.expert)
    step(second)


@pytest.mark.slow
def test_a_sharded_fp16_optimizer_state_resumes_as_fp32_rows():
    from ..moe.test_comm import spawn

    spawn(_fp16_state_resumes, 2)
