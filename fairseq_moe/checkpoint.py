"""fairseq checkpoints of MoE models: safe loading, and expert-parallel saves that lose nothing.

1. torch >= 2.6 loads with weights_only=True, which refuses any class it was not told about. A fairseq
   0.12 checkpoint pickles one such class, argparse.Namespace (its "args"). We allow exactly that, so
   fairseq-generate and --restore-file work while an arbitrary pickled object is still refused.
   Never switch weights_only off instead.
2. fairseq 0.12 writes a checkpoint from rank 0 alone, which holds only its own experts. When the experts
   are spread over ranks, every rank writes NAME-rank-R.pt with its experts and their optimizer state,
   and rank 0 writes NAME-shared.pt with the rest (format and checks: expert_checkpoint.py). Such a set
   resumes at any world size, and fairseq-generate reads it with --path NAME-shared.pt.
"""
import argparse
import contextlib
import glob
import logging
import os
import time
from itertools import chain

import torch

from . import expert_checkpoint as shards

SAFE_GLOBALS = [argparse.Namespace]
logger = logging.getLogger(__name__)


def register_safe_globals():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def _moe_layers(model):
    from .moe import MoELayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def expert_params(model, spread_only=False):
    """{state-dict name: (first expert, local experts, E)} of the expert tensors (only the spread ones)."""
    out = {}
    for name, layer in _moe_layers(model):
        if layer.ep is not None or not spread_only:
            ex = layer.experts
            for p in ("w1", "b1", "w2", "b2"):
                out[f"{name}.experts.{p}"] = (ex.first_expert, ex.num_experts, ex.total_experts)
    return out


def _optimizer_index(trainer, names):
    """Where each named parameter's state sits in the optimizer's state dict (fairseq's param order)."""
    params = chain(trainer.get_model().named_parameters(), trainer.get_criterion().named_parameters())
    order = [n for n, p in params if p.requires_grad]
    return {n: i for i, n in enumerate(order) if n in names}


def training_flags(cfg):
    """fairseq's training config as one flat Namespace of flags (what check_supported reads), from the
    argparse Namespace or from the sectioned config fairseq-hydra-train and fairseq-train build."""
    if isinstance(cfg, argparse.Namespace):
        return cfg
    flat = {}
    for section in ("common", "distributed_training", "optimization", "checkpoint", "ema"):
        if cfg.get(section) is not None:
            flat.update(cfg[section])
    if cfg.get("optimizer") is not None:
        flat["optimizer"] = getattr(cfg.optimizer, "_name", None)  # a DictConfig, or a Namespace (legacy)
    return argparse.Namespace(**flat)


def check_supported(args, spread):
    """Training set-ups whose state cannot be cut per expert are refused before any update
    (args: training_flags(cfg))."""
    if not spread:
        return
    if (getattr(args, "fp16", False) or getattr(args, "bf16", False)) and not (
            getattr(args, "memory_efficient_fp16", False) or getattr(args, "fp16_no_flatten_grads", False)):
        raise ValueError("--fp16/--bf16 with experts spread over ranks needs --fp16-no-flatten-grads (or "
                         "--memory-efficient-fp16): a flattened optimizer state cannot be saved per expert")
    if getattr(args, "store_ema", False):
        raise ValueError("--store-ema is not supported with experts spread over ranks: the EMA copy would "
                         "hold only this rank's experts")
    if getattr(args, "ddp_backend", None) == "fully_sharded":
        raise ValueError("--ddp-backend fully_sharded is not supported with experts spread over ranks")
    if getattr(args, "zero_sharding", "none") != "none":
        raise ValueError("--zero-sharding is not supported with experts spread over ranks: the optimizer "
                         "state would be gathered on rank 0, which holds only its own experts")
    if getattr(args, "optimizer", None) in ("adafactor", "composite"):
        raise ValueError(f"--optimizer {args.optimizer} is not supported with experts spread over ranks: "
                         f"its state cannot be saved per expert (adafactor's statistics of the expert "
                         f"biases mix the experts); use adam, sgd, ...")


@contextlib.contextmanager
def _swapped(obj, name, value):
    """obj.name = value for the duration of the block (an attribute it did not have is removed after)."""
    had, old = hasattr(obj, name), getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


class _CopySharedToo:
    """fairseq's PathManager during a save: copying NAME-rank-R.pt to another name copies the set's
    shared file along (rank 0), so checkpoint_last, checkpoint_best, ... are whole sets."""

    def __init__(self, path_manager, master, written):
        self._pm, self._master, self.written = path_manager, master, written

    def __getattr__(self, name):
        return getattr(self._pm, name)

    def copy(self, src, dst, overwrite=False):
        ok = self._pm.copy(src, dst, overwrite=overwrite)
        if self._master and ok:
            ok = self._pm.copy(shards.shared_path(shards.set_base(src)),
                               shards.shared_path(shards.set_base(dst)), overwrite=overwrite)
            self.written.append(shards.set_base(dst))
        return ok


def _rank0_files(save_dir):
    return set(glob.glob(os.path.join(glob.escape(save_dir), "*-rank-0.pt")))


