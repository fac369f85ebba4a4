"""--bf16 with the plugin loaded: bfloat16 on the CPU (and CUDA), XLA only with --tpu typed (hooks/bf16.py).

fairseq-train --cpu --bf16 trains an MoE model with bf16 weights, fp32 master weights and an fp32 router; the
run resumes; 2 ranks with spread experts are the 1-process run within bf16's rounding, with and without ZeRO; the
generators cast their models to bf16; a CUDA device without bf16 is one line naming the flag, a CPU without fast
bf16 one warning line. (bf16 is emulated on CPUs without AVX-512: every model here is tiny.)"""
import io
import os
import subprocess
import sys

import pytest
import torch

import fairseq_moe

fairseq_moe.load_plugin()

from fairseq_moe import patches  # noqa: E402
from fairseq_moe_layer import MoELayer  # noqa: E402
from fairseq_moe.checkpoints import sets as shards  # noqa: E402
from fairseq_moe.hooks import bf16  # noqa: E402

from tests import warm  # noqa: E402
from tests.fairseq_moe.helpers import (USER_DIR, build, error_lines, lm_train_argv,  # noqa: E402
                                       parse_train, run_eval_lm, run_generate, run_train, tail, train_argv,
                                       unwrapped)
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, finish, launch  # noqa: E402

TINY = ("--max-update", "3", "--moe-expert-count", "4", "--required-batch-size-multiple", "1")


@pytest.mark.parametrize("argv, typed", [
    (["data", "--bf16"], False), (["--tpu"], True), (["--tpu", "--bf16"], True), (["--tp"], False),
    (["--tpu-x"], False), (["--", "--tpu"], False), (["--tpuu"], False), (["--t"], False), ([], False), (None, False),
])
def test_typed_tpu_reads_the_command_line_as_fairseqs_parsers_do(argv, typed):
    """(fairseq's parsers take no abbreviations: allow_abbrev=False)"""
    assert bf16.typed_tpu(argv) is typed


@pytest.mark.parametrize("flags, tpu", [(("--bf16",), False), (("--memory-efficient-bf16",), False),
                                        (("--bf16", "--tpu"), True), (("--tpu",), True), ((), False)])
def test_bf16_runs_on_the_device_at_hand_and_xla_only_with_tpu(data_bin, tmp_path, flags, tpu):
    """Each parse after the plugin's import (settled_parse): --tpu only where it was typed; --memory-efficient-bf16
    is --bf16 too, as in fairseq."""
    args = parse_train(train_argv(data_bin, tmp_path, *flags))
    assert args.tpu is tpu and args.bf16 is any("bf16" in f for f in flags)


@pytest.mark.parametrize("tool", ["train", "generate", "interactive", "eval_lm", "validate"])
@pytest.mark.parametrize("typed", [False, True])
def test_the_tools_first_parse_is_settled_by_their_next_step(data_bin, tmp_path, monkeypatch, capsys, tool, typed):
    """fairseq imports the plugin during a tool's own parse_args_and_arch, which then sets --tpu for --bf16 as
    fairseq does: the tool's convert_namespace_to_omegaconf takes it back unless sys.argv has --tpu.
    fairseq-validate refuses --bf16 on the CPU or CUDA (one line): it would validate in fp32."""
    import importlib

    from fairseq import options

    argv = train_argv(data_bin, tmp_path, "--bf16", *(("--tpu",) if typed else ()))
    monkeypatch.setattr(sys, "argv", [f"fairseq-{tool}", *argv])
    args = patches.original("fairseq.options", "parse_args_and_arch")(options.get_training_parser(), argv)
    assert args.tpu  # (fairseq's own parse: --bf16 implies --tpu)
    convert = importlib.import_module(f"fairseq_cli.{tool}").convert_namespace_to_omegaconf
    if tool == "validate" and not typed:
        with pytest.raises(SystemExit) as exit_:
            convert(args)
        lines = error_lines(capsys.readouterr().err)
        assert exit_.value.code == 2 and len(lines) == 1
        assert lines[0].startswith("fairseq-validate: error: --bf16 is not supported by fairseq-validate")
        return
    cfg = convert(args)
    assert cfg.common.tpu is typed and cfg.common.bf16


