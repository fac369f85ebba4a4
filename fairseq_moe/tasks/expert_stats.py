"""What the MoE tasks add to fairseq's: a check that the model has MoE layers, and the expert load file.

With --moe-stats-file, every --moe-stats-interval updates, one JSON line with each MoE layer's expert
load over the interval, from the counts of all ranks: {"update": U, "layers": {name: [fraction of the
assignments per expert]}, "tokens": {name: n}, "dropped": {name: fraction}, "entropy": {name: nats}}; a
multilingual task's line also has "pairs": {pair: {name: [fraction of that pair's assignments per expert]}}.
Validation and generation use the eval capacity (--moe-eval-capacity-token-fraction) with no help from
the task: MoE layers pick their capacity from model.training, which fairseq sets for them.
"""
import argparse
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from fairseq.dataclass import FairseqDataclass
from fairseq.distributed import utils as dist_utils

from fairseq_moe_layer.lockstep import lockstep
from fairseq_moe_layer.options import refusal, setting

from ..hooks import fsdp
from ..errors import FlagError
from ..models.moe_ffn import moe_blocks
from ..models.moe_transformer import at_update

logger = logging.getLogger(__name__)


@dataclass
class ExpertStatsConfig(FairseqDataclass):
    """The MoE tasks' settings (options.setting, as the layer's and the criterion's)."""
    moe_stats_file: Optional[str] = setting(None, "append per-layer expert load as JSON lines to this file",
                                            type=str)
    moe_stats_interval: int = setting(100, "updates between two lines of --moe-stats-file", ge=1)


class ExpertLoadLog:
    """Sums each MoE layer's per-expert demand, tokens, dropped and entropy (token-weighted) over an
    interval of updates on every rank; at the end of the interval the sums of all ranks are added up
    (a collective: every rank calls maybe_write at every update) and rank 0 writes the line."""

    def __init__(self, path, interval, pairs=None):
        bad = refusal(ExpertStatsConfig, argparse.Namespace(moe_stats_file=path, moe_stats_interval=interval))
        if bad:
            raise FlagError(bad)
        # Checked now: the first line is written only after --moe-stats-interval updates.
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FlagError(f"--moe-stats-file {path}: folder {folder} does not exist")
        if os.path.isdir(path):
            raise FlagError(f"--moe-stats-file {path} is a folder; name a file (lines are appended to it)")
        if os.path.exists(path) and not os.path.isfile(path):
            raise FlagError(f"--moe-stats-file {path} is not a regular file (a device or a pipe); name a file "
                            f"(lines are appended to it)")
        if not os.access(path if os.path.exists(path) else folder, os.W_OK):
            raise FlagError(f"--moe-stats-file {path}: "
                            + ("the file is not writable" if os.path.exists(path) else f"{folder} is not writable"))
        self.path, self.interval, self.failed, self.pairs = path, interval, False, pairs or []
        # layer -> [demand per expert..., tokens, dropped * tokens, entropy * tokens, demand per pair and expert...]
        self.sums = {}

    def add(self, model):
        """Add the latest forward's statistics of each layer, on the device (no read: maybe_write reads them)."""
        for name, block in moe_blocks(model):
            a = block.last_aux
            if a is not None:
                n, device = a.num_tokens, a.demand.device
                by_pair = block.last_label_demand
                if by_pair is None or by_pair.shape[0] != len(self.pairs):
                    by_pair = torch.zeros(len(self.pairs), block.moe.cfg.num_experts, device=device)
                dropped, _, entropy = a.statistics()
                counted = torch.stack([torch.full((), n, dtype=torch.float64, device=device), dropped.double() * n,
                                       entropy.double() * n])
                row = torch.cat([a.demand.detach().double(), counted, by_pair.double().reshape(-1)])
                self.sums[name] = self.sums.get(name, 0) + row

    def maybe_write(self, update_num, model):
        if update_num % self.interval:
            return
        # The same layout on every rank (a layer without a forward here counts zeros).
        P = len(self.pairs)
        layout = [(name, block.moe.cfg.num_experts * (1 + P) + 3) for name, block in moe_blocks(model)]
        device = next((s.device for s in self.sums.values()), torch.device("cpu"))
        flat = torch.cat([self.sums.get(name, torch.zeros(size, dtype=torch.float64, device=device))
                          for name, size in layout]).cpu()  # (one read of the device per interval)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":  # (NCCL reduces CUDA tensors only)
                on_gpu = flat.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(on_gpu)
                flat = on_gpu.cpu()
            else:
                dist.all_reduce(flat)
        self.sums = {}
        if dist_utils.get_global_rank() != 0 or not flat.any() or self.failed:
            return
        line = {"update": update_num, "layers": {}, "tokens": {}, "dropped": {}, "entropy": {}}
        if P:
            line["pairs"] = {pair: {} for pair in self.pairs}
        for (name, size), row in zip(layout, torch.split(flat, [size for _, size in layout])):
            E = (size - 3) // (1 + P)
            demand, (tokens, dropped, entropy) = row[:E], row[E:E + 3].tolist()
            by_pair = row[E + 3:].view(P, E) if P else None
            if by_pair is not None and by_pair.any():  # (a layer whose policy has no per-token choices: left out)
                for pair, d in zip(self.pairs, by_pair):
                    line["pairs"][pair][name] = (d / d.sum().clamp(min=1)).tolist()
            line["layers"][name] = (demand / demand.sum().clamp(min=1)).tolist()
            line["tokens"][name] = int(tokens)
            line["dropped"][name], line["entropy"][name] = dropped / max(tokens, 1), entropy / max(tokens, 1)
        size = os.path.getsize(self.path) if os.path.isfile(self.path) else 0
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # (a full disk): training goes on, without its statistics
            with contextlib.suppress(OSError):
                os.truncate(self.path, size)  # no half line: the lines before stay readable (plot)
            logger.warning(f"cannot append to --moe-stats-file {self.path} ({e.strerror or e}): expert statistics "
                           f"are no longer written in this run")
            self.failed = True  # (the other ranks still sum with it: the collective above stays)


