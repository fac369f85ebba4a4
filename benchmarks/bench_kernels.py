"""GPU benchmark of the MoE kernels (torch vs Triton backend) and of the whole layer, correctness first.

Legend: T tokens, N = T*k expert-sorted rows (dropless), d model dim, f expert ffn dim, E experts,
k experts per token, elt bytes per element of --dtype.

1. Correctness on the device: each op of each backend (router, permute, unpermute, grouped_mlp, moe_mlp)
   and the whole MoELayer, output and every gradient, in fp32 and in --dtype, against the torch backend
   in fp64 on the same values; at full size, each op's forward again against the torch backend.
2. Baselines from the same run: the square matmul rate; per config the 6 GEMMs of a dense FFN's
   forward+backward on N rows (the grouped MLP's FLOPs); device-to-device copy bandwidth (bytes read +
   written); k dense FFNs on the same T tokens (the layer's limit).
3. Per config: each op forward and forward+backward, and the layer forward+backward, timed with CUDA
   events: median over --inputs input sets (routings of different load imbalance) after warm-up.
Targets (see benchmarks/kernel_notes.md): grouped MLP fwd+bwd >= 70% of the dense rate for the same
FLOPs; permute/unpermute >= 70% of copy bandwidth; layer fwd+bwd <= 1.3x k dense FFNs.

    .venv/bin/python benchmarks/bench_kernels.py --out kernels.json        # full sweep, < 6 min on an H200
    .venv/bin/python benchmarks/bench_kernels.py --quick --out quick.json
    .venv/bin/python benchmarks/bench_kernels.py --smoke --out smoke.json  # CPU, torch backend, tiny shapes
"""
import argparse
import gc
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository (fairseq_moe, kernels) and kernel_cases.py

from kernel_cases import (  # noqa: E402
    DTYPES, OPS, SKEWS, TOL, DenseFFNs, check_ops, compare, compare_router, first_output, fwd_bwd, layer_step,
    make_inputs, make_layer, no_grad, op_work)
from fairseq_moe_kernels import backend  # noqa: E402

