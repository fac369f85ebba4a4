"""Forward+backward time and activation memory of MoELayer against its dense equivalent (CPU).

The dense equivalent is k dense FFNs of size d x f (Linear(d, f) -> relu -> Linear(f, d)) applied to
the same T tokens and summed: the FLOPs of a top-k MoE layer without any routing. Both are timed
in the same process, interleaved (moe, dense, moe, dense, ...) after a warm-up, and the median
over --reps repetitions is reported.

Memory: the bytes of the tensors that forward saves for backward (saved_tensors_hooks, deduplicated
by storage, parameters and the input x excluded), cross-checked by glibc's malloc counters (bytes
still in use after forward minus before it: the saved tensors plus the outputs).

    .venv/bin/python benchmarks/bench_layer.py                      # full grid
    .venv/bin/python benchmarks/bench_layer.py --E 8 --T 1024 --reps 3
    .venv/bin/python benchmarks/bench_layer.py --E 128 --T 16384 --profile   # + stage breakdown
    .venv/bin/python benchmarks/bench_layer.py --E 8 --T 4096 --f 1024 --dropless --autocast bf16   # both under autocast
    .venv/bin/python benchmarks/bench_layer.py --E 8 32 128 --T 16384 --dropless --dtype bf16   # both models in bf16

The routing policies' overhead is measured by bench_routing.py (beside this script, on its timing).

See benchmarks/README.md for what each column means.
"""
import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.autograd.graph import saved_tensors_hooks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fairseq_moe_layer import MoEConfig, MoELayer, malloc  # noqa: E402
from kernel_cases import DenseFFNs  # noqa: E402  (beside this script: the same baseline as bench_kernels)
import fairseq_moe_layer.layer as layer_module  # noqa: E402

# Targets at the largest T of the grid (16384 by default): time ratio per E, and memory ratio.
TIME_TARGETS = {8: 1.15, 32: 1.3, 128: 1.6}
AUTOCAST_TIME_TARGET = 1.3  # --autocast, every E (issue 32: E=8, T=4096, f=1024, top-2 dropless)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MEMORY_TARGET = 1.5
BALANCE_COEF, Z_COEF = 0.01, 0.001  # loss weights of the aux losses in the MoE backward
MB = 2**20