class MoETaskMixin:
    """Put it first among a fairseq task's bases; moe_task_name: the name the task is registered under."""

    moves_routing_biases = True  # its optimizer_step does (what the refusals read, without importing tasks)

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.load_log = None
        # Every rank counts and checks the flags (so that all stop together on a bad one); rank 0 writes.
        # (getattr: an argparse task's Namespace from a converted checkpoint lacks the flags it never had)
        if getattr(cfg, "moe_stats_file", None):
            self.load_log = ExpertLoadLog(cfg.moe_stats_file, cfg.moe_stats_interval, self.stats_pairs())

    def stats_pairs(self):
        """The language pairs the statistics file groups expert use by (none here: a multilingual task's)."""
        return None

    def sentence_labels(self, sample):
        """[B] each sentence's index in stats_pairs() (-1 where it cannot tell), or None."""
        return None

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
        at_update(model, update_num)  # (LayerDrop: every rank skips the layers drawn for this update)
        labels = self.sentence_labels(sample) if self.load_log is not None and self.load_log.pairs else None
        blocks = [block for _, block in moe_blocks(model)]
        for block in blocks:
            if labels is not None:
                block.sentence_labels, block.label_count = labels, len(self.load_log.pairs)
            block.moe.ignored = ignore_grad  # (fairseq's dummy batch: its tokens count on no rank)
        try:
            out = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        finally:
            for block in blocks:
                block.sentence_labels, block.moe.ignored = None, False
        for block in blocks:  # (the global balance loss: this micro-batch's counts join the update's)
            block.moe.add_global_counts()
        if self.load_log is not None and not ignore_grad:
            self.load_log.add(model)  # each micro-batch of --update-freq
        return out

    def valid_step(self, sample, model, criterion):
        # With the experts spread, --eval-bleu's beam search takes a different number of steps on each rank:
        # the MoE layers keep the ranks in lockstep for the step, and drain at its end (before fairseq gathers
        # the logging outputs). Without spread experts this changes nothing.
        with lockstep(model):
            return super().valid_step(sample, model, criterion)

    def _inference_with_bleu(self, generator, sample, model):  # (translation tasks' --eval-bleu)
        with fsdp.gathered(model):
            return super()._inference_with_bleu(generator, sample, model)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        for _, block in moe_blocks(model):  # every rank, in the same order (a collective per biased layer)
            block.moe.update_routing_bias()
        if self.load_log is not None:
            # Once per update; update_num counts finished updates, so this one is update_num + 1.
            self.load_log.maybe_write(update_num + 1, model)
