"""fairseq checkpoints of MoE models: safe loading, and expert-parallel saves that lose nothing.

Loading: weights_only=True always passed, config strings checked (safe_load.py), names resolved by fixed
rules, a damaged set an error naming its file (a resume takes the newest complete set instead, and says
so). Saving with the experts spread: NAME-rank-R.pt per rank + NAME-shared.pt (checkpoints/sets.py),
committed as a whole (commit.py), old sets retired only after the commit, a stopped save's leftovers
recovered.
The hooks below are installed by patches.py (each entry says why); their per-Trainer state is a RunState.
"""
import argparse
import contextlib
import functools
import importlib
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import torch.distributed as dist

from fairseq_moe_layer import MoELayer, malloc
from fairseq_moe_layer.comm import local_experts

from . import bf16
from .. import patches, refusals
from ..checkpoints import commit, safe_load
from ..checkpoints import sets as shards
from ..checkpoints.fits import check_expert_layout, check_fits
from ..errors import CheckpointError, FlagError, MissingCheckpointError, SaveError
from . import fsdp, optim

logger = logging.getLogger(__name__)


def expert_params(model, spread_only=False):
    """{state-dict name: (first expert, local experts, E)} of the expert tensors (only the spread ones)."""
    from fairseq_moe_layer import MoELayer

    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, MoELayer) and (layer.ep is not None or not spread_only):
            ex = layer.experts
            out.update({f"{name}.experts.{p}": (ex.first_expert, ex.num_experts, ex.total_experts)
                        for p, _ in ex.named_parameters()})  # (w1, b1, w2, b2; swiglu: w1, w2)
    return out


def _optimizer_index(trainer, names):
    """Where each named parameter's state sits in the optimizer's state dict (fairseq's param order)."""
    params = chain(trainer.get_model().named_parameters(), trainer.get_criterion().named_parameters())
    order = [n for n, p in params if p.requires_grad]
    return {n: i for i, n in enumerate(order) if n in names}


@contextlib.contextmanager
def overridden(cfg, key, value):
    """cfg.key = value for the duration of the block: a value of the run's own config, for one call of
    fairseq's (code objects are changed only through patches.py)."""
    old, cfg[key] = cfg[key], value
    try:
        yield
    finally:
        cfg[key] = old


def _atomic_copy(src, dst, overwrite):
    if os.path.exists(dst) and not overwrite:
        return False
    try:
        commit.copy_synced(src, dst + ".tmp")  # (a left-over, or a link, there is removed: never written through)
    except BaseException:
        commit.remove_quietly(dst + ".tmp")
        raise
    os.replace(dst + ".tmp", dst)
    return True


def persistent_save(obj, filename, async_write=False, replaced=None):
    """fairseq's torch_persistent_save during a save of an MoE model on one process: the file written whole
    as NAME.tmp, flushed, then renamed (fairseq's atomic save), without fairseq's three tries and logged
    traceback; a failure to write is an OSError naming the file (save_checkpoint makes it a SaveError).
    replaced: a list the name is added to once it is replaced."""
    if async_write:  # (iopath's asynchronous writer: fairseq's own)
        return patches.original(_CKPT, "torch_persistent_save")(obj, filename, async_write=True)
    try:
        commit.write_synced(obj, filename + ".tmp")
    except BaseException:
        commit.remove_quietly(filename + ".tmp")
        raise
    os.replace(filename + ".tmp", filename)
    if replaced is not None:
        replaced.append(filename)