def parser(description, E=(8, 32, 128), T=(4096, 16384)):
    """The flags of a layer timing (this script's and bench_routing.py's)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--E", type=int, nargs="+", default=list(E), help="numbers of experts")
    p.add_argument("--T", type=int, nargs="+", default=list(T), help="numbers of tokens")
    p.add_argument("--d", type=int, default=512, help="model dim")
    p.add_argument("--f", type=int, default=2048, help="ffn dim (of each expert and dense FFN)")
    p.add_argument("--k", type=int, default=2, help="top-k (= number of dense FFNs summed)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each before timing")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    p.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: process CPU time (robust to a busy machine with "
                        "--threads 1; with more threads it also counts OpenMP spin-waiting)")
    p.add_argument("--dropless", action="store_true", help="capacity_factor=0 (no token dropped)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="ignored with --dropless")
    p.add_argument("--json", metavar="PATH", help="write the results (and the settings) here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "torch", "grouped_mm"), default="auto",
                   help="--moe-kernel-backend of the layer (auto: torch on the CPU)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc keeps freed memory for reuse (fairseq_moe_layer/malloc.py, for both models): a "
                        "step's fresh gradient buffers then cost far fewer page faults, as with jemalloc or tcmalloc; "
                        "by default glibc maps every block over 32 MB anew")
    p.add_argument("--tutel", action="store_true",
                   help="also time Tutel's moe_layer (its top-k gate and FFN experts, the same E, f, k and "
                        "capacity factor, 0: dropless) in the same interleaving, against the same dense baseline "
                        "(needs tutel importable)")
    return p


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--profile", action="store_true",
                   help="also profile one MoE step per config and print where its time goes")
    p.add_argument("--autocast", choices=sorted(AUTOCAST), default=None,
                   help="run both models' forwards under torch.autocast('cpu', DTYPE), fp32 weights (the backward "
                        "outside it, as a training step does); default: fp32, no autocast")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="both models' weights, input and gradients (bf16: what the plugin's --bf16 trains; the "
                        "gate's logits and the losses stay fp32)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.profile and args.autocast:
        p.error("--profile profiles the fp32 step: not with --autocast")
    if args.autocast and args.dtype != "fp32":
        p.error("--autocast runs fp32 weights: not with --dtype " + args.dtype)
    return args


# ---------------------------------------------------------------------------------------------
# The two models and one training step of each


def _clear_grads(module, x):
    # set_to_none, like optimizer.zero_grad() by default: each backward allocates fresh grads.
    for p in module.parameters():
        p.grad = None
    x.grad = None


def moe_forward(layer, x):
    y, aux = layer(x)
    return y, aux


def moe_backward(out, grad_y):
    y, aux = out
    losses = [(loss, torch.tensor(coef)) for loss, coef in ((aux.balance_loss, BALANCE_COEF), (aux.z_loss, Z_COEF))
              if loss.requires_grad]  # (hash routing has no router: nothing to backpropagate into)
    torch.autograd.backward([y, *(l for l, _ in losses)], [grad_y.to(y.dtype), *(c for _, c in losses)])


def under_autocast(forward, dtype):
    """forward(model, x) run under torch.autocast("cpu", dtype); dtype None: forward itself."""
    if dtype is None:
        return forward

    def autocast_forward(model, x):
        with torch.autocast("cpu", dtype):
            return forward(model, x)
    return autocast_forward


def tutel_moe():
    """Tutel's tutel.moe, or exit naming the flag."""
    try:
        from tutel import moe
    except ImportError as e:
        sys.exit(f"--tutel: tutel is not importable here ({e})")
    return moe


def tutel_layer(args, E):
    """Tutel's MoE layer of the same shapes (one process: all E experts local)."""
    cf = 0.0 if args.dropless else args.capacity_factor  # (Tutel's 0 is dropless too)
    return tutel_moe().moe_layer(
        gate_type={"type": "top", "k": args.k, "capacity_factor": cf, "fp32_gate": True},
        experts={"type": "ffn", "count_per_node": E, "hidden_size_per_expert": args.f,
                 "activation_fn": torch.nn.functional.relu},
        model_dim=args.d, seeds=(args.seed, args.seed + 1, args.seed + 2))


def tutel_forward(layer, x):
    """Tutel's layer returns y, its balance loss on y.l_aux."""
    return layer(x)


def tutel_backward(y, grad_y):
    """As moe_backward, with Tutel's one aux loss (GShard's balance loss) at our weight."""
    torch.autograd.backward([y, y.l_aux], [grad_y.to(y.dtype), torch.tensor(BALANCE_COEF)])


def dense_forward(dense, x):
    return dense(x)


def dense_backward(y, grad_y):
    y.backward(grad_y.to(y.dtype))


_CLOCK = time.perf_counter


def timed_step(forward, backward, model, x, grad_y):
    _clear_grads(model, x)
    gc.collect()
    t0 = _CLOCK()
    out = forward(model, x)
    backward(out, grad_y)
    t1 = _CLOCK()
    del out
    return (t1 - t0) * 1e3


def interleaved(args, *steps):
    """--warmup untimed then --reps timed steps of each (forward, backward, model, x, grad_y), interleaved
    (a, b, a, b, ...); -> one list of ms per step."""
    for _ in range(args.warmup):
        for step in steps:
            timed_step(*step)
    times = [[] for _ in steps]
    for _ in range(args.reps):
        for ms, step in zip(times, steps):
            ms.append(timed_step(*step))
    return times


# ---------------------------------------------------------------------------------------------
# Memory


def _malloc_in_use():
    """The bytes glibc malloc has handed out and not freed, or None without glibc's mallinfo2."""
    got = malloc.info()
    return None if got is None else got.uordblks + got.hblkhd  # small blocks in arenas + mapped large blocks


