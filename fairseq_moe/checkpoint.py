"""Safe loading of fairseq checkpoints with torch.load(weights_only=True).

torch >= 2.6 loads with weights_only=True, which refuses any class it was not told about.
A fairseq 0.12 checkpoint pickles one such class, argparse.Namespace (its "args"). We allow exactly
the classes listed here, so fairseq-generate and --restore-file work while an arbitrary pickled
object is still refused. Never switch weights_only off instead.
"""
import argparse
import os

import torch

SAFE_GLOBALS = [argparse.Namespace]


def register_safe_globals():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def install_expert_parallel_checkpointing():
    """Make fairseq's checkpoints keep every expert when the experts are spread over ranks.

    fairseq 0.12 writes a checkpoint from rank 0 alone, which holds only its own experts. Before
    each save, every rank takes part in gathering the experts to rank 0, whose state_dict then holds
    all E of them: a consolidated checkpoint, which loads at any world size (each rank takes its
    slice; fairseq-generate on one process takes all). The experts' optimizer state stays per rank
    and is not in it, so resuming expert-parallel training from it without --reset-optimizer is
    refused rather than silently giving every rank rank 0's Adam moments.
    """
    from fairseq import checkpoint_utils, trainer

    if getattr(checkpoint_utils.save_checkpoint, "gathers_experts", False):
        return
    save_checkpoint, load_checkpoint = checkpoint_utils.save_checkpoint, trainer.Trainer.load_checkpoint

    def save_with_all_experts(cfg, trainer_, epoch_itr, val_loss):
        layers = _spread_layers(trainer_.model)
        if not layers or cfg.no_save:
            return save_checkpoint(cfg, trainer_, epoch_itr, val_loss)
        from .moe.experts import gather_experts

        for layer in layers:  # the same order on every rank
            gather_experts(layer.experts, layer.ep.group)
        try:
            return save_checkpoint(cfg, trainer_, epoch_itr, val_loss)
        finally:
            for layer in layers:
                layer.experts.gathered = None

    def load_refusing_expert_optimizer(self, filename, reset_optimizer=False, *args, **kwargs):
        if _spread_layers(self.model) and not reset_optimizer and os.path.exists(filename):
            raise ValueError(
                f"{filename}: resuming expert-parallel training would give every rank the optimizer "
                f"state of rank 0's experts; the checkpoint keeps all expert weights but not their "
                f"per-rank optimizer state. Restart the optimizer with --reset-optimizer."
            )
        return load_checkpoint(self, filename, reset_optimizer, *args, **kwargs)

    save_with_all_experts.gathers_experts = True
    checkpoint_utils.save_checkpoint = save_with_all_experts
    trainer.Trainer.load_checkpoint = load_refusing_expert_optimizer


def _spread_layers(model):
    from .moe import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer) and m.ep is not None]
