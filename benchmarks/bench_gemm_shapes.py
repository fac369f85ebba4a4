"""The GEMMs of the expert MLP at each E against those of its dense equivalent, alone (CPU, one thread).

A top-k MoE layer's expert MLP on T tokens runs, per expert and for R = T * k / E rows each (routing spread evenly),
the six GEMMs of a two-layer MLP: forward x @ W1 [R, d] x [d, f] and h @ W2 [R, f] x [f, d]; backward dh = dy @ W2^T,
dx = dh @ W1^T, dW1 = x^T @ dh and dW2 = h^T @ dy. Its dense equivalent (bench_layer.py's baseline) runs the same six
on T rows, k times: the same FLOPs. This times both sets with torch.mm into preallocated outputs (no allocation, no
copies, no activation), interleaved (experts, dense, experts, ...), and prints the median time of each set and their
ratio per E: the floor that the GEMMs alone put under bench_layer.py's time ratio at that E.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gemm_shapes.py --E 8 32 128 --T 16384 --reps 5
"""
import argparse
import json
import statistics
import sys
import time

import torch


def gemm_set(rows, d, f, count, gen):
    """Operands of `count` MLPs of `rows` rows each, and a function that runs their six GEMMs each."""
    x, dy = (torch.randn(count, rows, d, generator=gen) for _ in range(2))
    h, dh = (torch.randn(count, rows, f, generator=gen) for _ in range(2))
    w1, w2 = torch.randn(count, d, f, generator=gen), torch.randn(count, f, d, generator=gen)
    out_rf, out_rd = torch.empty(rows, f), torch.empty(rows, d)
    out_df, out_fd = torch.empty(d, f), torch.empty(f, d)

    def run():
        for e in range(count):
            torch.mm(x[e], w1[e], out=out_rf)  # forward: x @ W1
            torch.mm(h[e], w2[e], out=out_rd)  # forward: h @ W2
            torch.mm(dy[e], w2[e].t(), out=out_rf)  # backward: dh = dy @ W2^T
            torch.mm(dh[e], w1[e].t(), out=out_rd)  # backward: dx = dh @ W1^T
            torch.mm(x[e].t(), dh[e], out=out_df)  # backward: dW1 = x^T @ dh
            torch.mm(h[e].t(), dy[e], out=out_fd)  # backward: dW2 = h^T @ dy

    return run


def cpu_ms(fn):
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--E", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--f", type=int, default=2048)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    dense = gemm_set(args.T, args.d, args.f, args.k, gen)
    rows = []
    print(f"torch {torch.__version__}, 1 thread, T={args.T} d={args.d} f={args.f} k={args.k}, fp32, median CPU ms of "
          f"{args.reps}, interleaved")
    print(f"{'E':>5} {'rows/expert':>12} {'experts ms':>11} {'dense ms':>9} {'ratio':>6}")
    for E in args.E:
        if args.T * args.k % E:
            sys.exit(f"--T {args.T} * --k {args.k} is not a multiple of --E {E}")
        experts = gemm_set(args.T * args.k // E, args.d, args.f, E, gen)
        experts(), dense()  # warm-up
        times = {"experts": [], "dense": []}
        for _ in range(args.reps):
            times["experts"].append(cpu_ms(experts))
            times["dense"].append(cpu_ms(dense))
        e_ms, d_ms = statistics.median(times["experts"]), statistics.median(times["dense"])
        rows.append(dict(E=E, rows_per_expert=args.T * args.k // E, experts_ms=e_ms, dense_ms=d_ms, ratio=e_ms / d_ms,
                         reps=times))
        print(f"{E:>5} {args.T * args.k // E:>12} {e_ms:>11.1f} {d_ms:>9.1f} {e_ms / d_ms:>6.3f}")
        del experts
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