def load_checkpoint_file(path, arg_overrides=None, mmap=False):
    """fairseq's load_checkpoint_to_cpu for one local file, made safe: torch.load with weights_only=True
    passed explicitly, errors that name the file, and no config string that fairseq would eval() unless
    it is a literal. Then what fairseq does: flag overrides, the config as OmegaConf, old formats upgraded.
    mmap: the tensors stay backed by the file (only what is used is read: one rank's experts)."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name
    from omegaconf import OmegaConf

    state = shards.read_file(path, mmap=mmap)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a fairseq checkpoint (a {type(state).__name__}"
                              + (" without a model state)" if isinstance(state, dict) else ")"))
    safe_load.check_config(state, path)
    with shards.laid_out(path):
        if state.get("args") is not None and arg_overrides is not None:
            for key, value in arg_overrides.items():
                setattr(state["args"], key, value)
        if state.get("cfg") is not None:
            state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
            if arg_overrides is not None:
                overwrite_args_by_name(state["cfg"], arg_overrides)
        return checkpoint_utils._upgrade_state_dict(state)


def load_found(found, arg_overrides=None, want=None, experts=None, mmap=False, optimizer=True):
    """The state of what shards.resolve() found: a single file, or a set assembled (want: the expert
    ranges to read, else all; or a function of the saved {name: E} that gives them). experts: the model's
    {name: E}, checked against the saved layout. A set's shared file goes through fairseq's loader
    (overrides, upgrades), then the experts go in. mmap: the files stay mapped (only what is used is read);
    optimizer=False: without the optimizer state (inference)."""
    kind, target, _ = found
    path = target if kind == "file" else shards.shared_path(target)
    if kind == "set" and not os.path.exists(path):
        shards.check_set(target)  # names the missing shared file and what it is for (assemble checks the rest)
    state = load_checkpoint_file(path, arg_overrides, mmap=mmap)
    if not optimizer:  # (inference: neither the optimizer state nor the EMA copy is read)
        state.pop("last_optimizer_state", None)
        state["extra_state"] = shards.without_ema(state.get("extra_state"))
    with shards.laid_out(path):
        check_expert_layout(shards.manifest_of(state).get("experts"), experts, path)
    if callable(want):
        want = want(shards.manifest_of(state).get("experts") or {})
    return state if kind == "file" else shards.assemble(target, want=want, shared=state)


def requested_name(trainer, filename):
    """(the checkpoint name the user asked for, whether it is the default checkpoint_last) for the path
    fairseq hands Trainer.load_checkpoint. fairseq adds each rank's suffix to --restore-file; the name
    without it is what resolves (a bare NAME.pt: the later save of set and file; NAME-shared.pt: the set)."""
    ckpt = trainer.cfg.checkpoint
    user_suffix = ckpt.checkpoint_suffix or ""
    if ckpt.restore_file == "checkpoint_last.pt":
        if filename == os.path.join(ckpt.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt"):
            return os.path.join(ckpt.save_dir, f"checkpoint_last{user_suffix}.pt"), True
        return filename, False  # --finetune-from-model / --continue-once, as given
    name = ckpt.restore_file
    return (name[:-3] + user_suffix + ".pt" if name.endswith(".pt") else name), False


# ---- The hooks: fairseq's Trainer and checkpoint_utils functions, as patches.py installs them ----------

_TRAINER, _CKPT = "fairseq.trainer:Trainer", "fairseq.checkpoint_utils"


@dataclass
class RunState:
    """What the hooks keep for one Trainer: made with it (trainer_init), gone with it (a weak map).

    spread: {expert parameter: (first, count, E)} of the experts spread over ranks ({}: one process);
    reset_dataloader: set by load_checkpoint for the Trainer.load_checkpoint it calls (fine-tuning
    restarts the data, so the saved position is neither used nor rescaled); None otherwise.
    save: the SaveInProgress of the save_checkpoint under way; None otherwise."""
    spread: dict
    reset_dataloader: Optional[bool] = None
    save: Optional["SaveInProgress"] = None


_RUNS = weakref.WeakKeyDictionary()


def run_state(trainer):
    if trainer not in _RUNS:  # (a Trainer made before the plugin loaded)
        _RUNS[trainer] = RunState(spread=expert_params(trainer.get_model(), spread_only=True))
    return _RUNS[trainer]


def trainer_init(self, cfg, task, model, criterion, *args, **kwargs):
    # Here, not at model build: only the trainer sees the whole config under fairseq-hydra-train too.
    spread = expert_params(model, spread_only=True)
    refusals.check("trainer", refusals.Context(flags=refusals.training_flags(cfg), spread=bool(spread), model=model,
                                               criterion=criterion, task=cfg.get("task"),
                                               moe_task=getattr(task, "moves_routing_biases", False)))
    keep_freed_memory_if_asked(cfg)
    bf16.check_trainer(cfg)
    patches.original(_TRAINER, "__init__")(self, cfg, task, model, criterion, *args, **kwargs)
    _RUNS[self] = RunState(spread=spread)


def trainer_train_step(train_step):
    """Trainer.train_step: its micro-batches are one update (or one attempt, skipped by an overflow): the global
    balance loss pools the counts of the update's micro-batches from the first one on, so each MoE layer's running
    sum starts again here (the MoE tasks' train_step adds each micro-batch's)."""
    @functools.wraps(train_step)
    def wrapped(self, samples, *args, **kwargs):
        for module in self.model.modules():
            if isinstance(module, MoELayer) and module.cfg.balance_loss_scope == "global":
                module.reset_global_counts()
        return train_step(self, samples, *args, **kwargs)

    return wrapped


def keep_freed_memory_if_asked(cfg):
    """--moe-keep-freed-memory (fairseq_moe_layer/malloc.py), in a process that trains: here, when its Trainer is
    built, before any gradient or optimizer state exists. Not at model build: a model is built from the flags
    saved in a checkpoint wherever one is loaded (generate, eval-lm, the hub), and a flag of the training run
    must not change those processes' allocator, nor fail a load on a machine without glibc."""
    model = cfg if isinstance(cfg, argparse.Namespace) else cfg.get("model")
    if not getattr(model, "moe_keep_freed_memory", False):
        return
    if not malloc.keep_freed_memory():
        raise FlagError("--moe-keep-freed-memory needs glibc's malloc (its mallopt): this C library is not glibc")
    logger.info("--moe-keep-freed-memory: glibc's malloc keeps freed memory in this process (no block mapped "
                "apart, the heap not trimmed)")


