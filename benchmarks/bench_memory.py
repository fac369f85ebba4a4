"""Training memory per rank with the experts spread: without sharding, with ZeRO and with FSDP, at W = 1, 2, 4.

    .venv/bin/python benchmarks/bench_memory.py                    # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_memory.py --world 1 2 --dim 512

One run: a toy translation corpus, then 2 updates of fairseq-train (Adam) per (W, mode) of a moe_transformer whose
dense part is large (--dim wide, 4 + 4 layers, every second FFN an MoE layer of --experts narrow experts: the
embeddings and attention outweigh the experts), each rank under /usr/bin/time and benchmarks/memory_rank.py. Modes:
none (the dense part replicated), os (--zero-sharding os) and fsdp (--ddp-backend fully_sharded, each layer its own
unit). Per rank, what it holds in memory after an update (memory_rank.py: of a sharded tensor its own rows):
parameter bytes, gradient bytes, optimizer-state bytes, of the largest rank; and the peak RSS of the largest rank
(torch's and fairseq's own ~0.5 GB included). Printed per row and as ratios to W = 1 without sharding.
"""
import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import USER_DIR, corpus, run  # noqa: E402  (the toy corpus and the quiet runner)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dim", type=int, default=1024, help="model width (the dense part grows with its square)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    data = corpus(tmp, 50)
    timed = ["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, str(Path(__file__).parent / "memory_rank.py")]
    rows = []
    for W in args.world:
        for mode in ("none", "os", "fsdp") if W > 1 else ("none",):
            save = tmp / f"w{W}-{mode}"
            report = tmp / f"w{W}-{mode}-RANK.json"
            sharding = (("--ddp-backend", "fully_sharded", "--min-params-to-wrap", "0") if mode == "fsdp" else
                        ("--zero-sharding", mode))
            train = [str(report), data, "--user-dir", USER_DIR, "--task", "moe_translation", "--arch",
                     "moe_transformer", "--encoder-layers", "4", "--decoder-layers", "4", "--encoder-embed-dim",
                     str(args.dim), "--decoder-embed-dim", str(args.dim), "--encoder-ffn-embed-dim", str(args.dim),
                     "--decoder-ffn-embed-dim", str(args.dim), "--encoder-attention-heads", "4",
                     "--decoder-attention-heads", "4", "--moe-expert-count", str(args.experts), "--moe-freq", "2",
                     "--criterion", "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "0.0005",
                     "--max-tokens", "1000", "--max-update", "2", "--cpu", "--save-dir", str(save),
                     "--no-epoch-checkpoints", "--num-workers", "0", "--no-progress-bar", "--disable-validation",
                     *sharding]
            cmd = [*timed, *train] if W == 1 else [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W),
                                                    "--", *timed, *train]
            out = run(cmd, timeout=3600)
            rss = max(int(m) for m in re.findall(r"MAXRSS_KB (\d+)", out.stderr)) * 1024
            ranks = [json.loads(Path(str(report).replace("RANK", str(r))).read_text()) for r in range(W)]
            row = dict(world=W, sharding=mode, **{key: max(r[key] for r in ranks) for key in ranks[0]}, peak_rss=rss)
            row["total_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
            rows.append(row)
    base = rows[0]
    print(f"{'W':>2} {'mode':>5} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9} {'ratio':>6} "
          f"{'optim ratio':>11} {'peak RSS MB':>12} {'ratio':>6}   (per rank: the largest)")
    for r in rows:
        print(f"{r['world']:>2} {r['sharding']:>5} {r['param_bytes'] / 2**20:>10.1f} "
              f"{r['grad_bytes'] / 2**20:>9.1f} {r['optimizer_bytes'] / 2**20:>9.1f} {r['total_bytes'] / 2**20:>9.1f} "
              f"{r['total_bytes'] / base['total_bytes']:>6.2f} {r['optimizer_bytes'] / base['optimizer_bytes']:>11.2f} "
              f"{r['peak_rss'] / 2**20:>12.0f} {r['peak_rss'] / base['peak_rss']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
