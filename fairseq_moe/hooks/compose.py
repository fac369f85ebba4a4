"""fairseq's convert_namespace_to_omegaconf with the same result, without hydra's parse and compose: about half a
second of CPU less in every fairseq command and checkpoint load that calls it (benchmarks/bench_compose.py).

fairseq turns a parsed command line into its config by writing about 270 `key=value` strings (override_module_args)
and handing them to hydra, which parses each with its ANTLR grammar, builds a defaults tree and composes the config
from its ConfigStore, with deep copies at every step (0.68 s of CPU a call, against 0.135 s here, in
benchmarks/README.md). Here the same strings make the same config: each value read back for the forms
fairseq writes (null, a quoted string, a number, a bool, a word, a flat list of those), the groups (task=, model=,
criterion=, ...) merged from the same ConfigStore nodes in the order of fairseq's config.yaml defaults list, after
its primary schema (FairseqConfig), then every value set with OmegaConf.update in struct mode, as hydra's
_apply_overrides_to_config does. Anything else - a form fairseq does not write (a string with a backslash or an
interpolation), a group that is not in the store, any error on the way - goes to fairseq's own function, which
composes it or fails with hydra's own message, as without the plugin.

tests/fairseq_moe/hooks/test_compose.py compares the two on the suite's kinds of command line; with
FAIRSEQ_MOE_CHECK_COMPOSE=1 in the environment every call computes both and raises where they differ (the suite's
check: docs/architecture.md).
"""
import os
import re

from omegaconf import OmegaConf

CHECK_ENV = "FAIRSEQ_MOE_CHECK_COMPOSE"
# fairseq/config/config.yaml's defaults list (after _self_), with its two defaults that are not null
GROUPS = ("task", "model", "criterion", "optimizer", "lr_scheduler", "bpe", "tokenizer", "scoring", "generation",
          "common_eval", "eval_lm")
DEFAULT_CHOICES = {"criterion": "cross_entropy", "lr_scheduler": "fixed"}

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_INT = re.compile(r"[+-]?(0|[1-9][0-9]*)\Z")
_DIGITS = r"(0|[1-9][0-9]*)"  # (hydra's: no leading zero, else a word)
_FLOAT = re.compile(rf"[+-]?(({_DIGITS}\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|{_DIGITS}[eE][+-]?[0-9]+|inf|nan)\Z")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*\Z")
_KEYWORDS = ("true", "false", "null", "inf", "nan")
_INTERPOLATION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\}\Z")


class Unsupported(Exception):
    """Not a form this module reads exactly as hydra does: fairseq's own function takes the call."""


def _scalar(text):
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    low = text.lower()
    if low in ("true", "false"):  # (hydra's booleans are case-blind: fairseq writes Python's True, False)
        return low == "true"
    if low == "null":
        return None
    if _WORD.match(text) and low not in _KEYWORDS:
        return text
    raise Unsupported(text)


def _quoted(text):
    """'abc' as fairseq writes a string (each ' written \\'), or as Python's repr writes one in a list: of a string
    without a backslash of its own, and with no interpolation but a whole one (hydra resolves interpolations in quoted
    strings)."""
    quote, inner = text[:1], text[1:-1]
    pieces = inner.split("\\" + quote) if quote == "'" else [inner]
    if len(text) < 2 or text[-1] != quote or any("\\" in p or quote in p for p in pieces):
        raise Unsupported(text)
    if "${" in inner and not _INTERPOLATION.match(inner):  # (one whole ${a.b}, which fairseq writes for a default
        raise Unsupported(text)                            # such as generation's ${optimization.lr}: kept as such)
    return quote.join(pieces)


def value_of(text):
    """The value hydra's override grammar reads from text, for the forms fairseq writes; else Unsupported."""
    if not text:
        raise Unsupported(text)
    if text[0] in "'\"":
        return _quoted(text)
    if text[0] == "[":
        body = text[1:-1].strip() if text[-1] == "]" else "["  # (a list: flat, of scalars and quoted strings)
        if not body:
            return []
        items = [item.strip() for item in body.split(",")]
        return [_quoted(item) if item[:1] in "'\"" else _scalar(item) for item in items]
    return _scalar(text)


def _config_dir():
    """fairseq's config folder (fairseq/config: config.yaml, and yaml groups hydra reads before its ConfigStore)."""
    import fairseq

    return os.path.join(os.path.dirname(fairseq.__file__), "config")