def trainer_of(argv):
    """fairseq-train's Trainer for argv (built as fairseq_cli.train builds it), and the train set's batches."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    task, model, criterion, args = build(argv)
    trainer = Trainer(convert_namespace_to_omegaconf(args), task, model, criterion)
    task.load_dataset("train")
    batches = list(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False))
    return trainer, batches


def loss_on(trainer, sample):
    """The criterion's loss per target token on one batch, in eval mode (no dropout), without a step."""
    trainer.model.eval()
    with torch.no_grad():
        loss, sample_size, _ = trainer.criterion(trainer.model, trainer._prepare_sample(sample)[0])
    return float(loss) / sample_size


@pytest.mark.parametrize("flag, optimizer", [("--bf16", "FP16Optimizer"),
                                             ("--memory-efficient-bf16", "MemoryEfficientFP16Optimizer")])
def test_bf16_trains_with_bf16_weights_fp32_masters_and_an_fp32_router(data_bin, tmp_path, flag, optimizer):
    """The Trainer of fairseq-train --cpu --bf16: every weight bf16 (the routing bias and fp32 buffers aside), the
    optimizer fairseq's half-precision one without a loss scaler, its state (and with --bf16 its master weights)
    fp32; the router's logits fp32, its weight's gradient reaching the bf16 parameter; the loss finite and
    falling on the batch it trains on, and within bf16's rounding of the fp32 run's, not equal to it."""
    argv = train_argv(data_bin, tmp_path, flag, *TINY, "--dropout", "0")
    trainer, batches = trainer_of(argv)
    model = trainer.model
    assert type(trainer.optimizer).__name__ == optimizer and trainer.optimizer.scaler is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    gates = [m for n, m in model.named_modules() if n.endswith("moe.gate")]
    assert gates, "no MoE layer"
    logits, outputs = [], []
    for gate in gates:  # the logits, and whether they are the fp32 product of the bf16 input and weight
        gate.register_forward_hook(lambda m, i, out: logits.append((out.dtype, torch.equal(
            out, torch.nn.functional.linear(i[0].float(), m.weight.float())))))
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        layer.register_forward_hook(lambda m, i, out: outputs.append(
            (out[0].dtype, out[1].balance_loss.dtype, out[1].z_loss.dtype, out[1].entropy.dtype)))
    router = gates[0].weight.detach().clone()

    sample = batches[0]
    before = loss_on(trainer, sample)
    losses = [trainer.train_step([sample])["loss"] for _ in range(3)]
    after = loss_on(trainer, sample)
    assert logits and set(logits) == {(torch.float32, True)}  # the router in fp32, and from it the softmax, losses
    assert outputs and set(outputs) == {(torch.bfloat16, torch.float32, torch.float32, torch.float32)}
    assert not torch.equal(gates[0].weight, router)  # the router trained (its gradient reached the bf16 weight)
    assert all(torch.isfinite(torch.tensor(losses))) and after < before - 0.1
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(g.weight.grad is None or g.weight.grad.dtype == torch.bfloat16 for g in gates)
    state = trainer.optimizer.state_dict()["state"]
    assert state and {v.dtype for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()} == {
        torch.float32}
    if flag == "--bf16":  # fp32 master weights, that the bf16 ones are rounded from
        masters = trainer.optimizer.fp32_params
        masters = masters if isinstance(masters, list) else list(masters.values())
        assert masters and {m.dtype for m in masters} == {torch.float32}
        p0, m0 = trainer.optimizer.fp16_params[0], masters[0]
        assert torch.equal(p0, m0.to(torch.bfloat16)) and not torch.equal(m0, m0.to(torch.bfloat16).float())
        # the gate's weight gets its fp32 master's update: the router trained
        gate_param = gates[0].weight
        index = next(i for i, p in enumerate(trainer.optimizer.fp16_params) if p is gate_param)
        assert not torch.equal(masters[index].grad, torch.zeros_like(masters[index].grad))

    fp32, _ = trainer_of(train_argv(data_bin, tmp_path / "fp32", *TINY, "--dropout", "0"))
    fp32_losses = [fp32.train_step([sample])["loss"] for _ in range(3)]
    assert losses != fp32_losses
    assert losses == pytest.approx(fp32_losses, rel=0.02)


