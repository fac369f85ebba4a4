"""Routing ablation: the quickstart's corpus, model and budget, one row per routing policy and score.

    .venv/bin/python benchmarks/gate_ablation.py                       # every row, the quickstart budget
    .venv/bin/python benchmarks/gate_ablation.py --policies topk,hash --max-update 300

Each row trains moe_transformer_tiny exactly as examples/translation/run.py does (data, BPE, budget, lr
schedule, seed, dropless decoding), with only the routing flags of the row added, then decodes the test
books and scores them. It prints one table (BLEU, chrF, valid ppl, training time: wall and CPU seconds
of the training process, the CPU time being what other jobs on the same cores do not inflate; the
router's last logged imbalance = max/mean tokens per expert) and writes it to RUN_DIR/gate_ablation.md and .json,
again after every row. Every flag of run.py (--max-update, --experts, --device, ...) is taken as it is.
Each row's result is kept in RUN_DIR/NAME/row.json; `--reuse` takes a row from there instead of training
it again when it was measured with the same budget and flags (the table says when each row was measured;
a change of the code in between is not detected: do not reuse rows across one that changes routing).
"""
import argparse
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "translation"))

import pipeline  # noqa: E402
import run as quickstart  # noqa: E402

# name -> (fairseq-train flags added to the quickstart's MoE model, what it is)
POLICIES = {
    "topk": ([], "top-2, softmax, GShard priority, balance loss (the quickstart's)"),
    "topk-gaussian-noise": (["--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "0.125"],
                            "+ Gaussian logit noise in training (Tutel: 1/E)"),
    "topk-moe-branch": (["--moe-second-expert-policy", "sampling", "--moe-batch-prioritized-routing"],
                        "second expert sampled, batch-prioritized (fairseq's moe branch)"),
    "sigmoid-aux-free-bias": (["--moe-score", "sigmoid", "--moe-bias-update-rate", "0.001",
                               "--moe-gate-loss-wt", "0"], "sigmoid scores, balancing bias, no balance loss "
                                                           "(DeepSeek-V3)"),
    "importance-load": (["--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "1.0",
                         "--moe-gate-loss-type", "importance_load", "--moe-gate-loss-wt", "0.1"],
                        "noisy top-k with importance + load losses (Shazeer et al. 2017)"),
    "dense-routing": (["--moe-routing", "dense"], "every expert on every token, weighted (8x the expert FLOPs)"),
    "hash": (["--moe-routing", "hash", "--moe-top-k", "1"], "token id mod E, k = 1 (Roller et al. 2021)"),
    "expert-choice-encoder": (["--moe-routing", "expert_choice", "--moe-freq", "0", "--encoder-moe-freq", "2"],
                              "experts pick tokens (Zhou et al. 2022); encoder only, dense-FFN decoder"),
    "soft-encoder": (["--moe-routing", "soft", "--moe-gate", "scaled_cosine", "--moe-freq", "0",
                      "--encoder-moe-freq", "2"],
                     "Soft MoE slots, normalised router (Puigcerver et al. 2023); encoder only, dense-FFN decoder"),
}


def _number(value):
    return "-" if value is None else f"{value:.2f}"


def last_imbalance(log_file):
    values = re.findall(r"\bmoe_imbalance=([\d.]+)", Path(log_file).read_text(encoding="utf-8"))
    return float(values[-1]) if values else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated rows to run, of: {', '.join(POLICIES)}")
    p.add_argument("--reuse", action="store_true",
                   help="take rows already measured with the same budget and flags from RUN_DIR/NAME/row.json")
    own, rest = p.parse_known_args(argv)
    names = [n for n in own.policies.split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        p.error(f"--policies: unknown {unknown} (choose from {', '.join(POLICIES)})")
    a = quickstart.parse_args(rest + ["--skip-dense"])
    try:
        run(a, names, own.reuse)
    except (quickstart.corpus.CorpusError, pipeline.StepError) as e:
        sys.exit(f"error: {e}")


def run(a, names, reuse=False):
    start = time.time()
    raw_dir, spm_model, data_bin, _ = quickstart.prepare_data(a)
    refs = (raw_dir / f"test.{a.tgt_lang}").read_text(encoding="utf-8").splitlines()
    run_dir = a.workdir / "runs" / raw_dir.parent.name / "gate_ablation"
    budget = (f"{a.max_update} updates x {a.max_tokens} tokens, {a.experts} experts of {a.expert_ffn_dim}, "
              f"top-{a.top_k}, lr {a.lr}, warm-up {a.warmup_updates}, seed {a.seed}, {a.device}"
              + (", fp16" if a.fp16 else ""))
    results = {}
    for name in names:
        flags, what = POLICIES[name]
        model_dir = run_dir / name
        kept = _kept_row(model_dir / "row.json", budget, flags) if reuse else None
        if kept:
            print(f"| {name}: reused from {model_dir / 'row.json'} (measured {kept['date']})", flush=True)
            results[name] = kept
        else:
            cmd = (pipeline.moe_train_cmd(a, data_bin, model_dir, quickstart.PLUGIN_DIR, model_dir / "load.jsonl")
                   + flags)
            (model_dir / "load.jsonl").unlink(missing_ok=True)
            r = quickstart.run_model(a, name, cmd, ["--user-dir", str(quickstart.PLUGIN_DIR), "--task",
                                                    "moe_translation"], data_bin, spm_model, refs, model_dir)
            results[name] = dict(r, flags=flags, what=what, imbalance=last_imbalance(model_dir / "train.log"),
                                 budget=budget, date=time.strftime("%Y-%m-%d %H:%M"))
            pipeline.write_json(model_dir / "row.json", results[name])
        write_table(run_dir, budget, results, time.time() - start)


def _kept_row(path, budget, flags):
    """A row measured before with this budget and these flags, or None."""
    if not path.exists():
        return None
    row = json.loads(path.read_text(encoding="utf-8"))
    return row if row.get("budget") == budget and row.get("flags") == flags else None


def write_table(run_dir, budget, results, wall_seconds):
    header = ("| routing | flags | BLEU | chrF | valid ppl | train time (wall) | train CPU time | imbalance | "
              "measured |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = "".join(f"| {n} ({r['what']}) | `{' '.join(r['flags']) or '(none)'}` | {r['bleu']:.2f} | "
                   f"{r['chrf']:.2f} | {_number(r.get('valid_ppl'))} | {quickstart._duration(r['train_seconds'])} | "
                   f"{quickstart._duration(r['train_cpu_seconds'])} | {_number(r['imbalance'])} | {r['date']} |\n"
                   for n, r in results.items())
    table = f"Routing ablation ({budget})\n\n{header}{rows}"
    print("\n" + table)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "gate_ablation.md").write_text(table, encoding="utf-8")
    pipeline.write_json(run_dir / "gate_ablation.json", {"budget": budget, "results": results,
                                                        "wall_seconds": round(wall_seconds, 1)})
    print(f"| table: {run_dir / 'gate_ablation.md'}", flush=True)


if __name__ == "__main__":
    main()
