"""Settings as data: each setting of the layer (config.MoEConfig) and of a routing policy (routing.Policy.options)
is one dataclass field made by setting(), whose metadata holds its fairseq flag, its help, its choices and its
range. From that one place come the fairseq flag (the glue's add_moe_args), the generic checks (check_setting,
run by MoEConfig.validate) and the table of the layer's flags in docs/flags.md (`python -m fairseq_moe_layer`;
tests/fairseq_moe_layer/test_config.py compares). The MoE criterion's and task's settings are fairseq dataclasses made with
the same setting() (fairseq reads their "help"; check_setting their range).
"""
import math
import operator
from dataclasses import MISSING, field, fields
from typing import Optional


def setting(default, help, flag=None, *, type=None, choices=None, ge=None, gt=None, le=None, lt=None, integer=None,
            note="", cli=True, metavar=None, negative=None):
    """A dataclass field with its flag's metadata.

    flag: what the user types (default: --moe-NAME from the field's name);
    type: the field's type (default: the default's; give it where the default is None); choices: a tuple, or a
    registry dict read when checked (so that a policy or gate registered later is a valid choice);
    ge/gt/le/lt: bounds (floats must also be finite); integer: whole numbers only (default: for int fields);
    note: said after the range in an error; cli=False: set by the glue from another flag (the sizes, fairseq's
    activation flags); negative: the flag that turns a default-on switch off.
    """
    kind = type or (bool if isinstance(default, bool) else default.__class__)
    meta = dict(flag=flag, help=help, type=kind, choices=choices, ge=ge, gt=gt, le=le, lt=lt,
                integer=kind is int if integer is None else integer, note=note, cli=cli, metavar=metavar,
                negative=negative)
    return field(default=default, metadata=meta) if default is not MISSING else field(metadata=meta)


def annotation(f):
    """The type to declare a setting() field with (Optional where its default is None)."""
    kind = f.metadata["type"]
    return Optional[kind] if f.default is None else kind


def settings(cls):
    """The fields of a dataclass that were made with setting()."""
    return [f for f in fields(cls) if "help" in f.metadata and "choices" in f.metadata]


def dest_of(f):
    """The argparse dest (and fairseq config key) of a setting's flag: --moe-top-k -> moe_top_k."""
    return flag_of(f)[2:].replace("-", "_")


def flag_of(f):
    """The flag of a setting: its own, or --moe-NAME (the criterion's and task's fields are named moe_...)."""
    name = f.name if f.name.startswith("moe_") else "moe_" + f.name
    return f.metadata["flag"] or "--" + name.replace("_", "-")


def check_setting(obj, f):
    """The reason the value of field f of obj is bad ("must be ..."), or None: type, choices and range from the
    field's metadata. None passes for a field whose default is None."""
    m, value = f.metadata, getattr(obj, f.name)
    if value is None and f.default is None:
        return None
    if m["choices"] is not None:
        return None if value in m["choices"] else f"must be one of {sorted(m['choices'])}"
    if m["type"] is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if m["type"] is str:
        return None if isinstance(value, str) else "must be a string"
    bounds = [(symbol, test, m[op]) for op, (symbol, test) in _BOUNDS.items() if m[op] is not None]
    what = " and ".join(f"{symbol} {bound}" for symbol, _, bound in bounds)
    what = f"must be {'an integer' if m['integer'] else 'a number'}{' ' + what if what else ''}" + \
        (f" {m['note']}" if m["note"] else "")
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        isinstance(value, int) or not m["integer"])
    return None if number and all(test(value, bound) for _, test, bound in bounds) else what


_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def first_bad(cls, obj):
    """(field, reason) of the first setting of dataclass cls whose value in obj (an instance of cls, or a
    config with the same names) fails its check, or None."""
    for f in settings(cls):
        why = check_setting(obj, f)
        if why:
            return f, why
    return None


def refusal(cls, obj):
    """The one-line error for the first bad setting of cls in obj ("--flag must be ..., got value"), or None
    (the criterion's and the task's checks; MoEConfig.validate also names the field)."""
    failed = first_bad(cls, obj)
    return None if failed is None else f"{flag_of(failed[0])} {failed[1]}, got {getattr(obj, failed[0].name)!r}"


def full_help(f):
    """A setting's help; for a choice among a registry whose entries have a help (the routing policies, the
    gates), with theirs, so that a new entry documents itself."""
    m, registry = f.metadata, f.metadata["choices"]
    entries = [f"{name}: {entry.help}" for name, entry in sorted(registry.items()) if getattr(entry, "help", "")] \
        if isinstance(registry, dict) else []
    return m["help"] + (f" ({'; '.join(entries)})" if entries else "")


def describe(f):
    """The default of a setting as docs/flags.md and --help say it."""
    value = f.default
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def flag_table(cls):
    """The Markdown table (docs/flags.md) of the flags of cls's settings (those the user sets as they are)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for f in settings(cls):
        m = f.metadata
        if not m["cli"]:
            continue
        flag = flag_of(f)
        if m["choices"] is not None:
            shown = f"`{flag} {{{','.join(sorted(m['choices']))}}}`"
        elif m["type"] is bool:
            shown = f"`{flag}`" + (f" / `{m['negative']}`" if m["negative"] else "")
        else:
            shown = f"`{flag} {m['metavar'] or f.name.upper()}`"
        rows.append(f"| {shown} | {describe(f)} | {full_help(f)} |")
    return "\n".join(rows) + "\n"
