"""Every refusal of refusals.py, with its example: the example is refused with a message that names the
refusal's flags, and without the trigger (one process, or the flag at its default) it is not."""
import argparse
import os

import pytest

from fairseq_moe import refusals
from fairseq_moe.errors import FlagError


def context(example):
    ex = {key: value() if callable(value) else value for key, value in example.items()}
    return refusals.Context(flags=argparse.Namespace(**ex.pop("flags", {})), **ex)


@pytest.mark.parametrize("refusal", refusals.REFUSALS, ids=lambda r: r.setup)
def test_every_refusal(refusal):
    assert refusal.stage in refusals.STAGES and refusal.why and refusal.flags
    with pytest.raises(FlagError) as err:
        refusals.check(refusal.stage, context(refusal.example))
    assert str(err.value) == refusal.text(context(refusal.example))
    assert any(flag in str(err.value) for flag in refusal.flags)
    # The same flags with nothing else: refused only where the set-up needs the experts spread.
    quiet = dict(refusal.example, spread=False)
    if refusal.example.get("spread"):
        refusals.check(refusal.stage, context(quiet))
    refusals.check(refusal.stage, refusals.Context(flags=argparse.Namespace()))  # defaults: nothing refused


@pytest.mark.parametrize("routing", ["expert_choice", "dense", "hash", "soft"])
def test_neg_log_refused_for_every_routing_without_balance_loss(routing):
    criterion = argparse.Namespace(moe_cfg=argparse.Namespace(moe_gate_loss_transform="neg_log"))
    with pytest.raises(FlagError, match="--moe-gate-loss-transform neg_log"):
        refusals.check("trainer", refusals.Context(flags=argparse.Namespace(), criterion=criterion,
                                                   model=refusals._model_routed_by(routing)))


def test_start_refusals_are_checked_again_at_the_trainer():
    """A run whose start the plugin did not see (ranks fairseq spawned itself) meets them when its Trainer is built."""
    example = context({"spread": True, "flags": {"write_checkpoints_asynchronously": True}})
    for stage in ("start", "trainer"):
        with pytest.raises(FlagError, match="--write-checkpoints-asynchronously"):
            refusals.check(stage, example)
    refusals.check("build", example)


def _torchrun_rank_0(monkeypatch, world="2"):
    """This process as rank 0 of `world` torchrun ranks on CPU (no rank 1 is started: nothing may reach a
    collective), with iopath unimportable (setup.py does not install it; fairseq's main returns when it is missing)."""
    import sys

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", WORLD_SIZE=world, RANK="0").items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setitem(sys.modules, "iopath", None)


@pytest.mark.parametrize("more", [(), ("--distributed-world-size", "2")])
def test_asynchronous_writes_with_spread_experts_are_refused_before_fairseqs_main(monkeypatch, tmp_path, capsys, more):
    """fairseq-train --write-checkpoints-asynchronously on 2 ranks of an MoE model: refused at the ranks' start,
    named, exit code 2, before fairseq's main (which, without iopath, logs an ImportError and returns 0 having
    trained nothing), before any process group, and whether iopath is there or not (here it cannot be imported)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train

    from tests.fairseq_moe.helpers import parse_train, train_argv

    _torchrun_rank_0(monkeypatch)
    reached = []
    monkeypatch.setattr(distributed_utils, "distributed_init", lambda cfg: reached.append("distributed_init") or 0)
    monkeypatch.setattr(train, "main", lambda cfg, **kwargs: reached.append("main"))
    cfg = convert_namespace_to_omegaconf(parse_train(train_argv(
        str(tmp_path / "data"), str(tmp_path / "save"), "--write-checkpoints-asynchronously",
        "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp", *more)))
    with pytest.raises(SystemExit) as code:
        distributed_utils.call_main(cfg, train.main)  # (the plugin's: one line, exit code 2)
    assert code.value.code == 2 and reached == []
    assert "error: --write-checkpoints-asynchronously is not supported with experts spread over ranks" in \
        capsys.readouterr().err
    # The hook around each rank's start too (a job whose init method was given: no infer_init_method).
    from fairseq_moe.hooks import compat

    with pytest.raises(FlagError, match="--write-checkpoints-asynchronously"):
        compat.leave_together(lambda *args: reached.append("distributed_main"))(0, train.main, cfg, {})
    assert reached == []


def test_asynchronous_writes_on_one_process_are_fairseqs(monkeypatch, tmp_path):
    """One process (nothing spread) is not refused: fairseq's own handling of the flag is left as it is."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    from tests.fairseq_moe.helpers import parse_train, train_argv

    _torchrun_rank_0(monkeypatch, world="1")
    cfg = convert_namespace_to_omegaconf(parse_train(train_argv(str(tmp_path / "data"), str(tmp_path / "save"),
                                                                "--write-checkpoints-asynchronously")))
    ran = []
    distributed_utils.call_main(cfg, lambda cfg, **kw: ran.append(cfg.checkpoint.write_checkpoints_asynchronously))
    assert ran == [True]