def _clean_up(before, save_dir, world_size, written):
    """After a save (rank 0), for the sets whose rank-0 file fairseq deleted in this save
    (--keep-interval-updates, --keep-last-epochs, --keep-best-checkpoints; also one written and deleted
    in the same save): their shared file and the rank files of ranks that are not there any more (a set
    of an earlier, larger run) go too. A set just written loses its rank files beyond this world size."""
    after = _rank0_files(save_dir)
    written_rank0 = {shards.rank_path(base, 0) for base in written}
    for gone in (before | written_rank0) - after:
        base = shards.set_base(gone)
        _remove_ranks(base, world_size)  # ranks below world_size remove their own files
        with contextlib.suppress(FileNotFoundError):
            os.remove(shards.shared_path(base))
    for base in written:
        _remove_ranks(base, world_size)


def _remove_ranks(base, first):
    """Delete NAME-rank-R.pt for R >= first (other files that merely start alike stay)."""
    for path in glob.glob(glob.escape(base) + "-rank-*.pt"):
        m = shards._SHARD.match(path)
        if m and m.group("base") == base and m.group("rank") is not None and int(m.group("rank")) >= first:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def install_expert_parallel_checkpointing():
    """Patch fairseq's trainer and checkpoint_utils for sharded expert checkpoints (idempotent)."""
    from fairseq import checkpoint_utils, trainer as trainer_module
    from fairseq.distributed import utils as dist_utils

    Trainer = trainer_module.Trainer
    if getattr(Trainer, "moe_shards", False):
        return
    save_checkpoint, load_to_cpu = checkpoint_utils.save_checkpoint, checkpoint_utils.load_checkpoint_to_cpu
    load_checkpoint = checkpoint_utils.load_checkpoint
    suffix, should_save = Trainer.checkpoint_suffix.fget, Trainer.should_save_checkpoint_on_current_rank.fget
    trainer_save, trainer_load, trainer_state = Trainer.save_checkpoint, Trainer.load_checkpoint, Trainer.state_dict
    trainer_init = Trainer.__init__

    def init(self, cfg, task, model, criterion, *args, **kwargs):
        # Here, not at model build: only the trainer sees the whole config under fairseq-hydra-train too.
        check_supported(training_flags(cfg), spread=bool(expert_params(model, spread_only=True)))
        trainer_init(self, cfg, task, model, criterion, *args, **kwargs)

    def spread_of(self):
        if not hasattr(self, "_moe_spread"):
            self._moe_spread = expert_params(self.get_model(), spread_only=True)
        return self._moe_spread

    def checkpoint_suffix(self):
        base = suffix(self)
        return f"{base}-rank-{self.data_parallel_rank}" if spread_of(self) else base

    def should_save_on_this_rank(self):
        return True if spread_of(self) else should_save(self)

    def state_dict(self):
        """fairseq's state, plus what a later run at another world size needs: where each expert's
        optimizer state sits, and the world size the data iterator's position counts batches for."""
        state = trainer_state(self)
        experts = expert_params(self.get_model())
        if experts:
            state["extra_state"]["moe_checkpoint"] = {
                "experts": {n: E for n, (_, _, E) in experts.items()},
                "optimizer_index": _optimizer_index(self, experts),
                "data_parallel_size": self.data_parallel_world_size, "saved_at": time.time()}
        return state

    def save_sharded(self, filename, extra_state):
        spread = spread_of(self)
        if not spread:
            return trainer_save(self, filename, extra_state)
        from fairseq import utils

        state = utils.move_to_cpu(self.state_dict())
        state["extra_state"].update(extra_state)
        experts = state["extra_state"]["moe_checkpoint"]  # from state_dict() above
        W = self.data_parallel_world_size
        info = shards.manifest(self.get_num_updates(), self._moe_save_id, W, experts["experts"],
                               experts["optimizer_index"], W)
        shared, mine = shards.split(state, {n: (f, c) for n, (f, c, _) in spread.items()},
                                    self.data_parallel_rank, info)
        async_write = self.cfg.checkpoint.write_checkpoints_asynchronously
        checkpoint_utils.torch_persistent_save(mine, filename, async_write=async_write)
        if self.is_data_parallel_master:
            path = shards.shared_path(shards.set_base(filename))
            checkpoint_utils.torch_persistent_save(shared, path, async_write=async_write)
            self._moe_written.append(shards.set_base(filename))
            logger.info(f"Saved expert-parallel checkpoint {path} and {self.data_parallel_world_size} "
                        f"rank files")
        return os.path.abspath(filename)

    def save_checkpoint_sets(cfg, trainer, epoch_itr, val_loss):
        if not spread_of(trainer) or cfg.no_save:
            return save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        os.makedirs(cfg.save_dir, exist_ok=True)  # every rank writes into it
        # One id for all files of this save, drawn on rank 0: files of two saves never pass for a set.
        trainer._moe_save_id = dist_utils.broadcast_object(
            shards.new_save_id(), src_rank=0, group=trainer.data_parallel_process_group)
        master = trainer.is_data_parallel_master
        before, trainer._moe_written = _rank0_files(cfg.save_dir), []
        copier = _CopySharedToo(checkpoint_utils.PathManager, master, trainer._moe_written)
        with _swapped(checkpoint_utils, "PathManager", copier):
            out = save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        if master:
            _clean_up(before, cfg.save_dir, trainer.data_parallel_world_size, trainer._moe_written)
        return out

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False, want=None):
        """fairseq's loader, for a single file or a set (want: the expert ranges to read, else all)."""
        found = shards.locate(path)
        if not found or found[0] == "file":
            return load_to_cpu(found[1] if found else path, arg_overrides, load_on_all_ranks)
        base = found[1]
        # fairseq's loader applies arg overrides and upgrades old states: run it on the shared file,
        # then put the experts in.
        state = load_to_cpu(shards.shared_path(base), arg_overrides, load_on_all_ranks)
        return shards.assemble(base, want=want, shared=state)

    def load_sharded(self, filename, *args, **kwargs):
        found = shards.locate(filename)
        explicit = self.cfg.checkpoint.restore_file
        if found is None and explicit != "checkpoint_last.pt":
            # fairseq puts the rank suffix into the path with str.replace(".pt", ...), which also
            # hits a ".pt" inside a folder name: resolve the file the user named. One that does
            # not exist is an error, not a silent fresh start.
            if explicit.endswith(".pt"):  # with the user's --checkpoint-suffix, as fairseq means it
                explicit = explicit[:-3] + (self.cfg.checkpoint.checkpoint_suffix or "") + ".pt"
            found = shards.locate(explicit)
            if found is None:
                raise FileNotFoundError(f"--restore-file {explicit}: no such checkpoint")
        base = found[1] if found and found[0] == "set" else None
        if found:  # fairseq checks that the file it is given exists
            filename = shards.shared_path(base) if base else found[1]
        spread = spread_of(self)
        ranges = {n: (f, f + c) for n, (f, c, _) in spread.items()}
        reset_dataloader = getattr(self, "_moe_reset_dataloader", self.cfg.checkpoint.reset_dataloader)

        def read(path, arg_overrides=None, load_on_all_ranks=False):
            """This rank's state: its experts only, the data position rescaled to this world size."""
            state = load_checkpoint_to_cpu(path, arg_overrides, load_on_all_ranks, want=ranges)
            if spread:
                state = shards.cut_for_rank(state, spread)
            if not reset_dataloader:
                state = shards.rescale_iterator(state, self.data_parallel_world_size, path)
            return state

        # With spread experts every rank reads its own (fairseq would broadcast rank 0's to all).
        ckpt = self.cfg.checkpoint
        with _swapped(checkpoint_utils, "load_checkpoint_to_cpu", read), \
                _swapped(ckpt, "load_checkpoint_on_all_dp_ranks", bool(spread) or ckpt.load_checkpoint_on_all_dp_ranks):
            return trainer_load(self, filename, *args, **kwargs)

    def load_checkpoint_resolved(cfg, trainer, **passthrough_args):
        """fairseq's load_checkpoint, told about sets: it takes a run whose checkpoint_last exists
        only as a set (or a single file) at this world size for a first launch, and would then start
        --finetune-from-model / --continue-once over it instead of resuming."""
        overrides, finetuning = {}, False
        if cfg.restore_file == "checkpoint_last.pt":
            last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
            resumable = shards.locate(last) is not None  # the same answer on every rank
            resets = (cfg.reset_optimizer or cfg.reset_lr_scheduler or cfg.reset_meters
                      or cfg.reset_dataloader)
            # (--finetune-from-model with --reset-* is fairseq's own error, raised on every rank.)
            if resumable and not (cfg.finetune_from_model is not None and resets):
                overrides = {"finetune_from_model": None, "continue_once": None}
            finetuning = (not resumable and cfg.finetune_from_model is not None
                          and getattr(cfg, "continue_once", None) is None)
            if finetuning and not os.path.exists(cfg.finetune_from_model):
                # fairseq checks that the path exists before it asks for it: point it at the set's
                # shared file, which loads the whole set (like --restore-file NAME.pt does).
                found = shards.locate(cfg.finetune_from_model)
                if found is not None and found[0] == "set":
                    overrides = {"finetune_from_model": shards.shared_path(found[1])}
        # Fine-tuning restarts the data; only then is the saved position not used (nor rescaled).
        with contextlib.ExitStack() as stack:
            stack.enter_context(_swapped(trainer, "_moe_reset_dataloader", cfg.reset_dataloader or finetuning))
            for key, value in overrides.items():
                if key in cfg:
                    stack.enter_context(_swapped(cfg, key, value))
            return load_checkpoint(cfg, trainer, **passthrough_args)

    Trainer.__init__ = init
    Trainer.checkpoint_suffix = property(checkpoint_suffix)
    Trainer.should_save_checkpoint_on_current_rank = property(should_save_on_this_rank)
    Trainer.state_dict = state_dict
    Trainer.save_checkpoint = save_sharded
    Trainer.load_checkpoint = load_sharded
    Trainer.moe_shards = True
    checkpoint_utils.save_checkpoint = save_checkpoint_sets
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.load_checkpoint = load_checkpoint_resolved
