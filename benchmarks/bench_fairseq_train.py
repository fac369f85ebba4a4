"""fairseq-train's tokens/s on the CPU, MoE over its dense equivalent, with glibc's default malloc and with
--moe-keep-freed-memory.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fairseq_train.py            # E = 32, 3 rounds: ~15 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fairseq_train.py --bf16     # the same, both models in bf16
    .venv/bin/python benchmarks/bench_fairseq_train.py --smoke                      # tiny: that it runs

A decoder-only LM on random words (fairseq-preprocess'd into a temporary folder): --layers layers of width --d and
FFN --f, every second FFN an MoE layer of --experts experts of width --f, top-1, dropless, against fairseq's own
transformer_lm with FFN --f everywhere (the same FLOPs per token, the router aside). Each run is one fairseq-train
process, one compute thread (--updates updates of --tokens tokens, Adam, no validation, no checkpoint). Four runs
go in turn, --rounds times: dense and MoE with glibc's defaults, MoE with --moe-keep-freed-memory, and dense with
the same settings through glibc's environment (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_; transformer_lm has no
such flag). Per run: tokens/s of the updates after the first log interval (fairseq's wps of each interval, median),
the peak resident memory and the seconds in the kernel (the process's rusage). Printed: each run's median over the
rounds, MoE / dense under each allocator, keep / default, and whether the final training loss is the same
with either allocator.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

USER_DIR = str(Path(__file__).resolve().parents[1] / "fairseq_moe")
KEEP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 62)}  # glibc's names for the same two


def clean_env():
    """This process's environment without glibc's malloc settings (MALLOC_*_, GLIBC_TUNABLES): the default runs
    get glibc's defaults whatever the caller exported."""
    return {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--d", type=int, default=512, help="model width")
    p.add_argument("--f", type=int, default=2048, help="FFN width, dense and per expert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per update (--max-tokens)")
    p.add_argument("--sample", type=int, default=256, help="--tokens-per-sample")
    p.add_argument("--updates", type=int, default=25)
    p.add_argument("--log-interval", type=int, default=5, help="the first interval is the warm-up, not counted")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bf16", action="store_true",
                   help="both models in bf16 (the plugin's --bf16: fp32 master weights and optimizer state)")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round (seconds per run)")
    return p


