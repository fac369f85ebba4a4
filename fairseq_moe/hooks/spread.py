"""fairseq-generate with the experts spread over the ranks of a launched job:

    torchrun --nproc-per-node W $(which fairseq-generate) DATA --user-dir fairseq_moe --path CKPT.pt ...
    python -m fairseq_moe.launch --nproc W -- fairseq-generate DATA --user-dir fairseq_moe --path CKPT.pt ...
    srun --ntasks W fairseq-generate DATA --user-dir fairseq_moe --path CKPT.pt --distributed-port P ...

fairseq-eval-lm on the ranks of a job (spread_eval_lm): the layers in lockstep, the perplexity of the whole set.
fairseq-interactive on the ranks of a job (shared_input, rank0_print): rank 0 reads the input and sends each
buffer to every rank; every rank translates it all (the experts spread: each expert sees the tokens of every
rank, so all compute the same), in lockstep; rank 0 alone prints.

fairseq's generate runs one independent process per rank. Here (patches.py: fairseq_cli.generate._main), when
the job has several ranks: the process group is made (gloo on CPU, nccl on CUDA); the model is built with its
experts spread (models/moe_transformer.build_expert_parallel) and each rank reads the shared file and its own
experts only (checkpoint.load_checkpoint_to_cpu; a set of another world size is cut on load); the test set is
cut into W shards, as fairseq cuts it for data parallelism; the MoE layers keep the ranks in lockstep
(fairseq_moe_layer/lockstep.py) while their beam searches take different numbers of steps, and a rank that is
done serves the others until all are; rank 0 writes every rank's per-sentence lines, by sentence id, then the
score line, computed over all sentences (GatheringScorer).
"""
import functools
import inspect
import io
import math
import os
import re
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fairseq_moe_layer import lockstep

from .. import patches
from .compat import leave_now, one_rank_of_a_job, slurm_as_torchrun
from ..errors import FlagError

SENTENCE = re.compile(r"^[A-Z]-(\d+)[\t_]")  # generate's per-sentence lines: S-12, H-12, ..., E-12_3 (steps)


def launched_world(port):
    """(rank, world size) of a launched job (torchrun, fairseq_moe.launch, srun: its tasks meet on port, the
    --distributed-port) with several ranks, else None."""
    slurm_as_torchrun(port)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 2 or "RANK" not in os.environ or not one_rank_of_a_job():
        return None
    return int(os.environ["RANK"]), world


def start(cfg, rank, world):
    """The job's process group, and fairseq's config told about it (the data shards follow it)."""
    from fairseq.utils import split_paths

    if len(split_paths(cfg.common_eval.path)) > 1 or getattr(cfg.generation, "lm_path", None):
        raise FlagError("--path with several models (or --lm-path) cannot run on several ranks: with the experts "
                        "spread, generate with one model at a time")
    cuda = torch.cuda.is_available() and not cfg.common.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.distributed_training.heartbeat_timeout
                                              if cfg.distributed_training.heartbeat_timeout > 0 else 1800))
    cfg.distributed_training.distributed_world_size = world
    cfg.distributed_training.distributed_rank = rank


class SentenceLines(io.TextIOBase):
    """generate's output file on one rank: the per-sentence lines are kept for rank 0 to write (merge), every
    other line goes on at once (rank 0: to the output; the other ranks: to stderr)."""

    def __init__(self, passthrough):
        self.passthrough, self.kept, self.partial, self.merged = passthrough, [], "", False
        self.adds = []  # what the scorer was given here (GatheringScorer)
        self.all_adds = None  # after merge, on rank 0: those of every rank (elsewhere: this rank's)

    def write(self, text):
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            if SENTENCE.match(line):
                self.kept.append(line)
            else:
                self.passthrough.write(line + "\n")
        return len(text)

    def flush(self):
        self.passthrough.flush()

    def merge(self, steps):
        """The one collective of the world after the generation (every rank calls it once, after the layers'
        lockstep has drained, whether or not its scorer asks for a score): rank 0 gets every rank's sentence
        lines and scorer additions, and writes the lines ordered by sentence id (a sentence's lines in the
        order they were written)."""
        if self.merged:
            return
        self.merged = True
        lockstep.drain_all(steps)
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((self.kept, self.adds), every, dst=0)
        if dist.get_rank() != 0:
            self.all_adds = self.adds
            return
        self.all_adds = [pair for _, adds in every for pair in adds]
        lines = [line for kept, _ in every for line in kept]
        lines.sort(key=lambda line: int(SENTENCE.match(line).group(1)))  # (stable)
        for line in lines:
            self.passthrough.write(line + "\n")
        self.passthrough.flush()