def test_bf16_resumes_from_its_checkpoint(data_bin, tmp_path):
    """2 + 2 updates of --bf16: the second run resumes (its history, its data position) and ends within bf16's
    rounding of 4 uninterrupted updates. (fairseq's FP16Optimizer does not save its fp32 master weights: the
    resumed run starts them from the saved bf16 weights, so the two runs are not bit for bit alike.)"""
    flags = ("--bf16", "--moe-expert-count", "4", "--required-batch-size-multiple", "1", "--dropout", "0")
    run_train(train_argv(data_bin, tmp_path / "a", *flags, "--max-update", "2"))
    run_train(train_argv(data_bin, tmp_path / "a", *flags, "--max-update", "4"))
    run_train(train_argv(data_bin, tmp_path / "b", *flags, "--max-update", "4"))
    a, b = (torch.load(tmp_path / d / "checkpoint_last.pt", weights_only=True) for d in "ab")
    assert [h["num_updates"] for h in a["optimizer_history"]] == [2, 4]
    assert [h["num_updates"] for h in b["optimizer_history"]] == [4]
    assert a["args"] is None and a["cfg"]["common"]["bf16"] and not a["cfg"]["common"]["tpu"]
    for name, value in b["model"].items():
        torch.testing.assert_close(a["model"][name], value, rtol=0.016, atol=0.016, msg=name)
    assert a["extra_state"]["val_loss"] == pytest.approx(b["extra_state"]["val_loss"], rel=0.01)


@pytest.mark.slow
def test_two_ranks_with_spread_experts_are_one_process_in_bf16(data_bin, tmp_path, capsys):
    """--bf16 on 2 gloo ranks with the experts spread (the bf16 rows travel in the all-to-all), with and without
    ZeRO: the 1-process run with --update-freq 2 within bf16's rounding; ZeRO's run is the plain one's bit for bit
    (the parameters and the fp32 state)."""
    argv = lambda name, *extra: train_argv(data_bin, tmp_path / name, "--bf16", *COMMON, *extra)  # noqa: E731
    runs = {name: launch(2, tmp_path / name, *argv(name, *extra))
            for name, extra in (("many", ()), ("zero", ("--zero-sharding", "os")))}
    run_train(argv("one", "--update-freq", "2"))
    outs = {name: finish(proc) for name, proc in runs.items()}
    one = torch.load(tmp_path / "one" / "checkpoint_last.pt", weights_only=True)
    many, zero = (shards.assemble(str(tmp_path / name / "checkpoint_last")) for name in ("many", "zero"))
    assert many["model"]["encoder.layers.1.fc1.moe.experts.w1"].shape[0] == 4
    for name, value in one["model"].items():  # (a bf16 ulp is 2^-7 of the value: 2 of them at 1.0)
        torch.testing.assert_close(many["model"][name], value, rtol=0.016, atol=0.016, msg=name)
        assert torch.equal(zero["model"][name], many["model"][name]), name
    assert many["extra_state"]["val_loss"] == pytest.approx(one["extra_state"]["val_loss"], rel=0.01)
    state, plain = zero["last_optimizer_state"]["state"], many["last_optimizer_state"]["state"]
    assert sorted(state) == sorted(plain)
    assert all(torch.equal(v, plain[i][key]) for i, s in state.items() for key, v in s.items() if torch.is_tensor(v))
    assert {v.dtype for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}
    # fairseq-generate --bf16 translates from the 2-rank set, on one process and on 2 ranks with the experts spread
    # (the bf16 rows in the all-to-all): the same hypotheses.
    generate = [data_bin, "--user-dir", USER_DIR, "--path", str(tmp_path / "many" / "checkpoint_last.pt"),
                "--task", "moe_translation", "--gen-subset", "test", "--beam", "2", "--cpu", "--bf16"]
    capsys.readouterr()
    assert "BLEU" in run_generate(generate).result_string()
    alone = sorted(line for line in capsys.readouterr().out.splitlines() if line.startswith("H-"))
    spread = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", "fairseq-generate",
                       *generate], capture_output=True, text=True, timeout=600,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert spread.returncode == 0, tail(spread.stderr)
    assert alone and sorted(line for line in spread.stdout.splitlines() if line.startswith("H-")) == alone
    # The CPU warning is one line of the job (rank 0's), where this CPU has no fast bf16.
    printed = outs["many"].stdout + outs["many"].stderr
    assert printed.count("--bf16 on this CPU") == (0 if bf16.cpu_has_fast_bf16() else 1), tail(printed)