TARGETS = {"gmlp": 0.70, "bandwidth": 0.70, "layer": 1.3}
GiB = 2**30
_CUDA_EVENTS = False  # main() sets it: time with CUDA events (GPU) or perf_counter (--smoke on CPU)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--E", type=int, nargs="+", default=[8, 64, 128], help="numbers of experts")
    p.add_argument("--T", type=int, nargs="+", default=[8192, 65536], help="numbers of tokens")
    p.add_argument("--d", type=int, default=2048, help="model dim")
    p.add_argument("--f", type=int, nargs="+", default=[8192, 1408],
                   help="expert ffn dims (1408: fine-grained)")
    p.add_argument("--k", type=int, nargs="+", default=[2, 8], help="experts per token")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="activations and weights (default bf16; smoke fp32)")
    p.add_argument("--activation", choices=("relu", "gelu", "silu"), default="relu")
    p.add_argument("--backends", nargs="+", choices=("triton", "grouped_mm", "torch"),
                   help="backends to check and time (default triton grouped_mm torch; smoke torch)")
    p.add_argument("--target-backend", choices=("triton", "grouped_mm", "torch"),
                   help="the backend the targets apply to (default: the first of --backends)")
    p.add_argument("--inputs", type=int, default=3, help="input sets per config (routings of different skew)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls per input set (one more on the first)")
    p.add_argument("--reps", type=int, default=10, help="most timed samples per input set")
    p.add_argument("--min-reps", type=int, default=2, help="fewest timed samples per input set")
    p.add_argument("--measure-s", type=float, default=0.25,
                   help="timed seconds to aim for per measurement (picks the samples between the two)")
    p.add_argument("--min-sample-ms", type=float, default=1.0,
                   help="a sample repeats a short op back to back until it lasts this long")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no config after this many seconds; the rest is reported as skipped")
    p.add_argument("--check-shape", type=int, nargs=5, default=[496, 208, 368, 7, 2],
                   metavar=("T", "d", "f", "E", "k"),
                   help="shape of the correctness check: expert 0 gets no row; d, f not multiples of the "
                        "blocks but of 16 like the sweep's, so Triton compiles the same specialisations once")
    p.add_argument("--skip-check", action="store_true", help="skip the correctness section")
    p.add_argument("--quick", action="store_true", help="E 8 128, T 8192, 2 input sets, shorter timing")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny shapes (overriding the grid), wall-clock timer: checks the script runs")
    p.add_argument("--out", metavar="PATH", help="write settings, device, baselines, samples, checks as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.E, args.T, args.inputs, args.measure_s = [8, 128], [8192], 2, 0.1
    if args.smoke:
        args.E, args.T, args.d, args.f, args.k = [4], [64], 32, [48], [2]
        args.check_shape = [37, 24, 40, 5, 2]
        args.inputs, args.reps, args.measure_s = 2, 2, 0.01
    args.dtype = args.dtype or ("fp32" if args.smoke else "bf16")
    args.backends = args.backends or (["torch"] if args.smoke else ["triton", "grouped_mm", "torch"])
    args.target_backend = args.target_backend or args.backends[0]
    if min(args.inputs, args.reps, args.min_reps) < 1 or args.min_reps > args.reps:
        p.error("--inputs, --reps, --min-reps must be >= 1 and --min-reps <= --reps")
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: --smoke checks the script on the CPU")
    return args


# ---------------------------------------------------------------------------------------------
# Timing


def time_ms(fn, inner=1):
    """ms per call of fn over `inner` back-to-back calls: CUDA events on a GPU, perf_counter on CPU."""
    if _CUDA_EVENTS:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e3 / inner


def measure(args, rec, name, fn, first):
    """Add timed samples of fn() on one input set to rec[name]; first: the first set (compiles, autotunes)."""
    entry = rec.setdefault(name, {"samples": []})
    if first:
        entry["first_call_ms"] = time_ms(fn)  # with Triton's compile + autotune of a new shape
    for _ in range(args.warmup):
        fn()
    t = max(time_ms(fn), 1e-4)
    entry["inner"] = inner = max(1, min(1000, math.ceil(args.min_sample_ms / t)))
    reps = round(args.measure_s * 1e3 / args.inputs / (t * inner))
    entry["samples"] += [time_ms(fn, inner) for _ in range(max(args.min_reps, min(args.reps, reps)))]


def finish(rec, work):
    """Median ms of each measurement, and its rate where work[name] = ("TFLOP/s" | "GB/s", amount)."""
    for name, e in rec.items():
        e["ms"] = statistics.median(e["samples"])
        if name in work:
            unit, amount = work[name]
            e[unit] = amount / (e["ms"] * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)
    return rec


def device_baselines(args, device, dtype):
    """Square matmul rate and copy bandwidth (bytes read + written) of this device, in this run."""
    rec, n = {}, (128 if args.smoke else 8192)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    measure(args, rec, "matmul", lambda: a @ b, True)
    elems = (2**20 if args.smoke else GiB) // 4  # 1 GiB: far beyond the L2 cache
    src, dst = torch.randn(elems, device=device), torch.empty(elems, device=device)
    measure(args, rec, "copy", lambda: dst.copy_(src), True)
    out = finish(rec, {"matmul": ("TFLOP/s", 2 * n**3), "copy": ("GB/s", 8 * elems)})
    out["matmul"]["shape"], out["copy"]["bytes"] = [n, n, n], 8 * elems
    return out


# ---------------------------------------------------------------------------------------------
# The sweep


def needed_bytes(E, T, d, f, k, elt):
    """Rough peak of one config: weights and their grads, [N, f] and [N, d] activations and grads."""
    N = T * k
    return 2 * E * (2 * d * f + f + d) * elt + elt * (4 * N * f + 6 * N * d + 6 * T * d) + 16 * T * E


def run_config(args, device, ref, ops_by_name, E, T, d, f, k):
    """Baselines (dense GEMMs, k dense FFNs), then each op and the layer per backend, over the input sets."""
    work = op_work(E, T, d, f, k, DTYPES[args.dtype].itemsize)
    seeds = [args.seed * 1000 + s for s in range(args.inputs)]
    res = {"E": E, "T": T, "d": d, "f": f, "k": k, "N": T * k, "sets": [], "backends": {}, "agreement": {}}
    res["baseline"] = run_baseline(args, device, ref, res, seeds, work)
    free_memory()
    for name, ops in ops_by_name.items():
        try:
            res["backends"][name] = run_backend(args, device, ref, name, ops, res, seeds, work)
        except Exception as e:  # out of memory or a broken kernel: reported, and on to the next
            res["backends"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc(limit=3)
        free_memory()
    return res


def run_baseline(args, device, ref, res, seeds, work):
    """The dense GEMMs on N rows (the grouped MLP's FLOPs) and k dense FFNs on the T tokens (the layer's)."""
    E, T, d, f, k = (res[c] for c in "ETdfk")
    dtype = DTYPES[args.dtype]
    rec, dense = {}, DenseFFNs(d, f, k, args.activation, device, dtype)
    w1, w2 = torch.randn(d, f, device=device, dtype=dtype), torch.randn(f, d, device=device, dtype=dtype)
    for s, seed in enumerate(seeds):
        I = make_inputs(ref, E, T, d, k, dtype, device, seed)
        c = I["counts"].float()
        res["sets"].append({"seed": seed, "skew": SKEWS[seed % len(SKEWS)],
                            "imbalance": (c.max() / c.mean()).item()})  # max / mean expert load
        x, gy = I["rows"].detach(), torch.randn_like(I["rows"])  # [N, d]

        def gemms():  # the 6 GEMMs of a dense FFN's forward+backward on N rows
            h, dh = x @ w1, gy @ w2.t()  # [N, f]
            return h @ w2, h.t() @ gy, dh @ w1.t(), x.t() @ dh
        measure(args, rec, "dense_gemm_fwd", lambda: (x @ w1) @ w2, s == 0)
        measure(args, rec, "dense_gemm_fwdbwd", gemms, s == 0)
        inputs = [I["x"]] + list(dense.parameters())
        measure(args, rec, "dense_ffn_fwdbwd", fwd_bwd(lambda: dense(I["x"]), inputs, gy[:T]), s == 0)
    return finish(rec, work)


def run_backend(args, device, ref, name, ops, res, seeds, work):
    E, T, d, f, k = (res[c] for c in "ETdfk")
    dtype = DTYPES[args.dtype]
    layer = make_layer(E, d, f, k, args.activation, name, device, dtype, args.seed)
    rec, agree = {}, res["agreement"].setdefault(name, {}) if name != "torch" else {}
    for s, seed in enumerate(seeds):
        I = make_inputs(ref, E, T, d, k, dtype, device, seed)
        I.update({n: getattr(layer.experts, n) for n in ("w1", "b1", "w2", "b2")})  # the op weights
        for op, (call, diff) in OPS.items():
            fn = lambda: call(ops, I, args.activation)  # noqa: E731
            measure(args, rec, op + "_fwd", no_grad(fn), s == 0)
            out = no_grad(fn)()
            if s == 0 and name != "torch":  # at full size, the forward of the torch backend?
                want = no_grad(lambda: call(ref, I, args.activation))()
                tol = 2 * TOL[torch.float32 if op == "router" else dtype]
                if op == "router":
                    errs, ok = compare_router(out, want, tol)
                else:
                    errs, ok = compare({0: out}, {0: want}, tol)
                agree[op] = {"errors": {str(i): e for i, e in errs.items()}, "tol": tol, "pass": ok}
                del want
            up = torch.randn_like(first_output(out))
            del out
            measure(args, rec, op + "_fwdbwd", fwd_bwd(fn, [I[n] for n in diff], up), s == 0)
        measure(args, rec, "layer_fwdbwd", layer_step(layer, I["x"], torch.randn_like(I["x"])), s == 0)
    return finish(rec, work)


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Targets and the report


def target_checks(args, results, baselines, correctness):
    """[{pass, line, ...}]: correctness, full-size agreement with torch, the targets of the target backend."""
    out, copy = [], baselines["copy"]["GB/s"]

    def add(ok, text, **kw):
        out.append({"pass": bool(ok), "line": f"{'PASS' if ok else 'FAIL'}  {text}", **kw})
    for r in correctness:
        worst = max(r.get("errors", {}).items(), key=lambda kv: kv[1], default=("-", math.nan))
        add(r["pass"], f"correct {r['backend']} {r['op']} {r['dtype']}: "
            + (r.get("error") or f"worst {worst[0]} rel err {worst[1]:.1e} (tol {r['tol']:.0e})"))
        if "ops_called" in r:  # else the layer's timings below are not those of this backend
            add(r["ops_called"],
                f"layer with kernel_backend={r['backend']} calls its ops: {r['ops_called'] or 'none'}")
    for r in results:
        cfg = f"E={r['E']} T={r['T']} f={r['f']} k={r['k']}"
        for name, ops in r["agreement"].items():
            bad = {op: a["errors"] for op, a in ops.items() if not a["pass"]}
            add(not bad, f"{name} forward = torch forward at {cfg}" + (f": {bad}" if bad else ""))
        b = r["backends"].get(args.target_backend) or {"error": "not run"}
        if "error" in b:
            add(False, f"{args.target_backend} at {cfg}: {b['error']}")
            continue
        ratio = b["gmlp_fwdbwd"]["TFLOP/s"] / r["baseline"]["dense_gemm_fwdbwd"]["TFLOP/s"]
        peak = b["gmlp_fwdbwd"]["TFLOP/s"] / baselines["matmul"]["TFLOP/s"]
        add(ratio >= TARGETS["gmlp"], f"grouped MLP fwd+bwd at {cfg}: {ratio:.0%} of the dense GEMM rate for "
            f"the same FLOPs (target >= {TARGETS['gmlp']:.0%}; {peak:.0%} of the square matmul)",
            config=cfg, value=ratio)
        for m in ("permute_fwd", "permute_fwdbwd", "unpermute_fwd", "unpermute_fwdbwd"):
            ratio = b[m]["GB/s"] / copy
            add(ratio >= TARGETS["bandwidth"], f"{m} at {cfg}: {ratio:.0%} of copy bandwidth "
                f"(target >= {TARGETS['bandwidth']:.0%})", config=cfg, value=ratio)
        ratio = b["layer_fwdbwd"]["ms"] / r["baseline"]["dense_ffn_fwdbwd"]["ms"]
        add(ratio <= TARGETS["layer"], f"layer fwd+bwd at {cfg}: {ratio:.2f}x k dense FFNs "
            f"(target <= {TARGETS['layer']}x)", config=cfg, value=ratio)
    return out


def print_config(r, copy, elapsed):
    base = r["baseline"]
    dense, ffn_ms = base["dense_gemm_fwdbwd"]["TFLOP/s"], base["dense_ffn_fwdbwd"]["ms"]
    imbalance = ", ".join(f"{s['imbalance']:.2f}" for s in r["sets"])
    print(f"E={r['E']} T={r['T']} f={r['f']} k={r['k']} N={r['N']} (max/mean load {imbalance}): dense GEMMs "
          f"fwd {base['dense_gemm_fwd']['TFLOP/s']:.3g} fwd+bwd {dense:.3g} TFLOP/s, {r['k']} dense FFNs "
          f"fwd+bwd {ffn_ms:.3g} ms [{elapsed:.0f} s]")
    for name, b in r["backends"].items():
        if "error" in b:
            print(f"  {name:6s} ERROR {b['error']}")
            continue
        bw = lambda m: f"{b[m]['GB/s']:.0f} ({b[m]['GB/s'] / copy:.0%})"  # noqa: E731
        tf = lambda m: f"{b[m]['TFLOP/s']:.3g} ({b[m]['TFLOP/s'] / dense:.0%})"  # noqa: E731
        us = lambda m: f"{b[m]['ms'] * 1e3:.0f}"  # noqa: E731
        print(f"  {name:6s} router {us('router_fwd')}/{us('router_fwdbwd')} us | "
              f"GB/s (of copy) permute {bw('permute_fwd')} f+b {bw('permute_fwdbwd')}, unpermute "
              f"{bw('unpermute_fwd')} f+b {bw('unpermute_fwdbwd')} | TFLOP/s (of dense) "
              f"gmlp {tf('gmlp_fwd')} "
              f"f+b {tf('gmlp_fwdbwd')}, moe_mlp f+b {tf('moe_mlp_fwdbwd')} | layer f+b "
              f"{b['layer_fwdbwd']['ms']:.3g} ms = {b['layer_fwdbwd']['ms'] / ffn_ms:.2f}x dense", flush=True)


def device_info(args, device):
    info = {"device": str(device), "torch": torch.__version__, "dtype": args.dtype}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info.update(name=prop.name, capability=f"{prop.major}.{prop.minor}",
                    memory_GiB=prop.total_memory / GiB)
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    return info


def main(argv=None):
    global _CUDA_EVENTS
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # a run killed at its time limit still shows each line
        sys.stdout.reconfigure(line_buffering=True)
    t0 = time.perf_counter()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    _CUDA_EVENTS = device.type == "cuda"
    info = device_info(args, device)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    ref, ops_by_name, unavailable = backend.ops("torch"), {}, {}
    for name in args.backends:
        try:
            ops_by_name[name] = backend.ops(backend.resolve(name, device))
        except (ValueError, ImportError) as e:  # reported; never replaced by another backend
            unavailable[name] = str(e)
            print(f"backend {name} unavailable: {e}")
    correctness = [] if args.skip_check else check_ops(args, ref, ops_by_name, device)
    print(f"correctness: {sum(r['pass'] for r in correctness)}/{len(correctness)} pass "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    baselines = device_baselines(args, device, dtype)
    copy = baselines["copy"]["GB/s"]
    print(f"device: {args.dtype} matmul {baselines['matmul']['TFLOP/s']:.3g} TFLOP/s "
          f"({'x'.join(map(str, baselines['matmul']['shape']))}), copy {copy:.0f} GB/s (read + written)")
    results, skipped = [], []

    def save():  # after every config too: a run killed by its time limit keeps what it measured
        checks = target_checks(args, results, baselines, correctness)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"settings": vars(args), "device": info, "unavailable_backends": unavailable,
                           "baselines": baselines, "correctness": correctness, "results": results,
                           "skipped": skipped, "checks": checks, "elapsed_s": time.perf_counter() - t0},
                          fh, indent=1)
        return checks
    # Cheapest first: if the time budget runs out, only the largest configs are left out.
    grid = sorted(itertools.product(args.E, args.T, args.f, args.k), key=lambda c: (c[1] * c[2] * c[3], c[0]))
    for E, T, f, k in grid:
        free_memory()
        free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else math.inf
        need = needed_bytes(E, T, args.d, f, k, dtype.itemsize)
        why = ("k > E" if k > E else f"time budget ({args.budget_s:.0f} s) spent"
               if time.perf_counter() - t0 > args.budget_s else
               f"needs ~{need / GiB:.0f} GiB, {free / GiB:.0f} GiB free" if need > 0.9 * free else None)
        try:
            if why is None:
                results.append(run_config(args, device, ref, ops_by_name, E, T, args.d, f, k))
        except Exception as e:  # e.g. out of memory in the baselines: reported, and on to the next config
            why = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=3)
        if why:
            skipped.append({"E": E, "T": T, "f": f, "k": k, "reason": why})
            print(f"skip E={E} T={T} f={f} k={k}: {why}")
        else:
            print_config(results[-1], copy, time.perf_counter() - t0)
        save()
    checks = save()
    print("\n" + "\n".join(c["line"] for c in checks))
    print(f"{sum(c['pass'] for c in checks)}/{len(checks)} PASS, {len(skipped)} configs skipped, "
          f"{time.perf_counter() - t0:.0f} s" + (f"; wrote {args.out}" if args.out else ""))
    return checks


if __name__ == "__main__":
    main()
