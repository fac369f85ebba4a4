"""fairseq-generate with the experts spread over W ranks (fairseq_moe/hooks/spread.py) against W = 1, on this machine.

    .venv/bin/python benchmarks/bench_generate.py                 # W = 1, 2, 4; a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_generate.py --world 1 2 --sentences 100

One run: a toy translation corpus (random letter words; the target is the source reversed), fairseq-preprocess,
one update of a moe_transformer_tiny whose experts dominate its size (--experts E of width --ffn), saved as one
file; then fairseq-generate on its test set at each W (W = 1: fairseq's own, one process, from the file; W > 1:
python -m fairseq_moe.launch, from the set that python -m fairseq_moe.reshard writes for W ranks, or with
--from-file from the file), each rank under /usr/bin/time. Printed per W, and as ratios to W = 1: the model bytes each
rank holds (the shared tensors + its E/W experts, from the checkpoint), the peak RSS of the largest rank (measured:
torch and fairseq's own ~0.5 GB included), the wall time of the whole command (start-up included) and sentences/s
over it. The hypotheses of every W are checked to be those of W = 1.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VENV_BIN = Path(sys.executable).parent
USER_DIR = str(Path(__file__).resolve().parents[1] / "fairseq_moe")


def corpus(folder, sentences, seed=0):
    rng = random.Random(seed)
    words = [rng.choice("abcdefghij") * rng.randint(1, 3) for _ in range(40)]
    for split, n in (("train", 400), ("valid", 50), ("test", sentences)):
        src = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]
        (folder / f"{split}.src").write_text("\n".join(src) + "\n")
        (folder / f"{split}.tgt").write_text("\n".join(" ".join(reversed(s.split())) for s in src) + "\n")
    run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary", "--workers",
         "1", *(x for split in ("train", "valid", "test") for x in (f"--{split}pref", str(folder / split))),
         "--destdir", str(folder / "bin")])
    return str(folder / "bin")


def run(cmd, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out


def model_bytes(path, world):
    """Bytes of the model tensors one rank holds at world size W: the shared ones + E/W of each expert tensor."""
    with torch.serialization.safe_globals([argparse.Namespace]):  # (fairseq pickles its args)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
    total = 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        total += size // world if re.search(r"\.moe\.experts\.(w1|b1|w2|b2)$", name) else size
    return total


def hypotheses(stdout):
    return {line.split("\t")[0]: line.split("\t")[2] for line in stdout.splitlines() if line.startswith("H-")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192, help="expert width")
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--from-file", action="store_true", help="W > 1 also from the single file (each rank reads it, "
                                                                 "memory-mapped, and cuts out its experts)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    data = corpus(tmp, args.sentences)
    save = tmp / "save"
    run(["fairseq-train", data, "--user-dir", USER_DIR, "--task", "moe_translation", "--arch", "moe_transformer_tiny",
         "--moe-expert-count", str(args.experts), "--encoder-ffn-embed-dim", str(args.ffn), "--decoder-ffn-embed-dim",
         str(args.ffn), "--criterion", "moe_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "0.001",
         "--max-tokens", "2000", "--max-update", "1", "--cpu", "--save-dir", str(save), "--no-epoch-checkpoints",
         "--num-workers", "0", "--no-progress-bar"])
    path = save / "checkpoint_last.pt"
    timed = ["/usr/bin/time", "-f", "MAXRSS_KB %M"]
    rows, reference = [], None
    for W in args.world:
        source = path
        if W > 1 and not args.from_file:
            source = tmp / f"set{W}" / "checkpoint.pt"
            run([sys.executable, "-m", "fairseq_moe.reshard", str(path), str(source), "--world-size", str(W)])
        generate = ["fairseq-generate", data, "--user-dir", USER_DIR, "--path", str(source), "--task",
                    "moe_translation", "--gen-subset", "test", "--beam", "4", "--batch-size", "16", "--max-len-b", "40",
                    "--cpu"]
        cmd = [*timed, *generate] if W == 1 else [
            sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--", *timed, *generate]
        start = time.perf_counter()
        out = run(cmd, timeout=3600)
        wall = time.perf_counter() - start
        hyps = hypotheses(out.stdout)
        if reference is None:
            reference = hyps
        same = hyps == reference
        rss = max(int(m) for m in re.findall(r"MAXRSS_KB (\d+)", out.stderr)) * 1024
        rows.append(dict(world=W, model_bytes=model_bytes(path, W), peak_rss=rss, wall_s=wall,
                         sentences_per_s=len(hyps) / wall, sentences=len(hyps), same_hypotheses=same))
    base = rows[0]
    print(f"{'W':>2} {'model MB/rank':>14} {'ratio':>6} {'peak RSS MB':>12} {'ratio':>6} {'wall s':>7} "
          f"{'sent/s':>7} {'ratio':>6}  same hypotheses as W={base['world']}")
    for r in rows:
        print(f"{r['world']:>2} {r['model_bytes'] / 2**20:>14.1f} {r['model_bytes'] / base['model_bytes']:>6.2f} "
              f"{r['peak_rss'] / 2**20:>12.0f} {r['peak_rss'] / base['peak_rss']:>6.2f} {r['wall_s']:>7.1f} "
              f"{r['sentences_per_s']:>7.1f} {r['sentences_per_s'] / base['sentences_per_s']:>6.2f}  "
              f"{'yes' if r['same_hypotheses'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rows=rows), indent=1))
    if not all(r["same_hypotheses"] for r in rows):
        sys.exit("the hypotheses differ from W = 1")


if __name__ == "__main__":
    main()