@property
def trainer_checkpoint_suffix(self):
    base = patches.original(_TRAINER, "checkpoint_suffix").fget(self)
    return f"{base}-rank-{self.data_parallel_rank}" if run_state(self).spread else base


@property
def trainer_should_save(self):
    fairseq = patches.original(_TRAINER, "should_save_checkpoint_on_current_rank")
    return bool(run_state(self).spread) or fairseq.fget(self)


def trainer_state_dict(self):
    """fairseq's state, plus what a later run at another world size needs: where each expert's
    optimizer state sits, and the world size the data iterator's position counts batches for."""
    state = patches.original(_TRAINER, "state_dict")(self)
    experts = expert_params(self.get_model())
    if experts:
        state["extra_state"]["moe_checkpoint"] = {
            "experts": {n: E for n, (_, _, E) in experts.items()},
            "optimizer_index": _optimizer_index(self, experts),
            "data_parallel_size": self.data_parallel_world_size, "saved_at": time.time()}
    return state


class SaveInProgress:
    """One save_checkpoint of an MoE model, from its start to its end: stands in for fairseq's PathManager,
    and for `os` in fairseq's checkpoint_utils (where fairseq deletes old checkpoints).

    One process: copies are atomic, the rest is fairseq's. With the experts spread, the save is a
    commit.SetSave: every file is written staged, copies to more names (checkpoint_last, checkpoint_best,
    ...) are staged copies of a whole set (rank 0 copies the shared file along), fairseq's --keep-* rules
    count the names as they will be after the save, and what they delete becomes a retired set, deleted
    by rank 0 after the commit. No file of the previous sets changes before every rank's files are on disk."""

    def __init__(self, path_manager, sets=None, master=False):
        self._pm, self.sets, self.master = path_manager, sets, master
        self.replaced, self.removed = [], []  # (one process: the files this save has written so far, each whole,
        # and those --keep-* has removed)

    def __getattr__(self, name):  # the rest of PathManager, and of os
        return getattr(self._pm, name)

    def copy(self, src, dst, overwrite=False):
        if self.sets is None:
            copied = _atomic_copy(src, dst, overwrite)
            if copied:
                self.replaced.append(dst)
            return copied
        self.sets.copy(src, dst)
        if self.master:
            self.sets.copy(shards.shared_path(shards.set_base(src)), shards.shared_path(shards.set_base(dst)))
        return True

    def ls(self, path):
        return self.sets.listing(path) if self.sets is not None else self._pm.ls(path)

    def exists(self, path):
        return self._pm.exists(path) or (self.sets is not None and self.sets.has(path))

    def rm(self, path):
        if self.sets is None:
            self._pm.rm(path)
        else:
            self.sets.retire(path)


class OsDuringSave:
    """`os` for fairseq's save_checkpoint: its os.remove of an old rank file retires that set instead."""

    def __init__(self, save):
        self._save = save

    def __getattr__(self, name):
        return getattr(os, name)

    def remove(self, path):
        if self._save.sets is None:
            os.remove(path)
            self._save.removed.append(path)
        else:
            self._save.rm(path)


