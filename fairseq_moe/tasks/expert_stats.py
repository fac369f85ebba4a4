"""What the MoE tasks add to fairseq's: a check that the model has MoE layers, and the expert load file.

With --moe-stats-file, the expert load of every MoE layer is written every --moe-stats-interval
updates as one JSON line: {"update": U, "layers": {name: [fraction per expert]}, "tokens": {name: n}}.
Validation and generation use the eval capacity (--moe-eval-capacity-token-fraction) with no help from
the task: MoE layers pick their capacity from model.training, which fairseq sets for them.
"""
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.distributed import utils as dist_utils

from ..errors import FlagError
from ..models.moe_ffn import moe_blocks

logger = logging.getLogger(__name__)


@dataclass
class ExpertStatsConfig(FairseqDataclass):
    moe_stats_file: Optional[str] = field(default=None, metadata={
        "help": "append per-layer expert load as JSON lines to this file"})
    moe_stats_interval: int = field(default=100, metadata={"help": "updates between two lines of --moe-stats-file"})


class ExpertLoadLog:
    """Sums each MoE layer's per-expert demand over an interval of updates, then writes a line."""

    def __init__(self, path, interval):
        if interval < 1:
            raise FlagError(f"--moe-stats-interval must be >= 1, got {interval}")
        # Checked now: the first line is written only after --moe-stats-interval updates.
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FlagError(f"--moe-stats-file {path}: folder {folder} does not exist")
        if os.path.isdir(path):
            raise FlagError(f"--moe-stats-file {path} is a folder; name a file (lines are appended to it)")
        if not os.access(path if os.path.exists(path) else folder, os.W_OK):
            raise FlagError(f"--moe-stats-file {path}: "
                            + ("the file is not writable" if os.path.exists(path) else f"{folder} is not writable"))
        self.path, self.interval = path, interval
        self.sums, self.tokens = {}, {}

    def add(self, model):
        for name, block in moe_blocks(model):
            if block.last_aux is not None:
                demand = block.last_aux.demand.detach().to("cpu", torch.float64)
                self.sums[name] = self.sums.get(name, 0) + demand
                self.tokens[name] = self.tokens.get(name, 0) + block.last_aux.num_tokens

    def maybe_write(self, update_num):
        if update_num % self.interval or not self.sums:
            return
        layers = {name: (s / s.sum().clamp(min=1)).tolist() for name, s in self.sums.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"update": update_num, "layers": layers, "tokens": self.tokens}) + "\n")
        self.sums, self.tokens = {}, {}


class MoETaskMixin:
    """Put it first among a fairseq task's bases; moe_task_name: the name the task is registered under."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.load_log = None
        # Rank 0 writes the file (its own counts; data-parallel ranks see similar loads).
        # Every rank checks the flags, so that all stop together on a bad one.
        if cfg.moe_stats_file:
            log = ExpertLoadLog(cfg.moe_stats_file, cfg.moe_stats_interval)
            self.load_log = log if dist_utils.get_global_rank() == 0 else None

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if not moe_blocks(model):
            raise FlagError(f"--task {self.moe_task_name} needs a model with MoE layers; "
                             f"--arch {getattr(cfg, 'arch', '?')} has none")
        return model

    def build_criterion(self, *args, **kwargs):
        criterion = super().build_criterion(*args, **kwargs)
        if not hasattr(criterion, "moe_cfg"):  # MoECriterionMixin's
            logger.warning("--criterion %s adds no router losses (balance loss, z-loss): the gates learn from "
                           "the task loss alone; moe_cross_entropy and moe_label_smoothed_cross_entropy add "
                           "them", type(criterion).__name__)
        return criterion

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        out = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        if self.load_log is not None and not ignore_grad:
            self.load_log.add(model)  # each micro-batch of --update-freq
        return out

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        if self.load_log is not None:
            # Once per update; update_num counts finished updates, so this one is update_num + 1.
            self.load_log.maybe_write(update_num + 1)
