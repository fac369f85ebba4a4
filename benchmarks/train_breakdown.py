"""Where a fairseq-train update's time goes, by wall-clock timers around fairseq's own calls (no profiler: torch's
profiler changes what the allocator reuses, and showed ops of the dense layers 3x slower than they run untimed).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_breakdown.py            # bench_fairseq_train's MoE, bf16
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_breakdown.py --dense    # its dense twin
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_breakdown.py --no-one-pass   # bf16 experts' masters by
                                                                                 # torch's ops (hooks/masters.py)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_breakdown.py --updates 120   # and per 20 updates

One fairseq-train, in this process, on bench_fairseq_train.py's model and random words (its flags: --experts,
--tokens, --updates, --smoke...; bf16 unless --fp32). Per update, the median after the first 5: the whole train_step, the
forward and backward (the task's train_step), the backward alone, the optimizer's clip_grad_norm and step; per
decoder layer and per MoE layer, forward and backward (stamps on each one's input and output gradients). Then
each MoE layer again in the same process on random input of the same shape (its router balanced by chance: the
cost of its routing as trained so far shows as the difference) and on its last training input and output gradient
(nearly that update's routing, so mostly GEMM shapes it has met: the router moved by the update's step), and the
expert counts of its last training forward. With 40 updates or more, also the medians per 20 updates of train_step
and of each MoE layer's forward and backward.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fairseq_train  # noqa: E402

TIMES = {}


def record(key, seconds):
    TIMES.setdefault(key, []).append(seconds)


ACTIVE = set()  # keys being timed: a call within one (a subclass's step calling its parent's) is not counted again


def timed(cls, name, key):
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if key in ACTIVE:
            return original(self, *args, **kwargs)
        ACTIVE.add(key)
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            ACTIVE.discard(key)
            record(key, time.perf_counter() - start)

    setattr(cls, name, wrapper)


class Stamp(torch.autograd.Function):
    """Identity; its backward notes when the gradient reached it."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        record(ctx.key, time.perf_counter())
        return grad, None


def stamped(module, name, first_output):
    """module.forward timed, and its backward from the stamps on its output's and input's gradients."""
    original = module.forward

    def forward(x, *args, **kwargs):
        start = time.perf_counter()
        out = original(Stamp.apply(x, ("in", name)), *args, **kwargs)
        record(("fwd", name), time.perf_counter() - start)
        if first_output:
            return (Stamp.apply(out[0], ("out", name)),) + tuple(out[1:])
        return out

    module.forward = forward


WINDOW = 20  # updates per line of the report's windows (runs of 40 updates or more)


def median_ms(values, skip=5):
    values = values[skip:] or values  # (--smoke: fewer updates than skip)
    return 1e3 * statistics.median(values)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", action="store_true", help="the dense twin")
    p.add_argument("--no-one-pass", action="store_true",
                   help="bf16 experts' masters by torch's ops, not fairseq_moe_kernels/cpu_adam")
    p.add_argument("--fp32", action="store_true", help="without --bf16")
    args, rest = p.parse_known_args(argv)
    if args.no_one_pass and (args.dense or args.fp32):
        p.error("--no-one-pass is about the MoE model's bf16 experts: not with --dense or --fp32")
    bench = bench_fairseq_train.parser().parse_args(rest)
    defaults = bench_fairseq_train.parser().parse_args([])
    for flag in ("rounds", "json", "bf16"):  # (bench_fairseq_train's, meaningless for one timed run here: any spelling)
        if getattr(bench, flag) != getattr(defaults, flag):
            p.error(f"--{flag} is bench_fairseq_train.py's: this tool times one run, in bf16 unless --fp32, and prints")
    if not (args.dense or args.fp32 or args.no_one_pass):
        from fairseq_moe_kernels import cpu_adam

        if not cpu_adam.available():
            p.error("the one pass (fairseq_moe_kernels/cpu_adam) does not run here: "
                    f"{cpu_adam.unavailable_reason()}; pass --no-one-pass to time torch's ops")
    bench.bf16 = not args.fp32
    bench = bench_fairseq_train.smoke_sizes(bench)
    with tempfile.TemporaryDirectory(prefix="train_breakdown_") as tmp:
        data = bench_fairseq_train.corpus(Path(tmp))
        run(args, bench_fairseq_train.train_argv(bench, data, not args.dense, False)[3:])


