"""All-to-all of MoE rows: flat vs hierarchical (2-D) measured here, and a cost model for large clusters.

    python benchmarks/bench_a2a.py                      # measure on W = 2 and 4 gloo processes, then model
    python benchmarks/bench_a2a.py --model-only --tokens 4096 --d 4096 --bytes 2

Measured: one process per rank (gloo over loopback), rows of random routing (each rank sends a
different number of rows to each peer, as after top-k routing), median time of the exchange
fairseq_moe_layer.comm.all_to_all does, flat and hierarchical (L = 2 local ranks), same data.
On one machine the "inter-node" step is loopback too, so the measurement checks the overhead of the
two-step exchange (extra messages, the two local reorders), not the network gain.

Model (alpha-beta; P ranks = N nodes x L local ranks; S bytes of rows per rank, spread evenly):
    flat          (P-1) * a_e  +  S (L-1)/P / B_i  +  S (P-L)/P / B_e
    hierarchical  (L-1) * a_i  +  S (L-1)/L / B_i  +  (N-1) * a_e  +  S (N-1)/N / B_e  +  2 S / B_mem
Both move the same bytes across nodes (S (N-1)/N); the 2-D exchange trades P-1 small inter-node
messages for N-1 larger ones, plus two local reorders. It wins when the per-message cost a_e times
the P-N messages it saves exceeds the reorder cost: many ranks and small per-peer messages.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks to measure on")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 8192], help="rows sent per rank")
    p.add_argument("--d", type=int, default=512, help="row width (model dim) for the measurement")
    p.add_argument("--reps", type=int, default=20, help="timed exchanges (median reported)")
    p.add_argument("--model-only", action="store_true", help="skip the measurement")
    g = p.add_argument_group("cost model (defaults: A100/H100-class nodes of 8 GPUs, 200 Gb/s IB per GPU)")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per GPU in the modelled layer")
    g.add_argument("--k", type=int, default=2, help="top-k of the modelled layer")
    g.add_argument("--model-d", type=int, default=4096, help="model dim of the modelled layer")
    g.add_argument("--bytes", type=int, default=2, help="bytes per element (2: bf16)")
    g.add_argument("--local", type=int, default=8, help="GPUs per node (L)")
    g.add_argument("--alpha-intra-us", type=float, default=3.0, help="per-message cost inside a node")
    g.add_argument("--alpha-inter-us", type=float, default=10.0, help="per-message cost across nodes")
    g.add_argument("--bw-intra-gbs", type=float, default=150.0, help="GB/s per GPU inside a node (NVLink)")
    g.add_argument("--bw-inter-gbs", type=float, default=25.0, help="GB/s per GPU across nodes")
    g.add_argument("--bw-mem-gbs", type=float, default=1500.0, help="GB/s of a local reorder (HBM)")
    g.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 2048], help="cluster sizes to predict")
    args = p.parse_args(argv)
    for name in ("tokens", "k", "model_d", "bytes", "local", "reps", "d"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def cost_model(P, L, S, a_i, a_e, b_i, b_e, b_mem):
    """Seconds of one flat and one hierarchical all-to-all (see the module docstring)."""
    N = P // L
    flat = (P - 1) * a_e + S * (L - 1) / P / b_i + S * (P - L) / P / b_e
    hier = (L - 1) * a_i + S * (L - 1) / L / b_i + (N - 1) * a_e + S * (N - 1) / N / b_e + 2 * S / b_mem
    return flat, hier


def print_model(args):
    S = args.tokens * args.k * args.model_d * args.bytes
    print(f"\ncost model: {args.tokens} tokens/GPU x top-{args.k} x d={args.model_d} x {args.bytes} B "
          f"= {S / 2**20:.1f} MiB per GPU per all-to-all; L={args.local} GPUs/node; "
          f"a_i={args.alpha_intra_us} us, a_e={args.alpha_inter_us} us, B_i={args.bw_intra_gbs} GB/s, "
          f"B_e={args.bw_inter_gbs} GB/s, B_mem={args.bw_mem_gbs} GB/s")
    print(f"{'GPUs':>6} {'nodes':>6} {'per-peer KiB':>13} {'flat ms':>9} {'2-D ms':>9} {'2-D speed-up':>13}")
    for P in args.gpus:
        if P % args.local:
            print(f"{P:>6}  (not a multiple of --local {args.local})")
            continue
        flat, hier = cost_model(P, args.local, S, args.alpha_intra_us * 1e-6, args.alpha_inter_us * 1e-6,
                                args.bw_intra_gbs * 1e9, args.bw_inter_gbs * 1e9, args.bw_mem_gbs * 1e9)
        print(f"{P:>6} {P // args.local:>6} {S / P / 1024:>13.1f} {flat * 1e3:>9.3f} {hier * 1e3:>9.3f} "
              f"{flat / hier:>12.2f}x")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(rank, W, port, rows, d, reps, out):
    from fairseq_moe_layer.comm import all_to_all, exchange_counts, expert_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=300))
    results = {}
    eps = {"flat": expert_parallel(W), "2-D": expert_parallel(W, local_size=2) if W >= 4 else None}
    for n in rows:
        g = torch.Generator().manual_seed(rank)
        send = torch.bincount(torch.randint(0, W, (n,), generator=g), minlength=W)  # uneven, as routing
        x = torch.randn(n, d)
        for name, ep in eps.items():
            if ep is None:
                continue
            recv = exchange_counts(send, ep.group)
            times = []
            for i in range(reps + 2):
                dist.barrier()
                t = time.perf_counter()
                all_to_all(x, send, recv, ep)
                times.append(time.perf_counter() - t)
            results[(name, n)] = statistics.median(times[2:])
    if rank == 0:
        out.update({f"{k[0]}|{k[1]}": v for k, v in results.items()})
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if not args.model_only:
        print(f"measured: gloo over loopback, d={args.d}, fp32 rows, median of {args.reps} (ms per exchange)")
        print(f"{'W':>3} {'rows/rank':>10} {'MiB/rank':>9} {'flat ms':>9} {'2-D ms':>9}")
        for W in args.world_sizes:
            with mp.Manager() as manager:
                out = manager.dict()
                mp.spawn(_measure, args=(W, _free_port(), args.rows, args.d, args.reps, out), nprocs=W)
                res = dict(out)
            for n in args.rows:
                flat = res.get(f"flat|{n}")
                hier = res.get(f"2-D|{n}")
                print(f"{W:>3} {n:>10} {n * args.d * 4 / 2**20:>9.2f} {flat * 1e3:>9.3f} "
                      f"{'-' if hier is None else f'{hier * 1e3:.3f}':>9}")
    print_model(args)


if __name__ == "__main__":
    main()
