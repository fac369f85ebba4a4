"""--ddp-backend fully_sharded with the experts spread (fsdp.py, torch's FSDP): W ranks, each holding about 1/W of
every dense parameter, its gradient and its optimizer state, and its own experts whole, train as one process does
with --update-freq W on the same global batches (clipping on; --eval-bleu: tests/fairseq_moe/hooks/test_spread.py); the
set they save is a plain
set: it resumes (3 + 3 updates == 6, on the ranks and on one process without the flag), reshards 4 -> 2 ranks and
continues as the 4 ranks do, consolidates and generates. --memory-efficient-fp16 agrees with legacy_ddp's to fp16's
precision; a non-pointwise optimizer is one line. --eval-bleu validates as often as asked while the ranks' beam searches
take different numbers of steps (the rank that is done first serves the other's MoE calls with its units gathered),
each validation what one process gives."""
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fairseq_moe import reshard

from tests import warm
from tests.fairseq_moe.helpers import (USER_DIR, assert_same_params, error_lines, run_generate, run_train, tail,
                                       train_argv)
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched, finish, launch
from tests.fairseq_moe.hooks.test_optim import CLIP, assert_same_optimizer_state, full, resumes_and_reshards

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
    errors = error_lines(out.stderr)
    assert bad.returncode != 0 and len(errors) == 1, tail(out.stderr)
    assert "--optimizer adafactor cannot be used with --ddp-backend fully_sharded" in errors[0]
    assert not list((tmp_path / "ada").glob("*.pt"))


def _fp16_state_resumes(rank, W):
    """A sharded fp16 model (a dense and an expert tensor) under fairseq's MemoryEfficientFP16Optimizer: its state
    dict holds whole fp32 tensors; loaded into a new optimizer, the dense state is this rank's rows (DTensors) and
    every entry stays fp32 (torch casts to the fp16 parameter's dtype; fairseq's own hack would put back whole
    tensors), and it steps."""

    from fairseq.optim.adam import FairseqAdam
    from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
    from omegaconf import OmegaConf
    from torch.distributed import group
    from torch.distributed.tensor import DTensor

    from fairseq_moe.hooks import fsdp

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
    from tests.fairseq_moe_layer.test_comm import spawn

    spawn(_fp16_state_resumes, 2)


# A validation (with its BLEU) after each update (one per epoch), each rank its own batches of 8 sentences of the valid
# set (sorted by length) and each beam search max_len_a 1: as long as its batch's longest source, so that the ranks'
# searches take different numbers of steps and one rank, done first, serves the other's MoE calls.
VALIDATING = (*COMMON, "--max-tokens", "1600", "--batch-size-valid", "8", "--no-save", "--eval-bleu",
              "--eval-bleu-detok", "space")
DIFFERENT_LENGTHS = ("--eval-bleu-args", '{"beam": 2, "max_len_a": 1, "max_len_b": 1}')
PER_BATCH = ("wps", "wpb", "bsz")  # (averages over the steps of a validation: one process takes twice as many)


def validations(log):
    """Every validation's metrics in a training log (the loss, the MoE metrics, the BLEU, ...), but PER_BATCH."""
    found = []
    for line in log.splitlines():
        if "| valid on 'valid' subset |" in line:
            fields = (field.split(" ", 1) for field in line.split("| valid on 'valid' subset | ")[1].split(" | "))
            found.append({key: value for key, value in fields if key not in PER_BATCH})
    return found