def run(args, argv):
    from fairseq import options
    from fairseq import trainer as fairseq_trainer
    from fairseq.distributed import utils as distributed_utils
    from fairseq.optim import fairseq_optimizer, fp16_optimizer
    from fairseq.tasks import fairseq_task
    from fairseq_cli import train

    sys.argv = ["fairseq-train", *argv]  # (fairseq's parser imports --user-dir from sys.argv: the plugin's patches
    parser = options.get_training_parser()  # first, these timers around them)
    parsed = options.parse_args_and_arch(parser)
    timed(fairseq_trainer.Trainer, "train_step", "train_step")
    timed(fairseq_task.FairseqTask, "train_step", "forward+backward")
    for cls in (fp16_optimizer._FP16OptimizerMixin, fairseq_optimizer.FairseqOptimizer):  # (bf16's, fp32's)
        for name in ("backward", "clip_grad_norm", "step"):
            timed(cls, name, name)
    models = []
    build = fairseq_trainer.Trainer.__init__

    def trainer_init(self, cfg, task, model, *a, **kw):
        for i, layer in enumerate(model.decoder.layers):
            stamped(layer, f"decoder layer {i}", True)
        models.append(model)
        build(self, cfg, task, model, *a, **kw)

    fairseq_trainer.Trainer.__init__ = trainer_init
    layers = []
    if not args.dense:
        from fairseq_moe.hooks import masters
        from fairseq_moe_kernels import cpu_adam

        timed(masters.ExpertMasters, "step", "step")  # (the one pass runs there, before fairseq's step)
        from fairseq_moe_layer import layer as moe_layer

        if args.no_one_pass:
            cpu_adam.available = lambda: False
        original = moe_layer.MoELayer.forward

        def moe_forward(self, x, *a, **kw):
            if self not in layers:
                layers.append(self)
            name = f"MoE layer {layers.index(self)}"
            start = time.perf_counter()
            y, aux = original(self, Stamp.apply(x, ("in", name)), *a, **kw)
            record(("fwd", name), time.perf_counter() - start)
            if self.training:
                self.last_counts, self.last_input = aux.counts.tolist(), x.detach().clone()
                y.register_hook(lambda g: setattr(self, "last_grad", g.detach().clone()))
            return Stamp.apply(y, ("out", name)), aux

        moe_layer.MoELayer.forward = moe_forward
    distributed_utils.call_main(train.convert_namespace_to_omegaconf(parsed), train.main)  # (the tool's: patched)
    report(args, layers)


def report(args, layers):
    counted = max(len(TIMES["train_step"]) - 5, 0) or len(TIMES["train_step"])
    print(f"\nper update, median of {counted} updates (the first 5 left out where there are more), ms:")
    print(f"  {'fp32' if args.fp32 else 'bf16'}, {'dense' if args.dense else 'MoE'}"
          + ("" if args.dense or args.fp32 else ", experts' masters by " + (
              "torch's ops (--no-one-pass)" if args.no_one_pass else "fairseq_moe_kernels/cpu_adam's one pass")))
    for key in ("train_step", "forward+backward", "backward", "clip_grad_norm", "step"):
        if key in TIMES:
            print(f"  {key:20s} {median_ms(TIMES[key]):8.1f}")
    names = [k[1] for k in TIMES if isinstance(k, tuple) and k[0] == "fwd"]
    for name in names:
        backward = [a - b for a, b in zip(TIMES[("in", name)], TIMES[("out", name)])]
        print(f"  {name:20s} forward {median_ms(TIMES[('fwd', name)]):7.1f}  backward {median_ms(backward):7.1f}")
    updates = len(TIMES["train_step"])
    if updates >= 2 * WINDOW:  # (how the time per update moves over a longer run: oneDNN's kernels for new shapes)
        print(f"per {WINDOW} updates (median ms; the first window with the warm-up):")
        for lo in range(0, updates - WINDOW + 1, WINDOW):
            cells = [f"train_step {1e3 * statistics.median(TIMES['train_step'][lo:lo + WINDOW]):7.1f}"]
            for name in names:
                if name.startswith("MoE"):
                    fwd = TIMES[("fwd", name)][lo:lo + WINDOW]
                    bwd = [a - b for a, b in zip(TIMES[("in", name)][lo:lo + WINDOW], TIMES[("out", name)][lo:lo + WINDOW])]
                    cells.append(f"{name} {1e3 * statistics.median(fwd):6.1f} + {1e3 * statistics.median(bwd):6.1f}")
            print(f"  updates {lo + 1:4d}-{lo + WINDOW:<4d} " + "  ".join(cells))
    for i, layer in enumerate(layers):
        layer.train()  # (as in training: its activation dropout)
        counts = layer.last_counts  # (the training forward's: the replays below record theirs too)
        shape, dtype = layer.last_input.shape, layer.last_input.dtype
        noise = (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
        inputs = {f"random input of {tuple(shape)}": noise,
                  "its last training input and output gradient": (layer.last_input, layer.last_grad)}
        for what, (x, grad) in inputs.items():
            x = x.detach().requires_grad_()
            forward, backward = [], []
            for _ in range(8):
                for p in layer.parameters():
                    p.grad = None
                start = time.perf_counter()
                y, aux = layer(x)
                middle = time.perf_counter()
                torch.autograd.backward([y, aux.balance_loss], [grad.to(y.dtype), torch.ones_like(aux.balance_loss)])
                forward.append(middle - start)
                backward.append(time.perf_counter() - middle)
            print(f"  MoE layer {i} on {what}: forward {median_ms(forward, 3):7.1f}  backward "
                  f"{median_ms(backward, 3):7.1f}")
        print(f"  MoE layer {i}: tokens per expert in its last training forward, sorted: {sorted(counts)}")


if __name__ == "__main__":
    main()