def test_the_generators_cast_the_model_to_bf16(trained_checkpoint, data_bin, monkeypatch, capsys):
    """fairseq-generate --bf16 translates with a bf16 model (fairseq's generate casts for --fp16 only); without the
    flag the model stays fp32. The BLEU of the bf16 model is within 2 of the fp32 model's. fairseq-interactive
    --bf16 too."""
    from fairseq.models.fairseq_model import BaseFairseqModel

    seen = []
    prepare = BaseFairseqModel.prepare_for_inference_

    def spy(self, cfg):
        prepare(self, cfg)
        seen.append(next(self.parameters()).dtype)

    monkeypatch.setattr(BaseFairseqModel, "prepare_for_inference_", spy)
    argv = [data_bin, "--user-dir", USER_DIR, "--path", str(trained_checkpoint), "--task", "moe_translation",
            "--gen-subset", "test", "--beam", "2", "--cpu"]
    half = run_generate([*argv, "--bf16"])
    full = run_generate(argv)
    assert seen == [torch.bfloat16, torch.float32]
    assert half.score() == pytest.approx(full.score(), abs=2.0)

    # fairseq-interactive --bf16 (its input on stdin) translates with a bf16 model too.
    from fairseq import options
    from fairseq_cli import interactive

    seen.clear(), capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("a b c\nd e f\n"))
    args = options.parse_args_and_arch(options.get_interactive_generation_parser(), [
        data_bin, "--user-dir", USER_DIR, "--path", str(trained_checkpoint), "--task", "moe_translation",
        "--source-lang", "src", "--target-lang", "tgt", "--beam", "2", "--cpu", "--bf16"])
    unwrapped(interactive.main)(args)
    assert seen == [torch.bfloat16]
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("H-")]) == 2


def test_eval_lm_with_bf16_is_the_fp32_perplexity_within_rounding(lm_data_bin, tmp_path):
    """fairseq-eval-lm --bf16: a bf16 model (its perplexity near the fp32 model's, not equal)."""
    run_train(lm_train_argv(lm_data_bin, tmp_path, "--max-update", "2", "--moe-expert-count", "2"))
    path = tmp_path / "checkpoint_last.pt"
    full, half = (float(run_eval_lm(lm_data_bin, path, *flags)["perplexity"]) for flags in ((), ("--bf16",)))
    assert half != full and half == pytest.approx(full, rel=0.02)


def test_the_hub_interface_casts_with_bf16(trained_checkpoint, data_bin, tmp_path):
    """from_pretrained(..., bf16=True): a bf16 model that translates; without it an fp32 one, also from a checkpoint
    trained with --bf16 (as one trained with --fp16 loads in fp32 unless fp16=True)."""
    from fairseq.models.transformer import TransformerModel

    run_train(train_argv(data_bin, tmp_path, "--bf16", "--max-update", "1", "--moe-expert-count", "2",
                         "--required-batch-size-multiple", "1"))
    for path in (trained_checkpoint, tmp_path / "checkpoint_last.pt"):
        for kw in ({"bf16": True}, {}):
            hub = TransformerModel.from_pretrained(str(path.parent), path.name, data_name_or_path=data_bin,
                                                   user_dir=USER_DIR, cpu=True, **kw)
            assert next(hub.models[0].parameters()).dtype == (torch.bfloat16 if kw else torch.float32), (path, kw)
            assert isinstance(hub.translate("a b c"), str)


