"""Every refusal of refusals.py, with its example: the example is refused with a message that names the
refusal's flags, and without the trigger (one process, or the flag at its default) it is not."""
import argparse

import pytest

from fairseq_moe import refusals
from fairseq_moe.errors import FlagError


def context(example):
    ex = {key: value() if callable(value) else value for key, value in example.items()}
    return refusals.Context(flags=argparse.Namespace(**ex.pop("flags", {})), **ex)


@pytest.mark.parametrize("refusal", refusals.REFUSALS, ids=lambda r: r.setup)
def test_every_refusal(refusal):
    assert refusal.stage in ("build", "trainer") and refusal.why and refusal.flags
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