_MALLOC_IN_USE = _malloc_in_use if malloc.info() is not None else None


def saved_activation_bytes(forward, model, x):
    """(bytes saved for backward by one forward, bytes malloc holds after forward - before).

    Saved bytes: every tensor autograd saves passes through a pack hook; the storages are summed
    once each (a view and its base count once, by storage data_ptr), leaving out the parameters and
    the input x (they exist whether or not a graph is kept). Malloc bytes (None if glibc's
    mallinfo2 is unavailable): the same saved tensors, plus the outputs, plus anything a forward
    keeps alive outside autograd; temporaries freed inside forward do not count.
    """
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded.add(x.untyped_storage().data_ptr())
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in excluded and ptr not in storages:
            storages[ptr] = s.nbytes()
        return t

    _clear_grads(model, x)
    gc.collect()
    before = _MALLOC_IN_USE() if _MALLOC_IN_USE else None
    with saved_tensors_hooks(pack, lambda t: t):
        out = forward(model, x)
    gc.collect()
    after = _MALLOC_IN_USE() if _MALLOC_IN_USE else None
    del out
    retained = None if before is None else after - before
    return sum(storages.values()), retained


# ---------------------------------------------------------------------------------------------
# Profile: where the time of one MoE forward+backward goes


def _scope(name, fn):
    def wrapped(*a, **kw):
        with torch.profiler.record_function(name):
            return fn(*a, **kw)

    return wrapped


@contextlib.contextmanager
def _stage_scopes(layer):
    """Wrap each stage of MoELayer.forward in a record_function scope (restored on exit).

    Runtime instrumentation only: the layer's code is not changed, the callables it uses are
    wrapped where they exist: the gate, route, permute / grouped MLP / unpermute (the unfused path),
    experts.combine (the fused permute + grouped MLP + weighted unpermute, "moe_mlp"), aux losses.
    """
    undo = []

    def wrap(obj, attr, name):
        fn = getattr(obj, attr, None)
        if fn is None:
            return
        had_own = attr in vars(obj)  # module function or an instance attribute, else a method
        setattr(obj, attr, _scope(f"moe::{name}", fn))
        undo.append((obj, attr, fn if had_own else None))

    for n in ("route", "permute", "unpermute"):
        wrap(layer_module, n, n)
    wrap(layer.gate, "forward", "gate")
    wrap(layer.experts, "forward", "grouped_mlp")
    wrap(layer.experts, "combine", "moe_mlp")
    wrap(layer, "_aux", "aux_losses")
    try:
        yield
    finally:
        for obj, attr, fn in reversed(undo):
            if fn is None:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, fn)


_EVAL = "autograd::engine::evaluate_function:"
_ROOTS = ("moe::forward", "moe::backward")


