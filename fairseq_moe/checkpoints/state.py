"""Rewriting a model's state, what the commands that make a checkpoint share (upcycle, convert_moe_branch,
prune, export_hf): the sections of its config, the MoE checkpoint written from new weights, the layer
pattern of every N-th layer. No fairseq import.
"""
import argparse
from argparse import Namespace

from ..errors import CheckpointError
from . import sets as shards

# dense task / criterion -> the MoE one (the MoE ones map to themselves)
TASKS = {"translation": "moe_translation", "language_modeling": "moe_language_modeling",
         "translation_multi_simple_epoch": "moe_translation_multi_simple_epoch"}
TASKS.update({v: v for v in TASKS.values()})
CRITERIONS = {"cross_entropy": "moe_cross_entropy", "label_smoothed_cross_entropy": "moe_label_smoothed_cross_entropy"}
CRITERIONS.update({v: v for v in CRITERIONS.values()})


def section(cfg, name, path):
    """cfg[name] of a checkpoint's config as a dict (fairseq 0.12 keeps argparse models' as a Namespace)."""
    value = cfg.get(name) if isinstance(cfg, dict) else None
    if isinstance(value, Namespace):
        return vars(value).copy()
    if isinstance(value, dict):
        return dict(value)
    raise CheckpointError(f"{path}: its config has no {name} section: not a checkpoint of fairseq >= 0.10")


def task_config(state, path):
    """The task's settings saved in the checkpoint state read from path, as a dict ({} when there are none)."""
    cfg = state.get("cfg") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not isinstance(cfg or {}, dict):
        raise CheckpointError(f"{path}: not a fairseq checkpoint (no dict with a cfg)")
    task = (cfg or {}).get("task") or state.get("args")  # (args: a checkpoint of fairseq < 0.10)
    if isinstance(task, argparse.Namespace):
        return vars(task)
    return dict(task) if isinstance(task, dict) else {}


def moe_checkpoint(state, weights, model_cfg, path, made_by):
    """A fairseq checkpoint state (read from path) rewritten as one of our MoE models: these weights, this model
    config (a Namespace: MoE models are argparse models in fairseq 0.12), the task and criterion mapped to the
    MoE ones (a task without one is refused, naming it), no optimizer state, and extra_state[shards.MADE_BY] =
    made_by ({"what": how it was made, ...}: loading it refuses to resume as if it had an optimizer state)."""
    cfg = dict(state["cfg"], model=Namespace(**model_cfg))
    task = section(cfg, "task", path)
    if task.get("_name") not in TASKS:
        dense = sorted(set(TASKS) - set(TASKS.values()))
        raise CheckpointError(f"{path}: cfg.task._name = {task.get('_name')!r}; fairseq-moe's MoE tasks are "
                              f"{', '.join(TASKS[name] for name in dense)} (from {', '.join(dense)})")
    task["_name"] = TASKS[task["_name"]]
    if "task" in task:  # (an argparse task's Namespace names itself twice)
        task["task"] = task["_name"]
    cfg["task"] = Namespace(**task) if isinstance(cfg["task"], Namespace) else task
    criterion = cfg.get("criterion")
    if isinstance(criterion, dict) and criterion.get("_name") in CRITERIONS:
        cfg["criterion"] = dict(criterion, _name=CRITERIONS[criterion["_name"]])
    extra = {k: v for k, v in shards.without_ema(state.get("extra_state")).items()  # (a dense EMA fits no MoE model)
             if k != "moe_checkpoint"}
    extra[shards.MADE_BY] = made_by
    out = {k: v for k, v in state.items() if k != "last_optimizer_state"}  # (--finetune-from-model: a fresh one)
    out.update(model=weights, cfg=cfg, extra_state=extra, args=None)  # (args would override cfg in fairseq)
    return out


def every_nth(indices, count):
    """N when `indices` (0-based, sorted) are exactly every N-th of `count` layers (layers N-1, 2N-1, ...), 0 when
    there are none, None otherwise."""
    if not indices:
        return 0
    freq = indices[0] + 1
    return freq if indices == [i for i in range(count) if (i + 1) % freq == 0] else None