def trainer_save_checkpoint(self, filename, extra_state):
    spread, save = run_state(self).spread, run_state(self).save
    if not spread:
        return patches.original(_TRAINER, "save_checkpoint")(self, filename, extra_state)
    from fairseq import utils
    if save is None:  # every rank's files of one save share an id, drawn in save_checkpoint
        raise RuntimeError("with the experts spread over ranks, save through checkpoint_utils.save_checkpoint "
                           "(every rank), not Trainer.save_checkpoint alone")
    state = utils.move_to_cpu(self.state_dict())
    state["extra_state"].update(extra_state)
    experts = state["extra_state"]["moe_checkpoint"]  # from state_dict() above
    W = self.data_parallel_world_size
    info = shards.manifest(self.get_num_updates(), save.sets.save_id, W, experts["experts"],
                           experts["optimizer_index"], W)
    shared, mine = shards.split(state, {n: (f, c) for n, (f, c, _) in spread.items()}, self.data_parallel_rank,
                                info)
    save.sets.write(mine, filename)  # (asynchronous writes are refused with spread experts)
    if self.is_data_parallel_master:
        save.sets.write(shared, shards.shared_path(shards.set_base(filename)))
    return os.path.abspath(filename)


def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
    """fairseq's save_checkpoint for MoE models: see SaveInProgress and commit.py."""
    fairseq_save = patches.original(_CKPT, "save_checkpoint")
    if cfg.no_save or not expert_params(trainer.get_model()):  # a dense model: fairseq's own save
        return fairseq_save(cfg, trainer, epoch_itr, val_loss)
    checkpoint_utils = importlib.import_module(_CKPT)
    spread, master = bool(run_state(trainer).spread), trainer.is_data_parallel_master
    sets = None
    if not spread:
        if master:  # what a stopped save of an earlier, multi-rank run left
            commit.recover(cfg.save_dir, cfg.checkpoint_suffix)
    else:
        from fairseq.distributed import utils as dist_utils
        group = trainer.data_parallel_process_group
        # Rank 0, while no rank writes: the folder, what a stopped save left, and one id for all files of this
        # save (files of two saves never pass for a set). Its failure reaches every rank through the broadcast.
        save_id, failed = dist_utils.broadcast_object(_start_save(cfg) if master else None, src_rank=0, group=group)
        if failed:
            raise SaveError(f"the checkpoint save in {cfg.save_dir} could not start on rank 0 ({failed}); nothing "
                            f"was written")
        sets = commit.SetSave(cfg.save_dir, save_id, trainer.data_parallel_rank, trainer.data_parallel_world_size,
                              gather=lambda obj: _all_gather(obj, group), suffix=cfg.checkpoint_suffix)
    save = SaveInProgress(checkpoint_utils.PathManager, sets, master)
    run_state(trainer).save, error, out = save, None, None
    try:
        with patches.scoped(checkpoint_utils, "PathManager", save), \
                patches.scoped(checkpoint_utils, "os", OsDuringSave(save)), \
                patches.scoped(checkpoint_utils, "torch_persistent_save",
                               functools.partial(persistent_save, replaced=save.replaced)):
            out = fairseq_save(cfg, trainer, epoch_itr, val_loss)
    except Exception as e:
        if sets is None:
            if commit.os_error_in(e) is None:
                raise
            done = [f"it had written {', '.join(map(os.path.basename, save.replaced))} (each whole)"] * bool(
                save.replaced) + [f"removed {', '.join(map(os.path.basename, save.removed))}"] * bool(save.removed)
            raise SaveError(f"the checkpoint save in {cfg.save_dir} failed ({commit.error_line(e)}); " + (
                f"{' and '.join(done)}; the other checkpoints are as they were" if done else
                "nothing was replaced: the previous checkpoints are as they were")) from e
        error = e  # the other ranks must hear of it before anyone raises
    finally:
        run_state(trainer).save = None
    if sets is not None:
        sets.finish(error)
    return out


def _start_save(cfg):
    """(save id, None), or (None, why) when rank 0 cannot prepare the folder."""
    try:
        os.makedirs(cfg.save_dir, exist_ok=True)  # every rank writes into it
        commit.recover(cfg.save_dir, cfg.checkpoint_suffix)
        return shards.new_save_id(), None
    except Exception as e:  # (the other ranks wait in the broadcast: they must hear of it)
        logger.exception("preparing %s for a save", cfg.save_dir)
        return None, commit.error_line(e)


def _all_gather(obj, group):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