def profile_moe_step(layer, x, grad_y):
    """Where one MoE forward+backward spends its time, by stage and by aten op.

    Forward: each op counts for the stage scope it runs in (gate, route, permute, grouped_mlp,
    unpermute, aux_losses, or moe_mlp for the fused permute + grouped MLP + unpermute). Backward:
    each autograd node counts for the stage whose forward op created it (autograd sequence_nr).
    Times are self CPU times of the profiled ops in the calling thread (intra-op threads work
    inside them), so they add up to the step.
    Returns {"forward"|"backward": {stage: ms}}, {(direction, stage): {op: ms}}, {root: ms}.
    """
    from torch.profiler import ProfilerActivity, profile

    _clear_grads(layer, x)
    gc.collect()
    with _stage_scopes(layer), profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("moe::forward"):
            out = moe_forward(layer, x)
        with torch.profiler.record_function("moe::backward"):
            moe_backward(out, grad_y)
    del out
    events = prof.events()

    def stage_scope(ev):
        while ev is not None:
            if ev.name.startswith("moe::") and ev.name not in _ROOTS:
                return ev.name[len("moe::"):]
            ev = ev.cpu_parent
        return None

    seq_stage = {}
    for ev in events:
        if ev.sequence_nr >= 0 and not ev.name.startswith(_EVAL):
            st = stage_scope(ev)
            if st is not None:
                seq_stage.setdefault(ev.sequence_nr, st)

    def classify(ev):
        """(direction, stage) of an event, from its nearest stage scope or autograd node."""
        while ev is not None:
            if ev.name.startswith(_EVAL):
                node = ev.name[len(_EVAL):].strip()
                if "AccumulateGrad" in node:
                    return "backward", "accumulate_grad"
                return "backward", seq_stage.get(ev.sequence_nr, f"other: {node}")
            if ev.name.startswith("moe::"):
                if ev.name == "moe::forward":
                    return "forward", "(outside stages)"
                if ev.name == "moe::backward":
                    return "backward", "(engine, outside nodes)"
                return "forward", ev.name[len("moe::"):]
            ev = ev.cpu_parent
        return None, None

    stages = {"forward": defaultdict(float), "backward": defaultdict(float)}
    ops = defaultdict(lambda: defaultdict(float))
    total = {}
    for ev in events:
        if ev.name in _ROOTS:
            total[ev.name] = ev.cpu_time_total / 1e3
        direction, stage = classify(ev)
        if direction is None:
            continue
        ms = ev.self_cpu_time_total / 1e3
        stages[direction][stage] += ms
        if not ev.name.startswith(("moe::", _EVAL)):
            ops[(direction, stage)][ev.name] += ms
    return ({k: dict(v) for k, v in stages.items()},
            {f"{k[0]}/{k[1]}": dict(v) for k, v in ops.items()}, total)


def print_profile(E, T, stages, ops, total):
    fwd, bwd = total.get("moe::forward", 0.0), total.get("moe::backward", 0.0)
    step = fwd + bwd
    print(f"\n  profile E={E} T={T}: forward {fwd:.1f} ms + backward {bwd:.1f} ms "
          f"(one profiled step; self CPU time per stage, top ops inside)")
    for direction in ("forward", "backward"):
        for stage, ms in sorted(stages[direction].items(), key=lambda kv: -kv[1]):
            if ms < 0.005 * step:
                continue
            top = sorted(ops.get(f"{direction}/{stage}", {}).items(), key=lambda kv: -kv[1])[:4]
            detail = ", ".join(f"{n.replace('aten::', '')} {v:.0f}" for n, v in top if v >= 0.5)
            print(f"    {direction:8s} {stage:24s} {ms:9.1f} ms {100 * ms / step:5.1f}%   {detail}")


def saved_tensor_breakdown(layer, x, top=8):
    """The largest storages one MoE forward saves for backward, with the line that saved them."""
    import traceback

    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded.add(x.untyped_storage().data_ptr())
    seen = {}
    here = os.path.abspath(__file__)

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in excluded and ptr not in seen:
            frames = [fr for fr in traceback.extract_stack()[:-1]
                      if fr.filename != here and "/torch/" not in fr.filename]
            fr = frames[-1] if frames else None
            where = f"{os.path.basename(fr.filename)}:{fr.lineno} ({fr.name})" if fr else "?"
            seen[ptr] = (s.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""), where)
        return t

    _clear_grads(layer, x)
    with saved_tensors_hooks(pack, lambda t: t):
        out = moe_forward(layer, x)
    del out
    rows = sorted(seen.values(), key=lambda v: -v[0])
    return [{"MB": b / MB, "shape": list(shape), "dtype": dt, "saved_at": where}
            for b, shape, dt, where in rows[:top]], sum(v[0] for v in rows) / MB


def print_saved(rows, total_mb):
    print(f"  saved for backward by the MoE forward: {total_mb:.1f} MB; largest:")
    for r in rows:
        if r["MB"] >= 0.01 * total_mb:
            shape = str(tuple(r["shape"]))
            print(f"    {r['MB']:8.1f} MB  {shape:>14s} {r['dtype']:8s} saved at {r['saved_at']}")


# ---------------------------------------------------------------------------------------------


