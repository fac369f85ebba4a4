"""fairseq steps of the translation example: BPE, binarisation, training,
generation and scoring. Each fairseq tool runs as a child process whose output
is streamed to the console and copied to a log file. Two models may train at
once, each in a thread of its own under `job(name, threads)`: its children's
lines are then prefixed with the name and they run on that many threads."""

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from corpus import SPLITS, done_marker

BPE_VOCAB = 8000


class StepError(RuntimeError):
    """A fairseq step failed; the message says where its log is."""


_job = threading.local()  # .name, .threads: set by job() in the thread that runs one model's steps
_children = set()  # the running children, for stop_children()
_children_lock = threading.Lock()
_stopping = threading.Event()  # set by stop_children(): no new child starts


@contextmanager
def job(name, threads):
    """In this thread, children run on `threads` compute threads and their lines are echoed as "[name] ..."."""
    _job.name, _job.threads = name, threads
    try:
        yield
    finally:
        _job.name = _job.threads = None


def stop_children():
    """Terminate the children still running (the other model's, when one model's step failed)."""
    with _children_lock:
        _stopping.set()
        for proc in list(_children):
            proc.terminate()


def run_at_once(run_one, names, threads):
    """run_one(name) for each name at the same time, each in a thread whose children run on `threads` threads;
    -> {name: its result}. When one fails, the others' children are stopped and its error is raised."""
    _stopping.clear()
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(_as_job, run_one, name, threads) for name in names}
        wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = [f for f in futures.values() if f.done() and f.exception()]
        if failed:
            stop_children()
            raise failed[0].exception()
        return {name: f.result() for name, f in futures.items()}


def _as_job(run_one, name, threads):
    with job(name, threads):
        return run_one(name)


