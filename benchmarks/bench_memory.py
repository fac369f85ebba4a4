"""Training memory per rank with the experts spread, without sharding and with --zero-sharding os, at W = 1, 2, 4.

    .venv/bin/python benchmarks/bench_memory.py                    # about 2.5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_memory.py --world 1 2 --dim 512

One run: a toy translation corpus, then 2 updates of fairseq-train (Adam) per (W, mode) of a moe_transformer whose
dense part is large (--dim wide, 4 + 4 layers, every second FFN an MoE layer of --experts narrow experts: the
embeddings and attention outweigh the experts), each rank under /usr/bin/time. Per rank, from what each rank holds
(its saved state: the shared tensors + its E/W experts, and the optimizer entries its state dict keeps): parameter
bytes, gradient bytes (one per parameter it holds), optimizer-state bytes of the largest rank; the peak RSS of the
largest rank (measured: torch and fairseq's own ~0.5 GB included). Printed per row and as ratios to W = 1 without
sharding. FSDP (--ddp-backend fully_sharded) with spread experts is not built: not measured.
"""
import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import USER_DIR, corpus, run  # noqa: E402  (the toy corpus and the quiet runner)

EXPERT = re.compile(r"\.moe\.experts\.(w1|b1|w2|b2)$")


def load(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def nbytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def per_rank(save, world):
    """[(parameter bytes, optimizer bytes)] of each rank, from its saved state (what it held)."""
    if world == 1:
        state = load(save / "checkpoint_last.pt")
        return [(nbytes(state["model"]), nbytes(state["last_optimizer_state"]["state"]))]
    shared = load(save / "checkpoint_last-shared.pt")
    dense_params = nbytes({k: v for k, v in shared["model"].items() if not EXPERT.search(k)})
    dense_state = nbytes(shared["last_optimizer_state"]["state"])  # (without sharding: every rank's copy)
    out = []
    for r in range(world):
        shard = load(save / f"checkpoint_last-rank-{r}.pt")
        out.append((dense_params + nbytes(shard["model"]),
                    dense_state + nbytes(shard["optimizer"]) + nbytes(shard.get("dense_optimizer", {}))))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dim", type=int, default=1024, help="model width (the dense part grows with its square)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    data = corpus(tmp, 50)
    timed = ["/usr/bin/time", "-f", "MAXRSS_KB %M"]
    rows = []
    for W in args.world:
        for mode in ("none", "os") if W > 1 else ("none",):
            save = tmp / f"w{W}-{mode}"
            train = ["fairseq-train", data, "--user-dir", USER_DIR, "--task", "moe_translation", "--arch",
                     "moe_transformer", "--encoder-layers", "4", "--decoder-layers", "4", "--encoder-embed-dim",
                     str(args.dim), "--decoder-embed-dim", str(args.dim), "--encoder-ffn-embed-dim", str(args.dim),
                     "--decoder-ffn-embed-dim", str(args.dim), "--encoder-attention-heads", "4",
                     "--decoder-attention-heads", "4", "--moe-expert-count", str(args.experts), "--moe-freq", "2",
                     "--criterion", "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "0.0005",
                     "--max-tokens", "1000", "--max-update", "2", "--cpu", "--save-dir", str(save),
                     "--no-epoch-checkpoints", "--num-workers", "0", "--no-progress-bar", "--disable-validation",
                     "--zero-sharding", mode]
            cmd = [*timed, *train] if W == 1 else [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W),
                                                    "--", *timed, *train]
            out = run(cmd, timeout=3600)
            rss = max(int(m) for m in re.findall(r"MAXRSS_KB (\d+)", out.stderr)) * 1024
            ranks = per_rank(save, W)
            params, state = max(p for p, _ in ranks), max(s for _, s in ranks)
            rows.append(dict(world=W, zero_sharding=mode, param_bytes=params, grad_bytes=params,
                             optimizer_bytes=state, total_bytes=2 * params + state, peak_rss=rss))
    base = rows[0]
    print(f"{'W':>2} {'ZeRO':>5} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9} {'ratio':>6} "
          f"{'optim ratio':>11} {'peak RSS MB':>12} {'ratio':>6}   (per rank: the largest)")
    for r in rows:
        print(f"{r['world']:>2} {r['zero_sharding']:>5} {r['param_bytes'] / 2**20:>10.1f} "
              f"{r['grad_bytes'] / 2**20:>9.1f} {r['optimizer_bytes'] / 2**20:>9.1f} {r['total_bytes'] / 2**20:>9.1f} "
              f"{r['total_bytes'] / base['total_bytes']:>6.2f} {r['optimizer_bytes'] / base['optimizer_bytes']:>11.2f} "
              f"{r['peak_rss'] / 2**20:>12.0f} {r['peak_rss'] / base['peak_rss']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