def corpus(folder, words=500, sentences=4000, seed=0):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(words)]
    for split, n in (("train", sentences), ("valid", 20)):
        (folder / f"{split}.txt").write_text(
            "".join(" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 60))) + "\n" for _ in range(n)))
    run([sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--workers", "1", "--trainpref",
         str(folder / "train.txt"), "--validpref", str(folder / "valid.txt"), "--destdir", str(folder / "bin")])
    return str(folder / "bin")


def run(cmd, env=None):
    """cmd to its end; -> (stdout + stderr, peak RSS in MB, system seconds)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=dict(clean_env(), OMP_NUM_THREADS="1", **(env or {})))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out, usage.ru_maxrss / 1024, usage.ru_stime


def train_argv(args, data, moe, keep):
    model = (["--task", "moe_language_modeling", "--arch", "moe_transformer_lm", "--criterion", "moe_cross_entropy",
              "--moe-expert-count", str(args.experts), "--moe-freq", "2", "--moe-top-k", "1",
              "--moe-capacity-factor", "0", *(["--moe-keep-freed-memory"] if keep else [])] if moe else
             ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy"])
    return [sys.executable, "-m", "fairseq_cli.train", data, "--user-dir", USER_DIR, *model,
            *(x for flag in ("embed", "input", "output") for x in (f"--decoder-{flag}-dim", str(args.d))),
            "--decoder-ffn-embed-dim", str(args.f), "--decoder-layers",
            str(args.layers), "--decoder-attention-heads", str(max(1, args.d // 64)), "--sample-break-mode", "none",
            "--tokens-per-sample", str(args.sample), "--max-tokens", str(args.tokens), "--cpu", "--seed", "1",
            "--optimizer", "adam", "--lr", "0.0003", "--max-update", str(args.updates), "--disable-validation",
            "--no-save", "--log-format", "simple", "--log-interval", str(args.log_interval), "--num-workers", "0",
            "--no-progress-bar", *(["--bf16"] if args.bf16 else [])]


def tokens_per_s(log):
    """fairseq's wps of each train_inner interval after the first (the warm-up)."""
    wps = [float(m) for m in re.findall(r"train_inner .* wps=([0-9.e+]+)", log)]  # (fairseq's {:g})
    if len(wps) < 2:
        sys.exit(f"fewer than two train_inner intervals in the log (raise --updates):\n{log[-2000:]}")
    return statistics.median(wps[1:])


def final_loss(log):
    """The loss of fairseq's end-of-epoch train line (the allocator must not change it)."""
    found = re.findall(r"\| train \| .*?\| loss ([0-9.]+)", log)
    return float(found[-1]) if found else None


SET_LINE = "--moe-keep-freed-memory: glibc's malloc keeps freed memory"  # (fairseq_moe/hooks/trainer.py logs it)
RUNS = (("dense", False, False), ("dense", False, True), ("moe", True, False), ("moe", True, True))


def smoke_sizes(args):
    """args, at tiny sizes where --smoke is given."""
    if args.smoke:
        args.experts, args.d, args.f, args.tokens, args.sample = 4, 32, 64, 256, 32
        args.updates, args.log_interval, args.rounds = 4, 1, 1
    return args


def main(argv=None):
    args = smoke_sizes(parser().parse_args(argv))
    if os.environ.get("LD_PRELOAD"):
        print(f"note: LD_PRELOAD={os.environ['LD_PRELOAD']} is set: the runs may not use glibc's malloc")
    with tempfile.TemporaryDirectory(prefix="bench_fairseq_train_") as tmp:
        got = measure(args, corpus(Path(tmp), sentences=200 if args.smoke else 4000))
    report(args, got)


def measure(args, data):
    """--rounds rounds of the four runs; -> {run: [(tokens/s, peak RSS MB, kernel s, final loss, whether the flag's
    log line is in its log) per round]}."""
    got = {run_: [] for run_ in RUNS}
    for r in range(args.rounds):
        for name, moe, keep in RUNS:
            log, rss, sys_s = run(train_argv(args, data, moe, keep), env=KEEP_ENV if keep and not moe else None)
            got[name, moe, keep].append((tokens_per_s(log), rss, sys_s, final_loss(log), SET_LINE in log))
            print(f"round {r + 1}: {name:5} {'keep' if keep else 'glibc':5} {got[name, moe, keep][-1][0]:9.1f} "
                  f"tokens/s  {rss:7.0f} MB  {sys_s:5.1f} s sys", flush=True)
    return got


def report(args, got):
    rows = {}
    for key in RUNS:
        name, _, keep = key
        medians = [statistics.median(x[i] for x in got[key]) for i in range(3)]
        rows[f"{name} {'keep' if keep else 'glibc'}"] = dict(zip(("tokens_per_s", "peak_rss_mb", "sys_s"), medians),
                                                          loss=got[key][-1][3], flag_logged=got[key][-1][4],
                                                          rounds=got[key])
    tps = {name: row["tokens_per_s"] for name, row in rows.items()}
    ratios = {"moe / dense, glibc": tps["dense glibc"] / tps["moe glibc"],
              "moe / dense, keep": tps["dense keep"] / tps["moe keep"],
              "moe keep / moe glibc (tokens/s)": tps["moe keep"] / tps["moe glibc"],
              "dense keep / dense glibc (tokens/s)": tps["dense keep"] / tps["dense glibc"]}
    print(f"\nfairseq-train on the CPU, one thread: d={args.d} f={args.f} layers={args.layers}, MoE every 2nd FFN, "
          f"E={args.experts} top-1 dropless, {'bf16' if args.bf16 else 'fp32'}; {args.tokens} tokens per update, {args.updates} updates, "
          f"median of {args.rounds} round(s)")
    print("| run | allocator | tokens/s | peak RSS MB | kernel s |\n| --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name.split()[0]} | {name.split()[1]} | {row['tokens_per_s']:.1f} | {row['peak_rss_mb']:.0f} | "
              f"{row['sys_s']:.1f} |")
    print("time per token, moe / dense: glibc {:.3f}, keep {:.3f}; tokens/s keep / glibc: moe {:.3f}, dense {:.3f}"
          .format(*ratios.values()))
    print("final training loss the same with either allocator: " + ", ".join(
        f"{name} {'yes' if rows[name + ' glibc']['loss'] == rows[name + ' keep']['loss'] else 'NO'}"
        for name in ("dense", "moe")))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rows=rows, ratios=ratios), indent=1))


if __name__ == "__main__":
    main()