def test_cuda_without_bf16_is_one_line_naming_the_flag(data_bin, tmp_path, monkeypatch, capsys):
    """A CUDA device without native bf16: `PROG: error: --bf16 ...`, exit 2, at the parse (before any work)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bf16, "cuda_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    argv = train_argv(data_bin, tmp_path, "--bf16")
    argv.remove("--cpu")
    with pytest.raises(SystemExit) as exit_:
        parse_train(argv)
    lines = error_lines(capsys.readouterr().err)
    assert exit_.value.code == 2 and len(lines) == 1 and "--bf16" in lines[0] and "Tesla V100 has 7.0" in lines[0]
    # --cpu on the same machine: no CUDA check; --tpu: XLA's business
    parse_train(train_argv(data_bin, tmp_path, "--bf16"))
    parse_train([*argv, "--tpu"])


def test_the_trainer_checks_the_device_of_a_config_no_parse_saw(data_bin, tmp_path, monkeypatch):
    """fairseq-hydra-train's common.bf16 reaches no parse: the Trainer's construction checks the device (a FlagError
    naming --bf16, before fairseq's Trainer runs), and builds on a CPU."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from fairseq_moe.errors import FlagError

    task, model, criterion, args = build(train_argv(data_bin, tmp_path, "--bf16"))
    cfg = convert_namespace_to_omegaconf(args)
    cfg.common.cpu = False  # (as a config without --cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bf16, "cuda_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(FlagError, match=r"^--bf16 needs a CUDA device with bfloat16 support .* Tesla T4 has 7\.5"):
        Trainer(cfg, task, model, criterion)
    monkeypatch.undo()
    cfg.common.cpu = True
    assert next(Trainer(cfg, task, model, criterion).model.parameters()).dtype == torch.bfloat16


def test_a_cpu_without_fast_bf16_gets_one_warning(data_bin, tmp_path, monkeypatch, caplog):
    """A CPU without the instructions oneDNN runs bf16 with: one warning line per process, and the run goes on; a
    CPU with them, or a run without --bf16: none."""
    def warnings(fast, *flags):
        monkeypatch.setattr(bf16, "_warned", [])
        monkeypatch.setattr(bf16, "cpu_has_fast_bf16", lambda: fast)
        caplog.clear()
        for _ in range(2):
            assert parse_train(train_argv(data_bin, tmp_path, *flags)).tpu is False
        return [r.getMessage() for r in caplog.records if "--bf16 on this CPU" in r.getMessage()]

    assert len(warnings(False, "--bf16")) == 1
    assert warnings(True, "--bf16") == [] and warnings(False) == []


@pytest.mark.slow
def test_fairseq_train_cpu_bf16_from_the_command_line(data_bin, tmp_path):
    """The console script: fairseq imports the plugin during its own parse; the run trains on the CPU in bf16."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "fairseq-train"),
           *train_argv(data_bin, tmp_path, "--bf16", "--max-update", "2", "--required-batch-size-multiple", "1")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, tail(out.stderr)
    assert "xla" not in out.stderr.lower() and "num_updates 2" in out.stderr + out.stdout
    st = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert st["cfg"]["common"]["bf16"] and not st["cfg"]["common"]["tpu"]
    assert st["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"


@pytest.mark.slow
def test_fully_sharded_with_memory_efficient_bf16_is_legacy_ddp_within_bf16_rounding(data_bin, tmp_path):
    """--ddp-backend fully_sharded (torch's FSDP, the experts spread) with --memory-efficient-bf16 on 2 ranks: the
    parameters after 3 updates are legacy_ddp's within 1e-2 relative per tensor (the reduce-scatter's sums round
    otherwise than the all-reduce's, in bf16), the Adam state fp32; --bf16 alone (an fp32 master copy of sharded
    parameters) is refused, one line."""
    from tests.fairseq_moe.hooks.test_optim import CLIP, full

    adam = [x for x in COMMON if x not in ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9")]
    fsdp = ("--ddp-backend", "fully_sharded", "--min-params-to-wrap", "0", "--fp32-reduce-scatter")
    argv = lambda name, *extra: train_argv(data_bin, tmp_path / name, *adam, "--optimizer", "adam",  # noqa: E731
                                           "--lr", "0.003", *CLIP, "--max-update", "3", *extra)
    runs = {name: launch(2, tmp_path / name, *argv(name, "--memory-efficient-bf16", *extra))
            for name, extra in (("legacy", ()), ("fsdp", fsdp))}
    for proc in runs.values():
        finish(proc)
    a, b = (full(tmp_path / name / "checkpoint_last") for name in ("legacy", "fsdp"))
    assert b["cfg"]["common"]["memory_efficient_bf16"] and not b["cfg"]["common"]["tpu"]
    assert {v.dtype for e in b["last_optimizer_state"]["state"].values() for v in e.values()
            if torch.is_tensor(v) and v.dim()} == {torch.float32}
    errors = {k: ((b["model"][k].float() - v.float()).norm() / v.float().norm()).item()
              for k, v in a["model"].items() if not k.endswith("k_proj.bias")}
    assert max(errors.values()) < 1e-2, sorted(errors.items(), key=lambda kv: kv[1])[-3:]

    bad = launch(2, tmp_path / "bf16", *argv("bf16", "--bf16", *fsdp))
    out = subprocess.CompletedProcess(bad.args, None, *bad.communicate(timeout=600))
    lines = error_lines(out.stderr)
    assert bad.returncode != 0 and len(lines) == 1, tail(out.stderr)
    assert "--bf16 cannot be used with --ddp-backend fully_sharded" in lines[0]
    assert "add --memory-efficient-bf16" in lines[0]
    assert not list((tmp_path / "bf16").glob("*.pt"))