def child_env():
    """Environment for fairseq children: unbuffered, bounded thread count."""
    env = dict(os.environ)
    # torch would otherwise pick its own thread count; on a small shared box
    # oversubscription makes training much slower, so use exactly the cores
    # this process may run on (unless the user chose a value), or the job's share of them.
    threads = (str(_job.threads) if getattr(_job, "threads", None) else None) or env.get("OMP_NUM_THREADS") \
        or str(len(os.sched_getaffinity(0)))
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    # OpenMP threads that spin while waiting collapse when anything else
    # runs on the cores: on 2 busy cores the tiny models trained 4-5x slower
    # (0.4 vs 1.5-2 updates/s). Sleeping waits cost little on an idle machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_logged(cmd, log_file):
    """Run cmd, echo its output live and tee it to log_file; fail loudly. -> the child's CPU seconds (user +
    system, its own children's included), which, unlike its wall time, other jobs on the same cores do not
    inflate."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"[{_job.name}] " if getattr(_job, "name", None) else ""
    print(prefix + "| $ " + shlex.join(cmd), flush=True)
    with open(log_file, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=child_env(), text=True, bufsize=1)
        with _children_lock:
            if _stopping.is_set():
                proc.kill()
            _children.add(proc)
        try:
            for line in proc.stdout:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()  # keep progress visible when piped, e.g. into tee
                log.write(line)
            _, status, usage = os.wait4(proc.pid, 0)  # (Popen.wait would not give this child's own rusage)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            with _children_lock:
                _children.discard(proc)
    if proc.returncode != 0:
        raise StepError(f"exit code {proc.returncode} from {cmd[2]} (log: {log_file})")
    return usage.ru_utime + usage.ru_stime


def fairseq_cmd(tool):
    # The venv's own interpreter, so the script works without activating it.
    return [sys.executable, "-m", f"fairseq_cli.{tool}"]


# ------------------------------------------------------------ BPE + binarise


def learn_bpe(raw_dir, src, tgt, threads):
    """Joint sentencepiece BPE on the training side; encode every split."""
    import sentencepiece as spm

    bpe_dir = Path(raw_dir).parent / f"spm{BPE_VOCAB}"
    model = bpe_dir / "spm.model"
    if done_marker(bpe_dir).exists():
        print(f"| reusing the BPE model and encoded text in {bpe_dir}")
        return bpe_dir, model
    bpe_dir.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=[str(Path(raw_dir) / f"train.{l}") for l in (src, tgt)],
        model_prefix=str(bpe_dir / "spm"),
        vocab_size=BPE_VOCAB,
        model_type="bpe",
        character_coverage=1.0,  # keep every accented letter of both languages
        hard_vocab_limit=False,  # small user corpora may not support 8000 pieces
        num_threads=threads,
        minloglevel=1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for split in SPLITS:
        for lang in (src, tgt):
            lines = (Path(raw_dir) / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            pieces = sp.encode(lines, out_type=str)
            with open(bpe_dir / f"{split}.{lang}", "w", encoding="utf-8") as f:
                f.writelines(" ".join(p) + "\n" for p in pieces)
    done_marker(bpe_dir).touch()
    return bpe_dir, model


def binarize(bpe_dir, src, tgt, threads):
    """fairseq-preprocess with one dictionary shared by both languages."""
    data_bin = Path(bpe_dir) / "data-bin"
    if done_marker(data_bin).exists():
        print(f"| reusing the binarised data in {data_bin}")
        return data_bin
    cmd = fairseq_cmd("preprocess") + [
        "--source-lang", src, "--target-lang", tgt,
        "--trainpref", str(Path(bpe_dir) / "train"),
        "--validpref", str(Path(bpe_dir) / "valid"),
        "--testpref", str(Path(bpe_dir) / "test"),
        "--destdir", str(data_bin),
        "--joined-dictionary", "--workers", str(threads),
    ]
    run_logged(cmd, Path(bpe_dir) / "preprocess.log")
    done_marker(data_bin).touch()
    return data_bin


# ------------------------------------------------------------------ training


def common_train_args(a, save_dir):
    """Everything the two models share: optimiser, schedule, budget, seed."""
    args = [
        "--share-all-embeddings",
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--lr", str(a.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(a.warmup_updates),
        "--warmup-init-lr", "1e-07",
        "--dropout", "0.1",
        "--max-tokens", str(a.max_tokens), "--max-update", str(a.max_update),
        "--seed", str(a.seed),
        "--save-dir", str(save_dir),
        # Only checkpoint_best.pt is kept: it is what gets evaluated.
        "--no-epoch-checkpoints", "--no-last-checkpoints",
        "--skip-invalid-size-inputs-valid-test",
        "--log-format", "simple", "--log-interval", str(a.log_interval),
        "--num-workers", "0",  # loading is cheap; a worker process would steal a core
    ]
    return args + device_args(a)


def device_args(a):
    """--cpu on the CPU; --bf16 (the plugin's, which the dense model then loads too) or --fp16."""
    args = ["--cpu"] if a.device == "cpu" else []
    if getattr(a, "bf16", False):
        return args + ["--bf16"]
    return args + (["--fp16"] if a.fp16 else [])


def native_bf16(device):
    """Whether `device` ("cpu" or "cuda") computes bfloat16 natively, as the plugin's --bf16 checks it."""
    from fairseq_moe.hooks import bf16

    return bf16.cuda_has_bf16() if device == "cuda" else bf16.cpu_has_fast_bf16()


def dense_train_cmd(a, data_bin, save_dir, user_dir):
    """fairseq's own transformer; with --bf16 through the plugin (user_dir), whose --bf16 is the device's (fairseq
    0.12's own means a TPU): the model is fairseq's either way."""
    plugin = ["--user-dir", str(user_dir)] if getattr(a, "bf16", False) else []
    return fairseq_cmd("train") + [str(data_bin), *plugin,
        "--task", "translation", "--arch", "transformer",
        "--encoder-layers", "3", "--decoder-layers", "3",
        "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
        "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    ] + common_train_args(a, save_dir)


def moe_train_cmd(a, data_bin, save_dir, user_dir, stats_file):
    return fairseq_cmd("train") + [str(data_bin),
        "--user-dir", str(user_dir),
        "--task", "moe_translation", "--arch", "moe_transformer_tiny",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--moe-expert-count", str(a.experts), "--moe-top-k", str(a.top_k),
        "--moe-expert-ffn-dim", str(a.expert_ffn_dim),
        # Dropless at validation and generation: a capacity limit there makes a sentence's translation
        # depend on the other sentences of its batch (and BLEU on --batch-size).
        "--moe-capacity-factor", "1.25", "--moe-eval-capacity-token-fraction", "0",
        "--moe-gate-loss-wt", "0.01",
        "--moe-stats-file", str(stats_file), "--moe-stats-interval", str(a.log_interval),
    ] + common_train_args(a, save_dir)


def train(cmd, save_dir):
    """Train from scratch (fairseq would resume from an old checkpoint).
    Returns (checkpoint_best.pt, wall seconds, CPU seconds of the training)."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    for old in save_dir.glob("checkpoint*.pt"):
        old.unlink()
    start = time.time()
    cpu = run_logged(cmd, save_dir / "train.log")
    seconds = time.time() - start
    checkpoint = save_dir / "checkpoint_best.pt"
    if not checkpoint.exists():
        raise StepError(f"training finished without writing {checkpoint}")
    return checkpoint, seconds, cpu


def last_valid_stats(log_file):
    """nll_loss (base 2) and ppl of the last validation pass, from the fairseq log."""
    stats = {}
    for line in open(log_file, encoding="utf-8"):
        if "valid on 'valid' subset" in line:
            stats = dict(re.findall(r"\| (\w+) ([-\d.e+]+)", line))
    return {k: float(stats[k]) for k in ("nll_loss", "ppl") if k in stats}


def count_params(log_file):
    """Trainable parameters, as fairseq-train logs them (tied ones counted once)."""
    total = 0
    for line in open(log_file, encoding="utf-8"):
        # "num. shared model params: 2,383,872 (...)" and "num. expert model params: 0 (...)"
        m = re.search(r"num\. (?:shared|expert) model params: ([\d,]+)", line)
        if m:
            total += int(m.group(1).replace(",", ""))
    return total


# -------------------------------------------------------- generation / score


def generate(a, data_bin, checkpoint, out_dir, extra_args=()):
    """Beam-search the test set; returns {sentence id: hypothesis BPE pieces}."""
    out_dir = Path(out_dir)
    cmd = fairseq_cmd("generate") + [str(data_bin), *extra_args,
        "--path", str(checkpoint), "--gen-subset", "test",
        "--beam", "5", "--batch-size", str(a.gen_batch_size),
        # An undertrained model can babble up to 200 tokens a sentence; cap
        # the output at 1.2 x source + 10 (French runs ~10% longer).
        "--max-len-a", "1.2", "--max-len-b", "10",
        "--results-path", str(out_dir),
        "--log-format", "simple", "--num-workers", "0",
    ] + (["--cpu"] if a.device == "cpu" else []) + (["--bf16"] if getattr(a, "bf16", False) else []) + (
        ["--fp16"] if getattr(a, "fp16", False) else [])  # (decoding in the precision the models trained in)
    run_logged(cmd, out_dir / "generate.log")
    hyps = {}
    # fairseq batches by length; the H-<id> lines give the original order.
    for line in open(out_dir / "generate-test.txt", encoding="utf-8"):
        if line.startswith("H-"):
            ident, _score, text = line.rstrip("\n").split("\t")
            hyps[int(ident[2:])] = text
    return hyps


def detokenize(pieces_lines, spm_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    return [sp.decode_pieces(line.split()) for line in pieces_lines]


def score(hyps, refs):
    import sacrebleu

    if len(hyps) != len(refs):
        raise StepError(f"{len(hyps)} hypotheses for {len(refs)} references")
    return {
        "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
    }


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