EXPERT_TENSOR = re.compile(r"\.moe\.experts\.(w1|b1|w2|b2)$")  # the routed experts' tensors [E, ...] of a model


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's loader, safe, for a single file or a set (fairseq-generate, -interactive, -eval-lm,
    the hub, --finetune-from-model)."""
    found = shards.resolve(path)
    if found is None:
        raise MissingCheckpointError(f"{path}: no such checkpoint (nor the set {shards.set_base(path)}-shared.pt "
                                     f"+ rank files)")
    logger.info("%s: loading %s", path, shards.describe(found))
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return load_found(found, arg_overrides)
    # Several ranks (spread.py): the model is built with its experts spread; this rank reads its own (a set's
    # rank files are memory-mapped: only these rows are read), whatever the world size that saved them.
    W, rank = dist.get_world_size(), dist.get_rank()

    def local(name, E):
        try:
            return local_experts(E, W, rank)
        except ValueError as e:  # E and W do not fit: names both, and the layer
            raise FlagError(f"{e} ({name.rsplit('.', 2)[0]} of {path})") from None

    state = load_found(found, arg_overrides, want=lambda experts: {
        n: (first, first + count) for n, E in experts.items() for first, count in [local(n, E)]}, mmap=True,
        optimizer=False)
    if found[0] == "set":
        return state
    full = {n: t.shape[0] for n, t in state["model"].items() if EXPERT_TENSOR.search(n)}  # a file: every expert
    with shards.laid_out(path):
        return shards.cut_for_rank(state, {n: (*local(n, E), E) for n, E in full.items()})


def models_by_set_name(load):
    """fairseq's load_model_ensemble_and_task, told about sets: --path NAME.pt of an expert-parallel set (as
    fairseq-train's --restore-file and inspect take it; with --checkpoint-suffix S, the set NAME-S) loads the
    set, where fairseq checks that the file exists first; a local path that names nothing is one line, not
    fairseq's traceback. What fairseq itself finds (a file, FSDP's -shard0.pt, a remote path, model-parallel
    _partK.pt) is loaded as fairseq loads it."""
    @functools.wraps(load)
    def wrapped(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1, state=None):
        if state is None and num_shards == 1:
            named = [_by_set_name(f, suffix) for f in filenames]
            if any(n is not None for n in named):  # a set's shared file has the suffix in its name: all do now
                filenames = [n or f.replace(".pt", suffix + ".pt") for n, f in zip(named, filenames)]
                suffix = ""
        return load(filenames, arg_overrides, task, strict, suffix, num_shards, state)

    return wrapped


def _by_set_name(filename, suffix):
    """The shared file of the set that filename (with suffix) names; None when fairseq finds what it names."""
    from fairseq.file_io import PathManager

    checkpoint_utils = importlib.import_module(_CKPT)
    if PathManager.exists(checkpoint_utils.get_maybe_sharded_checkpoint_filename(filename, suffix, 0, 1)):
        return None
    named = filename.replace(".pt", suffix + ".pt")  # (as fairseq adds the suffix)
    found = shards.locate(named)
    if found is not None and found[0] == "set":
        return shards.shared_path(found[1])
    if "://" in filename:
        return None  # (a remote path: fairseq's own error)
    raise MissingCheckpointError(f"{named}: no such checkpoint" + (
        f" (nor the set {shards.set_base(named)}-shared.pt + rank files)" if named.endswith(".pt") else ""))


class LoadForRank:
    """Trainer.load_checkpoint's reader (it stands in for checkpoint_utils.load_checkpoint_to_cpu for
    that call): this rank's state of what was resolved, its experts only, the data position rescaled
    to this world size."""

    def __init__(self, trainer, found, reset_dataloader, reset_optimizer):
        self.found, self.reset_dataloader, self.reset_optimizer = found, reset_dataloader, reset_optimizer
        self.spread = run_state(trainer).spread
        self.world_size = trainer.data_parallel_world_size
        self.experts = {n: E for n, (_, _, E) in expert_params(trainer.get_model()).items()}
        # (the model's state-dict names: what a checkpoint holds, also under wrappers that flatten parameters)
        with fsdp.shapes_only():  # (a sharded model's global shapes, nothing gathered)
            self.model_keys = {n: tuple(t.shape) for n, t in trainer.get_model().state_dict().items()}
        self.model_cfg, self.log = trainer.cfg.model, trainer.data_parallel_rank == 0
        self.store_ema = bool(trainer.cfg.ema.store_ema)
        self.common = trainer.cfg.common

    def __call__(self, path, arg_overrides=None, load_on_all_ranks=False):
        ranges = {n: (f, f + c) for n, (f, c, _) in self.spread.items()}
        state = load_found(self.found, arg_overrides, want=ranges, experts=self.experts)
        check_fits(state, self.model_keys, self.reset_optimizer, path, self.experts, self.model_cfg, self.log)
        optim.check_resumed_precision(state, self.common, path, self.reset_optimizer)
        if self.spread:
            with shards.laid_out(path):
                state = shards.cut_for_rank(state, self.spread)
        if not self.reset_dataloader:
            state = shards.rescale_iterator(state, self.world_size, path)
        extra = state.get("extra_state")
        if self.store_ema and isinstance(extra, dict) and "ema" not in extra and "model" in state:
            # fairseq 0.12 seeds a missing EMA from state["model"] after it has deleted it (KeyError): seed it here
            state["extra_state"] = dict(extra, ema=dict(state["model"]))
        return state


def trainer_load_checkpoint(self, filename, *args, **kwargs):
    fairseq_load = patches.original(_TRAINER, "load_checkpoint")
    name, default = requested_name(self, filename)
    found = shards.resolve(name)
    if found is None:
        if default:  # a first launch: fairseq starts afresh
            return fairseq_load(self, filename, *args, **kwargs)
        raise MissingCheckpointError(f"--restore-file {name}: no such checkpoint")
    if found[0] == "set":  # a set with a file missing or damaged is an error, never a fresh start
        shards.check_set(found[1])
    logger.info("%s: loading %s", name, shards.describe(found))
    run = run_state(self)
    reset = self.cfg.checkpoint.reset_dataloader if run.reset_dataloader is None else run.reset_dataloader
    ckpt = self.cfg.checkpoint
    path = shards.shared_path(found[1]) if found[0] == "set" else found[1]  # fairseq checks it exists
    # With spread experts every rank reads its own (fairseq would broadcast rank 0's to all).
    reset_optimizer = args[0] if args else kwargs.get("reset_optimizer", False)  # (fairseq passes it first)
    with patches.scoped(importlib.import_module(_CKPT), "load_checkpoint_to_cpu",
                        LoadForRank(self, found, reset, reset_optimizer)), \
            overridden(ckpt, "load_checkpoint_on_all_dp_ranks", bool(run.spread) or ckpt.load_checkpoint_on_all_dp_ranks):
        return fairseq_load(self, path, *args, **kwargs)


def recover_before_resume(cfg, trainer, last=None):
    """On rank 0 while no rank reads or writes: commit.recover() (a committed save finished, an uncommitted
    one's staged files removed), then, given the path of checkpoint_last, resume_past_damage(). Returns its
    --restore-file value (or None), the same on every rank (a gather: any backend); a failure is raised on
    every rank."""
    outcome = (None, None, None)  # (restore file, CheckpointError message, failure to recover)
    if trainer.data_parallel_rank == 0:
        try:
            commit.recover(cfg.save_dir, cfg.checkpoint_suffix)
            outcome = (resume_past_damage(last, cfg.checkpoint_suffix) if last else None, None, None)
        except CheckpointError as e:
            outcome = (None, (isinstance(e, MissingCheckpointError), str(e)), None)
        except Exception as e:  # (the other ranks wait in the gather: they must hear of it)
            logger.exception("recovering %s", cfg.save_dir)
            outcome = (None, None, commit.error_line(e))
    if trainer.data_parallel_world_size > 1:
        outcome = _all_gather(outcome, trainer.data_parallel_process_group)[0]
    newest, damage, failed = outcome
    if damage:
        missing, message = damage
        raise (MissingCheckpointError if missing else CheckpointError)(message)
    if failed:
        raise CheckpointError(f"--save-dir {cfg.save_dir}: what a stopped save left there cannot be recovered "
                              f"({failed}); nothing was loaded")
    return newest


def newest_complete_set(folder, suffix):
    """(NAME, core, update) of the newest complete set of this run's names in folder (core: NAME without the
    folder, "checkpoint" and the suffix), or None."""
    names, best = shards.run_names(suffix), None
    for name in os.listdir(folder):
        m = names.match(name)
        if not m or m.group("tmp") or not name.endswith("-shared.pt"):
            continue
        base = os.path.join(folder, name[:-len("-shared.pt")])
        try:
            shards.check_set(base)
            info = shards.manifest_of(shards.read_file(shards.shared_path(base), mmap=True))
        except CheckpointError:
            continue
        key = (info.get("saved_at", 0), info.get("num_updates", 0))
        if best is None or key > best[0]:
            best = (key, base, m.group(1), info.get("num_updates"))
    return None if best is None else best[1:]


def resume_past_damage(last, suffix):
    """When the set checkpoint_last is incomplete or damaged (a rank file missing or half copied): its files
    are moved aside under a name no rule of the run touches (commit.set_aside), so that no save of this run
    replaces them, and the newest complete set of the run is resumed instead; one log line says both. Returns
    the --restore-file value that loads it; None when checkpoint_last is whole (or a single file, or absent:
    fairseq's rules). Raises the damage, moving nothing, when no complete set is left to resume."""
    found = shards.locate(last)
    if found is None or found[0] != "set":
        return None
    try:
        shards.check_set(found[1])
        return None
    except CheckpointError as e:
        damage = e
    folder = os.path.dirname(last)
    newest = newest_complete_set(folder, suffix)
    if newest is None:
        raise type(damage)(f"{damage}; no other complete checkpoint set of this run is in {folder} to resume "
                           f"from, so nothing was loaded or changed")
    base, core, updates = newest
    try:
        aside = commit.set_aside(found[1], suffix)
    except OSError as e:
        raise CheckpointError(f"{damage}; its files cannot be moved aside for a resume from {shards.shared_path(base)} "
                              f"({commit.error_line(e)}): nothing was loaded") from None
    restore = os.path.join(folder, f"checkpoint{core}.pt")
    found = shards.resolve(f"{base}.pt")  # (a single file of that name saved later would be taken)
    plain = aside[:len(aside) - len(suffix or "")] if suffix else aside
    logger.warning(f"{last} cannot be resumed ({damage}); its files are kept, moved aside as {aside}-shared.pt "
                   f"and -rank-R.pt (no save of this run touches them: complete them and resume from them with "
                   f"--restore-file {plain}.pt); resuming from {shards.describe(found)} instead (update {updates}), "
                   f"the newest complete set of this run")
    return restore


def load_checkpoint(cfg, trainer, **passthrough_args):
    """fairseq's load_checkpoint, told about sets: it takes a run whose checkpoint_last exists
    only as a set (or a single file) at this world size for a first launch, and would then start
    --finetune-from-model / --continue-once over it instead of resuming. A stopped save is recovered
    first; a damaged checkpoint_last set is moved aside for the newest complete set of the run."""
    overrides, finetuning, newest = {}, False, None
    last = os.path.join(cfg.save_dir, f"checkpoint_last{cfg.checkpoint_suffix or ''}.pt")
    if cfg.restore_file != "checkpoint_last.pt":
        last = None
    if expert_params(trainer.get_model()):  # (sets are written by MoE models only)
        newest = recover_before_resume(cfg, trainer, last)
    if last is not None:
        resumable = newest is not None or shards.locate(last) is not None  # the same answer on every rank
        if newest is not None:
            overrides["restore_file"] = newest
        resets = cfg.reset_optimizer or cfg.reset_lr_scheduler or cfg.reset_meters or cfg.reset_dataloader
        # (--finetune-from-model with --reset-* is fairseq's own error, raised on every rank.)
        if resumable and not (cfg.finetune_from_model is not None and resets):
            overrides.update(finetune_from_model=None, continue_once=None)
        finetuning = (not resumable and cfg.finetune_from_model is not None
                      and getattr(cfg, "continue_once", None) is None)
        if finetuning and not os.path.exists(cfg.finetune_from_model):
            # fairseq checks that the path exists before it asks for it: point it at the set's
            # shared file, which loads the whole set (like --restore-file NAME.pt does).
            found = shards.locate(cfg.finetune_from_model)
            if found is not None and found[0] == "set":
                overrides = {"finetune_from_model": shards.shared_path(found[1])}
    # Fine-tuning restarts the data; only then is the saved position not used (nor rescaled).
    run = run_state(trainer)
    run.reset_dataloader = cfg.reset_dataloader or finetuning
    try:
        with contextlib.ExitStack() as stack:
            for key, value in overrides.items():
                if key in cfg:
                    stack.enter_context(overridden(cfg, key, value))
            return patches.original(_CKPT, "load_checkpoint")(cfg, trainer, **passthrough_args)
    finally:
        run.reset_dataloader = None