def assert_validates_as_one_process(data_bin, folder, updates, *extra):
    """fairseq-train --ddp-backend fully_sharded --eval-bleu on 2 ranks with extra, and one process with the same
    global batch (--update-freq 2): a validation after each of the updates on both, each with the same metrics (the
    loss, the MoE metrics, the BLEU). Returns the one process's validations."""
    argv = (*VALIDATING, "--max-update", str(updates), *extra)
    sharded = launch(2, folder / "fsdp", *train_argv(data_bin, folder / "fsdp", *argv, *FSDP))
    one = warm.run([os.path.join(os.path.dirname(sys.executable), "fairseq-train"),
                    *train_argv(data_bin, folder / "one", *argv, *CLIP, "--update-freq", "2")],
                   capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert one.returncode == 0, tail(one.stderr)
    fsdp = finish(sharded)
    assert sharded_line(fsdp.stdout + fsdp.stderr, 2)[2] == 5  # (each of the 4 layers a unit)
    want = validations(one.stdout + one.stderr)
    assert len(want) == updates and {"loss", "moe_balance_loss", "bleu"} <= set(want[0])
    assert validations(fsdp.stdout + fsdp.stderr) == want
    return want


@pytest.mark.slow
def test_eval_bleu_validates_as_often_as_asked_as_one_process_does(data_bin, tmp_path):
    """--ddp-backend fully_sharded --eval-bleu on 2 ranks, beam searches of different lengths: all 6 validations run
    (the rank done first served the other's MoE calls with its gathered parameters, not its rows of the gates: the
    3rd validation of issue 30 died there), each with the validation loss, the MoE metrics and the BLEU of one process
    with the same global batch."""
    want = assert_validates_as_one_process(data_bin, tmp_path, 6, *DIFFERENT_LENGTHS)
    assert any(float(v["bleu"]) > 0 for v in want)


class _Block(nn.Module):
    """A layer of a model, FSDP's unit around an MoE layer (which the lockstep calls itself: no unit's hooks)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)[0]


class _Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(_Block(moe) for moe in layers)
        self.cfg = SimpleNamespace(min_params_to_wrap=0)  # (each block its own unit)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def served_while_gathered(rank, W, calls, keep_gathered=False):
    """Blocks of MoE layers (4 experts spread over the ranks), sharded (keep_gathered: --no-reshard-after-forward): a
    forward of the whole model on every rank, then, every unit gathered (fsdp.gathered, as for a beam search), each
    rank calls the blocks as calls[rank] says ((block, tokens), ...: a rank with fewer is done first and serves the
    others'). Every output is what one process holding every expert computes; afterwards each unit is cut again: every
    dense parameter this rank's rows, a DTensor, and the next forward is one process's."""
    from torch.distributed import group

    from fairseq_moe.hooks import fsdp
    from fairseq_moe_layer.experts import is_expert
    from fairseq_moe_layer.comm import expert_parallel
    from fairseq_moe_layer.lockstep import lockstep

    from tests.fairseq_moe_layer.test_lockstep import _layers

    full = _Stack(_layers(None, "topk"))
    model = fsdp.shard(_Stack(_layers(expert_parallel(4), "topk")), group.WORLD, torch.device("cpu"),
                       SimpleNamespace(no_reshard_after_forward=keep_gathered, fp32_reduce_scatter=False))
    dense = [name for name, p in model.named_parameters() if not is_expert(p)]
    assert dense and all(fsdp.is_dtensor(p) for name, p in model.named_parameters() if name in dense)

    def same(index, T, seed):
        x = torch.randn(T, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        got, want = (m(x) if index is None else m.layers[index](x) for m in (model, full))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    with torch.no_grad(), lockstep(model):
        same(None, 4 + rank, rank)  # (the loss's forward: the same calls on every rank)
        with fsdp.gathered(model):  # (the beam search)
            for n, (index, T) in enumerate(calls[rank]):
                same(index, T, 10 * rank + n)
    assert all(fsdp.is_dtensor(p) for name, p in model.named_parameters() if name in dense)
    with torch.no_grad():
        same(None, 3, 100 + rank)  # (and the next forward gathers them as ever)


@pytest.mark.slow
def test_a_rank_done_first_serves_the_others_with_its_units_gathered():
    from tests.fairseq_moe_layer.test_comm import spawn
    from tests.fairseq_moe_layer.test_lockstep import CALLS

    spawn(served_while_gathered, 2, CALLS)  # (rank 1: 2 calls of block 1; rank 0: 5 of blocks 0 and 1)