def run_config(args, E, T):
    torch.manual_seed(args.seed)
    d, f, k = args.d, args.f, args.k
    cf = 0.0 if args.dropless else args.capacity_factor
    layer = MoELayer(MoEConfig(model_dim=d, ffn_dim=f, num_experts=E, top_k=k, capacity_factor=cf,
                               kernel_backend=args.backend))
    layer.train()
    dense = DenseFFNs(d, f, k, "relu", "cpu", torch.float32).train()
    weights = DTYPES[getattr(args, "dtype", "fp32")]  # (bench_routing.py's arguments have no --dtype)
    layer.to(weights)
    dense.to(weights)
    x = torch.randn(T, d, dtype=weights, requires_grad=True)
    grad_y = torch.randn(T, d, dtype=weights)

    with torch.no_grad():
        _, aux = layer(x)
    dropped = aux.dropped_fraction

    dtype = AUTOCAST.get(args.autocast)
    moe_fwd, dense_fwd = under_autocast(moe_forward, dtype), under_autocast(dense_forward, dtype)
    steps = [(moe_fwd, moe_backward, layer, x, grad_y), (dense_fwd, dense_backward, dense, x, grad_y)]
    if args.tutel:
        steps.append((under_autocast(tutel_forward, dtype), tutel_backward, tutel_layer(args, E).to(weights).train(), x,
                      grad_y))  # (--dtype bf16: Tutel's layer in bf16 too, its gate fp32 inside: fp32_gate)
    moe_ms, dense_ms, *tutel_ms = interleaved(args, *steps)

    moe_saved, moe_malloc = saved_activation_bytes(moe_fwd, layer, x)
    dense_saved, dense_malloc = saved_activation_bytes(dense_fwd, dense, x)

    result = {
        "E": E, "T": T, "d": d, "f": f, "k": k, "capacity_factor": cf, "autocast": args.autocast,
        "dtype": getattr(args, "dtype", "fp32"),
        "dropped_fraction": dropped,
        "moe_ms": statistics.median(moe_ms), "dense_ms": statistics.median(dense_ms),
        "moe_ms_all": moe_ms, "dense_ms_all": dense_ms,
        "moe_saved_bytes": moe_saved, "dense_saved_bytes": dense_saved,
        "moe_malloc_retained_bytes": moe_malloc, "dense_malloc_retained_bytes": dense_malloc,
    }
    result["time_ratio"] = result["moe_ms"] / result["dense_ms"]
    if tutel_ms:
        result.update(tutel_ms=statistics.median(tutel_ms[0]), tutel_ms_all=tutel_ms[0])
        result["tutel_time_ratio"] = result["tutel_ms"] / result["dense_ms"]
    result["memory_ratio"] = moe_saved / dense_saved
    if args.profile:
        timed_step(moe_forward, moe_backward, layer, x, grad_y)  # warm again after the memory pass
        stages, ops, total = profile_moe_step(layer, x, grad_y)
        saved_rows, saved_mb = saved_tensor_breakdown(layer, x)
        result["profile"] = {"stage_ms": stages, "op_ms": ops, "total_ms": total,
                             "saved_tensors": saved_rows}
    return result


def _fmt_mb(b):
    return "-" if b is None else f"{b / MB:.1f}"