def compose(overrides):
    """hydra's compose("config", overrides=overrides, strict=False) of fairseq's config, for fairseq's overrides."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    choices, values = dict(DEFAULT_CHOICES), []
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not _KEY.match(key):
            raise Unsupported(override)
        if "." in key:
            values.append((key, value_of(text)))
        elif key in GROUPS:
            choices[key] = value_of(text)
        else:
            raise Unsupported(override)
    if "config.yaml" not in repo:
        raise Unsupported("no primary schema")
    cfg = OmegaConf.create()
    cfg.merge_with(repo["config.yaml"].node)
    for group in GROUPS:
        name = choices.get(group)
        if name is None:
            continue
        node = repo.get(group, {}).get(f"{name}.yaml") if isinstance(name, str) else None
        # (hydra would read a yaml file of that name before the store's node, and honour a package or a defaults list)
        if node is None or node.package is not None or (OmegaConf.is_dict(node.node) and "defaults" in node.node) \
                or os.path.exists(os.path.join(_config_dir(), group, f"{name}.yaml")):
            raise Unsupported(f"{group}={name}")
        under = OmegaConf.create()
        OmegaConf.update(under, group, node.node, merge=False)
        cfg.merge_with(under)
    OmegaConf.set_struct(cfg, True)
    for key, value in values:
        OmegaConf.update(cfg, key, value, merge=True)
    OmegaConf.set_struct(cfg, False)
    return cfg


def _legacy_namespaces(cfg, args):
    """fairseq's own last step: a registry's node that is still None takes the whole Namespace (a component of no
    dataclass), with its legacy defaults."""
    from argparse import Namespace

    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.dataclass.utils import _set_legacy_defaults, omegaconf_no_object_check
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.optim import OPTIMIZER_REGISTRY
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    with omegaconf_no_object_check():
        for key, name, registry in (("task", "task", TASK_REGISTRY), ("model", "arch", ARCH_MODEL_REGISTRY),
                                    ("optimizer", "optimizer", OPTIMIZER_REGISTRY),
                                    ("lr_scheduler", "lr_scheduler", LR_SCHEDULER_REGISTRY),
                                    ("criterion", "criterion", CRITERION_REGISTRY)):
            if cfg[key] is None and getattr(args, name, None):
                cfg[key] = Namespace(**vars(args))
                _set_legacy_defaults(cfg[key], registry[getattr(args, name)])
                cfg[key]._name = getattr(args, name)


def fast_convert(args):
    """The config fairseq's convert_namespace_to_omegaconf(args) returns; Unsupported where it cannot say."""
    from fairseq.dataclass.utils import override_module_args

    try:
        overrides, deletes = override_module_args(args)
        composed = compose(overrides)
        for key in deletes:
            composed[key] = None
        cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=True, enum_to_str=True))
        _legacy_namespaces(cfg, args)
    except Unsupported:
        raise
    except Exception as err:  # (fairseq's own function then fails with hydra's message, as without the plugin)
        raise Unsupported(repr(err)) from err
    OmegaConf.set_struct(cfg, True)
    return cfg


def plain(cfg):
    """A config as nested Python values, each with its type (1 is not 1.0, nan is nan), each dict (a Namespace's too) a
    list of (key, value) in its order."""
    from argparse import Namespace

    def typed(x):
        if isinstance(x, Namespace):
            return ("Namespace", typed(vars(x)))
        if isinstance(x, dict):  # (as a list: the keys' order is compared too)
            return ("dict", [(k, typed(v)) for k, v in x.items()])
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, [typed(v) for v in x])
        return (type(x).__name__, repr(x))

    return typed(OmegaConf.to_container(cfg))[1]


def convert_namespace_to_omegaconf(args):
    """fairseq.dataclass.utils.convert_namespace_to_omegaconf's replacement (patches.py)."""
    from fairseq.dataclass import utils

    from .. import patches

    try:
        fairseq_convert = patches.original("fairseq.dataclass.utils", "convert_namespace_to_omegaconf")
    except KeyError:  # (not installed: fairseq's is the module's own)
        fairseq_convert = utils.convert_namespace_to_omegaconf
        if fairseq_convert is convert_namespace_to_omegaconf:
            raise RuntimeError("fairseq_moe.hooks.compose is in fairseq.dataclass.utils without patches.apply()")
    try:
        cfg = fast_convert(args)
    except Unsupported:
        return fairseq_convert(args)
    if os.environ.get(CHECK_ENV):
        want, got = plain(fairseq_convert(args)), plain(cfg)
        if want != got:
            want, got = dict(want), dict(got)
            differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k)) or ["(the keys' order)"]
            raise AssertionError(f"{CHECK_ENV}: fairseq-moe's config differs from fairseq's in {differ}: "
                                 f"{[(got.get(k), want.get(k)) for k in differ[:1]]}")
    return cfg
