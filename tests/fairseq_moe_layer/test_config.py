"""MoEConfig.validate: every bad value raises ValueError naming the fairseq flag the user typed,
both from validate() and from MoELayer(cfg); good values pass and validate() returns the config."""
import dataclasses
import math
import re

import pytest

from fairseq_moe_layer import MoEConfig, MoELayer

GOOD = dict(model_dim=8, ffn_dim=16, num_experts=4, top_k=2)

BAD = [  # (overrides, flag the message must name)
    (dict(top_k=5), "--moe-top-k"),  # k > E
    (dict(top_k=0), "--moe-top-k"),
    (dict(top_k=-1), "--moe-top-k"),
    (dict(top_k=1.5), "--moe-top-k"),
    (dict(num_experts=0, top_k=1), "--moe-expert-count"),
    (dict(num_experts=True, top_k=1), "--moe-expert-count"),  # a bool is not a count
    (dict(model_dim=0), "--encoder-embed-dim/--decoder-embed-dim"),
    (dict(ffn_dim=0), "--moe-expert-ffn-dim"),
    (dict(capacity_factor=-0.5), "--moe-capacity-factor"),
    (dict(capacity_factor=math.nan), "--moe-capacity-factor"),
    (dict(capacity_factor=math.inf), "--moe-capacity-factor"),
    (dict(eval_capacity_token_fraction=1.5), "--moe-eval-capacity-token-fraction"),
    (dict(eval_capacity_token_fraction=math.nan), "--moe-eval-capacity-token-fraction"),
    (dict(gate="switch-transformer-9000"), "--moe-gate"),
    (dict(activation="tanh"), "--activation-fn"),
    (dict(activation_dropout=-0.1), "--activation-dropout"),
    (dict(activation_dropout=1.0), "--activation-dropout"),
    (dict(routing="hash-of-the-moon"), "--moe-routing"),
    (dict(routing="expert_choice", capacity_factor=0.0), "--moe-capacity-factor"),  # no dropless form
    (dict(gate_noise="pink"), "--moe-gate-noise"),
    (dict(gate_noise_scale=-0.1), "--moe-gate-noise-scale"),
    (dict(gate_noise="jitter", gate_noise_scale=1.0), "--moe-gate-noise-scale"),
    (dict(gate_noise_scale=math.nan), "--moe-gate-noise-scale"),
    (dict(eval_top_k=0), "--moe-eval-top-k"),
    (dict(eval_top_k=5), "--moe-eval-top-k"),  # > E
    (dict(routing="hash", top_k=2), "--moe-top-k (top_k) must be 1 with --moe-routing hash"),
    (dict(routing="hash", top_k=1, eval_top_k=2), "--moe-eval-top-k (eval_top_k) must be 1 with --moe-routing hash"),
    (dict(expert_kind="geglu"), "--moe-expert-kind"),
]


@pytest.mark.parametrize("overrides,flag", BAD, ids=[str(o) for o, _ in BAD])
def test_bad_value_names_its_flag(overrides, flag):
    cfg = MoEConfig(**{**GOOD, **overrides})
    with pytest.raises(ValueError, match=re.escape(flag)):
        cfg.validate()
    with pytest.raises(ValueError, match=re.escape(flag)):
        MoELayer(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(top_k=4),  # k == E
        dict(num_experts=1, top_k=1),
        dict(capacity_factor=0.0),  # dropless
        dict(eval_capacity_token_fraction=-1.0),  # as training
        dict(eval_capacity_token_fraction=0.0),
        dict(eval_capacity_token_fraction=1.0),
        dict(gate="cosine", activation="silu", activation_dropout=0.0),
        dict(expert_kind="swiglu", shared_experts=1, activation_dropout=0.1),
        dict(activation="gelu", activation_dropout=0.9),
        dict(routing="expert_choice", capacity_factor=1.5),
        dict(routing="dense", capacity_factor=0.0),
        dict(gate_noise="gaussian", gate_noise_scale=2.0),
        dict(gate_noise="jitter", gate_noise_scale=0.1, eval_top_k=4),
    ],
)
def test_good_values_pass(overrides):
    cfg = MoEConfig(**{**GOOD, **overrides})
    assert cfg.validate() is cfg
    assert cfg.to_dict() == {**MoEConfig(**GOOD).to_dict(), **overrides}


def test_the_docs_flag_table_is_the_one_the_settings_make():
    """docs/flags.md's table of the layer's flags is what options.flag_table makes from the settings (a new
    setting or policy shows up there, or this fails saying how to make the table to paste)."""
    from pathlib import Path

    from fairseq_moe_layer.options import flag_table

    doc = (Path(__file__).parents[2] / "docs" / "flags.md").read_text()
    start = doc.index("\n", doc.index("<!-- layer flags: made by")) + 1
    assert doc[start:doc.index("<!-- end of the layer flags -->")] == flag_table(MoEConfig), \
        "regenerate the table of docs/flags.md: paste the output of python -m fairseq_moe_layer " \
        "between its <!-- layer flags --> and <!-- end of the layer flags --> lines"


def test_every_setting_has_a_flag_help_and_a_check():
    """A field of MoEConfig is a setting (options.setting): it has its flag, its help, and a value of the
    wrong kind is refused naming that flag."""
    from dataclasses import fields

    from fairseq_moe_layer.options import flag_of, settings

    assert [f.name for f in settings(MoEConfig)] == [f.name for f in fields(MoEConfig)]
    for f in fields(MoEConfig):
        assert f.metadata["help"] and flag_of(f).startswith("--"), f.name
        wrong = object()  # of no type a setting takes
        with pytest.raises(ValueError, match=re.escape(flag_of(f))):
            MoEConfig(**{**GOOD, f.name: wrong}).validate()


def test_capacity_rounds_once_or_per_choice():
    """9 tokens, 4 experts, top-2, CF 1: ceil(2 * 9 / 4) = 5 (GShard, Tutel); 2 * ceil(9 / 4) = 6 (fairseq's moe
    branch, NLLB-MoE); also at evaluation with a fraction < 0 (the training capacity), not with one > 0."""
    cfg = MoEConfig(model_dim=4, ffn_dim=4, num_experts=4, top_k=2, eval_capacity_token_fraction=-1)
    per_choice = dataclasses.replace(cfg, capacity_rounding="per_choice")
    assert [cfg.capacity(9, training) for training in (True, False)] == [5, 5]
    assert [per_choice.capacity(9, training) for training in (True, False)] == [6, 6]
    assert dataclasses.replace(per_choice, top_k=1).capacity(9, True) == 3
    assert dataclasses.replace(per_choice, eval_capacity_token_fraction=0.5).capacity(9, False) == 5
    with pytest.raises(ValueError, match=r"--moe-capacity-rounding \(capacity_rounding\) must be one of"):
        dataclasses.replace(cfg, capacity_rounding="up").validate()
