"""The plugin's convert_namespace_to_omegaconf (hooks/compose.py) builds the config fairseq's own function builds.

The reference is fairseq's function itself (hydra's parse and compose), called on the same Namespace: every value,
with its type, equal; a form the plugin does not read exactly (a backslash, an interpolation, a nested list) goes to
fairseq's; a failure is fairseq's own; and the suite's check (FAIRSEQ_MOE_CHECK_COMPOSE=1) fails on a difference."""
import argparse

import pytest

import fairseq_moe

fairseq_moe.load_plugin()

from fairseq_moe import patches  # noqa: E402
from fairseq_moe.hooks import compose  # noqa: E402

from tests.fairseq_moe.helpers import USER_DIR, eval_lm_argv, lm_train_argv, train_argv  # noqa: E402

DATA = "/nonexistent/bin"  # (parsing reads no data)
ML = [DATA, "--user-dir", USER_DIR, "--task", "moe_translation_multi_simple_epoch", "--arch", "moe_transformer_tiny",
      "--lang-pairs", "en-de,de-en", "--langs", "en,de", "--encoder-langtok", "src", "--decoder-langtok",
      "--sampling-method", "temperature", "--sampling-temperature", "1.5", "--criterion",
      "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--cpu"]
TRAIN = {
    "translation": train_argv(DATA, "/tmp/x", "--moe-expert-count", "4", "--max-update", "3"),
    "options": train_argv(DATA, "/tmp/x's dir", "--eval-bleu", "--eval-bleu-args", '{"beam": 2, "max_len_b": 20}',
                          "--bf16", "--optimizer", "adafactor", "--lr", "0.1", "--clip-norm", "0.5",
                          "--moe-gate", "cosine", "--moe-top-k", "1", "--update-freq", "2", "--lr-scheduler",
                          "inverse_sqrt", "--warmup-updates", "10", "--keep-last-epochs", "2", "--zero-sharding", "os",
                          "--ddp-backend", "fully_sharded", "--moe-eval-capacity-token-fraction", "-1.0",
                          "--stop-min-lr", "1e-09", "--max-epoch", "0"),
    "dense": [{"moe_transformer_tiny": "transformer", "moe_translation": "translation",
               "moe_label_smoothed_cross_entropy": "label_smoothed_cross_entropy"}.get(x, x)
              for x in train_argv(DATA, "/tmp/x")],
    "language model": lm_train_argv(DATA, "/tmp/x", "--moe-expert-count", "2", "--sample-break-mode", "eos"),
    "multilingual": ML,
    "a backslash": train_argv(DATA, "/tmp/a\\b"),  # (fairseq's own reads it: this module does not)
    "an interpolation in a string": train_argv(DATA, "/tmp/run-${common.seed}"),
}


def parsed(kind, argv):
    from fairseq import options

    parser = {"train": options.get_training_parser, "generate": options.get_generation_parser,
              "interactive": options.get_interactive_generation_parser,
              "eval_lm": options.get_eval_lm_parser}[kind]()
    return options.parse_args_and_arch(parser, argv)


def fairseqs(args):
    return patches.original("fairseq.dataclass.utils", "convert_namespace_to_omegaconf")(args)