class GatheringScorer:
    """fairseq's scorer for one rank: what generate adds is kept (in the SentenceLines), and on rank 0 the score
    is the real scorer's over the additions of every rank (the other ranks have none to give)."""

    def __init__(self, make, out, steps):
        self.make, self.out, self.steps, self.total = make, out, steps, None
        if hasattr(make(), "add_string"):  # (generate calls add_string where the scorer has it)
            self.add_string = lambda ref, pred: self.out.adds.append((ref, pred))

    def add(self, ref, pred):
        self.out.adds.append((ref.tolist(), pred.tolist()))

    def all_ranks(self):
        if self.total is None:
            self.out.merge(self.steps)  # the sentence lines come before the score line
            self.total = self.make()
            for ref, pred in self.out.all_adds:
                if isinstance(ref, str):
                    self.total.add_string(ref, pred)
                else:
                    self.total.add(torch.tensor(ref, dtype=torch.int), torch.tensor(pred, dtype=torch.int))
        return self.total

    def result_string(self, *args, **kwargs):
        total = self.all_ranks()
        if dist.get_rank() != 0:  # (its own shard may be empty, where fairseq's scorers divide by zero)
            return "the score over every rank's sentences is rank 0's"
        return total.result_string(*args, **kwargs)

    def score(self, *args, **kwargs):
        total = self.all_ranks()
        return total.score(*args, **kwargs) if dist.get_rank() == 0 else math.nan


class _NoSeconds(float):
    """0 seconds that can be divided by (giving 0): fairseq's generate divides by the time it spent, which is 0
    on a rank whose shard is empty (fewer batches than ranks)."""

    def __rtruediv__(self, other):
        return 0.0


def stopwatch():
    """generate's StopwatchMeter, for a rank that may not time anything."""
    from fairseq.logging.meters import StopwatchMeter

    meter = StopwatchMeter()
    meter.sum = _NoSeconds(0.0)
    return meter


def spread_generate(_main):
    """fairseq_cli.generate._main on every rank of a launched job (see above); elsewhere as it is."""
    @functools.wraps(_main)
    def wrapped(cfg, output_file):
        job = launched_world(cfg.distributed_training.distributed_port)
        if job is None or dist.is_initialized():
            return _main(cfg, output_file)
        from fairseq import scoring

        start(cfg, *job)
        out = SentenceLines(output_file if job[0] == 0 else sys.stderr)
        build = scoring.build_scorer
        try:
            with lockstep.inference() as steps:
                def gathering(choice, tgt_dict):
                    return GatheringScorer(functools.partial(build, choice, tgt_dict), out, steps)

                generate = sys.modules[_main.__module__]
                with patches.scoped(scoring, "build_scorer", gathering), \
                        patches.scoped(generate, "StopwatchMeter", stopwatch):
                    result = _main(cfg, out)
                out.merge(steps)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        output_file.flush()
        if os.path.basename(sys.argv[0]) in ("fairseq-generate", "generate.py"):  # (the tool itself, not a program
            leave_now(0)  # that calls it: the interpreter's teardown is where gloo ranks abort, compat.py)
        return result

    return wrapped