def print_row(r, header=False):
    cols = ("E", "T", "moe ms", "dense ms", "time ratio", "moe saved MB", "dense saved MB",
            "mem ratio", "dropped", "moe malloc MB", "dense malloc MB")
    widths = (5, 6, 9, 9, 10, 12, 14, 9, 8, 13, 15)
    if header:
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        return
    vals = (str(r["E"]), str(r["T"]), f"{r['moe_ms']:.1f}", f"{r['dense_ms']:.1f}",
            f"{r['time_ratio']:.3f}", _fmt_mb(r["moe_saved_bytes"]), _fmt_mb(r["dense_saved_bytes"]),
            f"{r['memory_ratio']:.3f}", f"{100 * r['dropped_fraction']:.1f}%",
            _fmt_mb(r["moe_malloc_retained_bytes"]), _fmt_mb(r["dense_malloc_retained_bytes"]))
    print("  ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
    if "tutel_ms" in r:
        print(f"{'':>5}  {'':>6}  Tutel's layer: {r['tutel_ms']:.1f} ms, time ratio {r['tutel_time_ratio']:.3f}",
              flush=True)


def checks(args, results):
    """PASS/FAIL lines: targets at the largest T, and memory linear in T. Never exits non-zero."""
    lines = []
    by = {(r["E"], r["T"]): r for r in results}
    t_max = max(args.T)
    for E in args.E:
        r = by.get((E, t_max))
        if r is None:
            continue
        target = AUTOCAST_TIME_TARGET if args.autocast else TIME_TARGETS.get(E)
        if target is not None:
            ok = r["time_ratio"] <= target
            lines.append(f"{'PASS' if ok else 'FAIL'}  time ratio E={E} T={t_max}: "
                         f"{r['time_ratio']:.3f} (target <= {target})")
        ok = r["memory_ratio"] <= MEMORY_TARGET
        lines.append(f"{'PASS' if ok else 'FAIL'}  memory ratio E={E} T={t_max}: "
                     f"{r['memory_ratio']:.3f} (target <= {MEMORY_TARGET})")
    defined_at = 4096 if args.autocast else 16384
    if t_max != defined_at:
        lines.append(f"note: targets are defined at T={defined_at}; checked here at T={t_max}")
    t_min = min(args.T)
    if t_min != t_max:
        expect = t_max / t_min
        for E in args.E:
            lo, hi = by.get((E, t_min)), by.get((E, t_max))
            if lo is None or hi is None:
                continue
            for name in ("moe", "dense"):
                ratio = hi[f"{name}_saved_bytes"] / lo[f"{name}_saved_bytes"]
                ok = ratio <= 1.05 * expect  # activations must not grow faster than T
                lines.append(f"{'PASS' if ok else 'FAIL'}  {name} memory linear in T, E={E}: "
                             f"saved(T={t_max}) / saved(T={t_min}) = {ratio:.3f} (linear: {expect:.3f})")
    return lines


def start(args):
    """The clock and thread count of args; prints the settings line."""
    global _CLOCK
    _CLOCK = time.process_time if args.timer == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads or os.cpu_count())
    if args.keep_freed_memory and not malloc.keep_freed_memory():
        sys.exit("--keep-freed-memory: glibc's mallopt is not available here")
    if args.tutel:
        tutel_moe()  # (fails now, naming --tutel, where Tutel is missing)
    env = sorted(k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD"))
    autocast = getattr(args, "autocast", None)  # (bench_routing.py's arguments have no --autocast)
    alloc = ("keeps freed memory" if args.keep_freed_memory else f"as set by {', '.join(env)}" if env
             else "glibc default")
    print(f"torch {torch.__version__}, {platform.machine()}, threads {torch.get_num_threads()}, "
          f"malloc {alloc}, "
          f"d={args.d} f={args.f} k={args.k} "
          f"{f'fp32 weights, forwards under autocast {autocast}' if autocast else getattr(args, 'dtype', 'fp32')}, "
          f"capacity_factor={'0 (dropless)' if args.dropless else args.capacity_factor}, "
          f"reps={args.reps} warmup={args.warmup}, median {args.timer} ms of forward+backward")


def main(argv=None):
    args = parse_args(argv)
    start(args)
    print_row(None, header=True)
    results = []
    for T in args.T:
        for E in args.E:
            r = run_config(args, E, T)
            results.append(r)
            print_row(r)
            if args.profile:
                p = r["profile"]
                print_profile(E, T, p["stage_ms"], p["op_ms"], p["total_ms"])
                print_saved(p["saved_tensors"], r["moe_saved_bytes"] / MB)
                print_row(None, header=True)
    finish(args, results, checks(args, results))


def finish(args, results, lines):
    threads = torch.get_num_threads()
    print()
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": {**vars(args), "threads": threads}, "results": results,
                       "checks": lines, "torch": torch.__version__}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