@pytest.mark.parametrize("kind, argv", [
    *(("train", argv) for argv in TRAIN.values()),
    ("generate", [DATA, "--user-dir", USER_DIR, "--path", "/tmp/x/checkpoint_last.pt", "--beam", "3", "--lenpen",
                  "0.6", "--batch-size", "2", "--remove-bpe", "--cpu", "--results-path", "/tmp/out",
                  "--model-overrides", "{'moe_eval_capacity_token_fraction': 0.5}"]),
    ("interactive", [DATA, "--user-dir", USER_DIR, "--path", "/tmp/a.pt:/tmp/b.pt", "--buffer-size", "4",
                     "--input", "-", "--sampling", "--sampling-topk", "5", "--cpu"]),
    ("eval_lm", eval_lm_argv(DATA, "/tmp/x.pt", "--context-window", "8", "--softmax-batch", "64")),
], ids=[*TRAIN, "generate", "interactive", "eval-lm"])
def test_the_config_is_fairseqs(kind, argv):
    args = parsed(kind, argv)
    want = compose.plain(fairseqs(args))
    assert compose.plain(compose.convert_namespace_to_omegaconf(args)) == want
    if "\\" in str(argv) or "-${" in str(argv):
        with pytest.raises(compose.Unsupported):
            compose.fast_convert(args)
    else:
        assert compose.plain(compose.fast_convert(args)) == want  # (its own path, not fairseq's)


def test_the_patch_is_what_fairseqs_tools_and_loaders_call():
    from fairseq import checkpoint_utils, trainer
    from fairseq.dataclass import utils
    from fairseq.models import fairseq_model

    for module in (utils, checkpoint_utils, trainer, fairseq_model):
        assert module.convert_namespace_to_omegaconf is compose.convert_namespace_to_omegaconf


@pytest.mark.parametrize("text, value", [
    ("null", None), ("''", ""), ("'a b/c.d'", "a b/c.d"), ("'x\\'s'", "x's"), ('"it\'s"', "it's"), ("3", 3),
    ("-2", -2), ("0.5", 0.5), ("1e-08", 1e-08), ("-inf", float("-inf")), ("True", True), ("false", False),
    ("translation", "translation"), ("None", "None"), ("'${optimization.lr}'", "${optimization.lr}"),
    ("[0.9, 0.98]", [0.9, 0.98]), ("[]", []), ("['en', 'de']", ["en", "de"]), ("[1]", [1]), ("0.5e3", 500.0),
])
def test_values_read_as_hydra_reads_them(text, value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydras = OverridesParser.create().parse_override(f"k={text}").value()
    assert compose.value_of(text) == value == hydras
    assert type(compose.value_of(text)) is type(hydras)


@pytest.mark.parametrize("text", ["'a\\b'", "'a\\\\'b'", "'a${x}'", "'${x}${y}'", "'${oc.env:HOME}'", "[[1, 2]]",
                                  "['a,b']", "Inf", "NaN", "00.5", "01e3", "{'a': 1}", "a b", "", "'a", "1_000"])
def test_other_forms_go_to_fairseqs(text):
    with pytest.raises(compose.Unsupported):
        compose.value_of(text)


def test_a_failure_is_fairseqs_own():
    args = parsed("train", TRAIN["translation"])
    args.max_tokens = [1, 2]  # (no parser lets this through: a program's own Namespace; hydra refuses it)
    with pytest.raises(Exception) as theirs:
        fairseqs(args)
    with pytest.raises(Exception) as ours:
        compose.convert_namespace_to_omegaconf(args)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_the_suites_check_fails_on_a_difference(monkeypatch):
    args = parsed("train", TRAIN["translation"])
    compose.convert_namespace_to_omegaconf(args)  # (passes while the two agree)
    monkeypatch.setenv(compose.CHECK_ENV, "1")
    compose.convert_namespace_to_omegaconf(args)
    real = compose.compose

    def off_by_one(overrides):
        cfg = real(overrides)
        cfg.common.seed += 1
        return cfg

    monkeypatch.setattr(compose, "compose", off_by_one)
    with pytest.raises(AssertionError, match=r"differs from fairseq's in \['common'\]"):
        compose.convert_namespace_to_omegaconf(args)


def test_a_namespace_of_no_dataclass_is_fairseqs_legacy_node():
    """A Namespace without a task or arch has no such nodes; the registries' None nodes stay None."""
    args = argparse.Namespace(**vars(parsed("train", TRAIN["translation"])))
    del args.arch
    assert compose.plain(compose.fast_convert(args)) == compose.plain(fairseqs(args))