def spread_eval_lm(eval_lm):
    """fairseq_cli.eval_lm.eval_lm on the ranks of a job (fairseq-eval-lm runs through fairseq's distributed_main,
    each rank on its shard): the MoE layers in lockstep, and the loss and perplexity of the whole set rather than
    of this rank's shard (each rank's sum of log-probabilities and token count, added up)."""
    @functools.wraps(eval_lm)
    def wrapped(models, *args, **kwargs):
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return eval_lm(models, *args, **kwargs)
        given = inspect.signature(eval_lm).bind(models, *args, **kwargs)
        given.apply_defaults()
        if given.arguments["post_process"] is not None:
            raise FlagError("--post-process cannot be used by fairseq-eval-lm on several ranks (its merged "
                            "subwords change the token count that the ranks' losses are weighted by)")
        if given.arguments["output_word_probs"] or given.arguments["output_word_stats"]:
            raise FlagError("--output-word-probs and --output-word-stats cannot be used by fairseq-eval-lm on "
                            "several ranks (each rank would print its own shard's words); use one process")
        if len(models) > 1:
            raise FlagError("--path with several models cannot be evaluated on several ranks: one at a time")
        module = sys.modules[eval_lm.__module__]
        counted = []

        class Counting(module.SequenceScorer):
            """generate's tokens, counted as eval_lm counts them (inf scores skipped, bos removed)."""

            def generate(self, models, sample, **kw):
                hypos = super().generate(models, sample, **kw)
                for hypo in hypos:
                    scores = hypo[0]["positional_scores"][1 if given.arguments["remove_bos_token"] else 0:]
                    counted.append(int((~scores.float().isinf()).sum()))
                return hypos

        with lockstep.lockstep(models[0]), patches.scoped(module, "SequenceScorer", Counting):
            results = eval_lm(models, *args, **kwargs)
        count = sum(counted)
        device = next(models[0].parameters()).device
        total = torch.tensor([-results["loss"] * math.log(2) * count, count], dtype=torch.float64,
                             device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(total)
        loss = float(-total[0] / total[1] / math.log(2)) if total[1] > 0 else 0.0
        return dict(results, loss=loss, perplexity=2 ** loss)

    return wrapped


def context_in_order(eval_lm_dataloader):
    """LanguageModelingTask.eval_lm_dataloader with --context-window on several ranks: each batch's context is the
    previous batch's last tokens (LMContextWindowDataset keeps them as it collates), which fairseq's shards break
    (a rank's batches are every W-th; its filler batch, collated empty, is a KeyError). Here every rank collates
    the whole set in order, as one process does, and keeps every W-th batch (no filler: its layers serve the
    others once it is done), so each token is scored with one process's context and the perplexity is one
    process's."""
    @functools.wraps(eval_lm_dataloader)
    def wrapped(self, dataset, *args, num_shards=1, shard_id=0, context_window=0, **kwargs):
        if context_window <= 0 or num_shards <= 1:
            return eval_lm_dataloader(self, dataset, *args, num_shards=num_shards, shard_id=shard_id,
                                      context_window=context_window, **kwargs)
        from fairseq.data.iterators import CountingIterator

        whole = eval_lm_dataloader(self, dataset, *args, num_shards=1, shard_id=0, context_window=context_window,
                                   **kwargs)
        mine = (batch for i, batch in enumerate(whole) if i % num_shards == shard_id)
        return CountingIterator(mine, total=len(range(shard_id, len(whole), num_shards)))

    return wrapped


def shared_input(buffered_read):
    """fairseq_cli.interactive.buffered_read on the ranks of a job: rank 0 reads, every rank gets each buffer; the
    model's layers are in lockstep while a buffer is translated, and drained before the next is sent."""
    @functools.wraps(buffered_read)
    def wrapped(input, buffer_size):
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            yield from read_input(buffered_read, input, buffer_size)
            return
        steps = lockstep.live_ones()
        if len(steps) > 1:
            raise FlagError("--path with several models cannot run on several ranks: with the experts spread, "
                            "translate with one model at a time")
        chunks = read_input(buffered_read, input, buffer_size) if dist.get_rank() == 0 else None
        try:
            while True:
                lockstep.drain_all(steps)  # (every rank between two buffers: the broadcast is not an MoE call)
                box = [next(chunks, None) if chunks is not None else None]
                dist.broadcast_object_list(box, src=0)
                if box[0] is None:
                    return
                for step in steps:
                    step.on = True
                yield box[0]
        finally:
            for step in steps:
                step.on = False

    return wrapped


def read_input(buffered_read, input, buffer_size):
    """fairseq's buffered_read; stdin closed (`0<&-`: Python's sys.stdin is None, where fileinput fails with an
    AttributeError) is an input with nothing to translate, as `< /dev/null` is."""
    if input == "-" and sys.stdin is None:
        return iter(())
    return buffered_read(input, buffer_size)


def rank0_print(*args, **kwargs):
    """print for fairseq_cli.interactive: on the ranks of a job, rank 0 alone prints (every rank translates
    the same sentences)."""
    if "file" not in kwargs and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(*args, **kwargs)
