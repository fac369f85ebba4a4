"""The device check: the plugin on one GPU, every step in one command, the results in one folder.

    bash benchmarks/gpu_check.sh [OUT_DIR]                 # on the lent GPU: fairseq from .whl/ where it is missing
    bash benchmarks/gpu_check.sh --device cpu OUT_DIR      # the rehearsal on a CPU, tiny sizes (a test runs it)
    python benchmarks/device_check.py --device cuda --out OUT_DIR   # what gpu_check.sh runs

Steps, in order, each a subprocess with a time limit (on a GPU all of them within --budget-s, 560 s by default;
gpu_check.sh passes what is left of 570 s after installing fairseq), its output streamed to its log:
  kernel-tests     pytest -m gpu tests/fairseq_moe_kernels: the kernels in bf16/fp16 against fp32 references (on a
                   CPU they skip: no CUDA)
  translate-P      examples/translation/run.py, the quickstart's two models (moe_transformer_tiny, 8 experts, and its
                   dense twin) on a synthetic corpus written here (nothing downloaded), in precision P (fp16 and bf16
                   on a GPU; fp32 and bf16 on a CPU, where run.py has no fp16): fairseq-train of each, then
                   fairseq-generate from its checkpoint; PASS when each model's training loss is finite and falls and
                   every test sentence is translated; the line gives tokens/s MoE over dense and each BLEU
  selftest         python -m fairseq_moe.selftest --nproc 1 --only fp16 bf16 (NCCL on a GPU, gloo on a CPU): a
                   torchrun rank against one process, in fp16 and bf16 on the GPU (one GPU runs no collective of
                   the experts: at one rank there is no expert parallelism)
  kernels          benchmarks/bench_kernels.py --quick (--smoke on a CPU): every backend's correctness on the
                   device, then the grouped MLP's time against the device's bf16 matmul of the same FLOPs
  layer            benchmarks/bench_train.py (--smoke on a CPU): a quickstart-size MoE LM over its dense equivalent
Out (at most 8 files): summary.txt (the environment, then one line per step: PASS / FAIL / SKIP, the figures, the
seconds), kernel_tests.log, translate.log, selftest.log, kernels.log, kernels.json, layer.log, layer.json.
Exit status 1 when a step failed, or did not run for want of time (INCOMPLETE).
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (seconds a step may take on a GPU; the rehearsal's tiny sizes take far less, but a CPU is slower: it gets 3x)
LIMITS = {"kernel-tests": 120, "translate": 110, "selftest": 90, "kernels": 90, "layer": 40}  # 560 s in all
# At one rank the plugin builds no expert parallelism and fairseq wraps nothing for FSDP: of the self-test's features
# only the CUDA training paths and NCCL's set-up run there (one GPU cannot test the collectives).
SELFTEST_GPU = ("fp16", "bf16")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the device check; cpu: its rehearsal at tiny sizes")
    p.add_argument("--out", required=True, help="the results' folder (made if missing)")
    p.add_argument("--work", help="the runs' folder (default: a temporary one, removed unless a step failed)")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="seconds for all the steps together; a step gets the least of its own limit and what is left")
    p.add_argument("--selftest-only", nargs="+", metavar="FEATURE",
                   help=f"the self-test's features (default: {' '.join(SELFTEST_GPU)})")
    p.add_argument("--skip", nargs="+", default=[], choices=("kernel-tests", "translate", "selftest", "kernels",
                                                             "layer"), help="steps not to run (a SKIP line each)")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA GPU here (--device cpu rehearses the check on the CPU)")
    return args


def synthetic_corpus(folder, lines, seed=0):
    """A learnable toy translation (nothing downloaded): source sentences over a vocabulary of made-up words; the
    target is each word spelled backwards and capitalised, in reverse order. -> (source file, target file)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "gu", "ba", "fe"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)})
    src, tgt = Path(folder) / "synthetic.src", Path(folder) / "synthetic.tgt"
    with open(src, "w") as fs, open(tgt, "w") as ft:
        for _ in range(lines):
            s = [rng.choice(words) for _ in range(rng.randint(3, 14))]
            fs.write(" ".join(s) + "\n")
            ft.write(" ".join(w[::-1].capitalize() for w in reversed(s)) + "\n")
    return src, tgt


def train_figures(log_file):
    """(losses, tokens/s) of a fairseq-train log: the train_inner intervals' loss and wps (the first interval, the
    warm-up, left out of the tokens/s), or the epochs' where there are fewer than two intervals."""
    text = Path(log_file).read_text(errors="replace")
    inner = re.findall(r"\btrain_inner\W+epoch .*? loss=([^,]+),.*? wps=([^,]+),", text)
    epochs = re.findall(r"\btrain\W+epoch \d+ \| loss ([^ ]+) \|.*?\| wps ([^ ]+) \|", text)
    rows = inner if len(inner) >= 2 else epochs
    losses = [float(loss) for loss, _ in rows]
    wps = [float(w) for _, w in rows]
    return losses, (statistics.median(wps[1:]) if len(wps) >= 2 else (wps[0] if wps else float("nan")))


class Check:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="device_check_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.failed = self.incomplete = False
        self.summary = self.out / "summary.txt"
        self.summary.write_text("")

    def line(self, text):
        print(text, flush=True)
        with open(self.summary, "a") as f:
            f.write(text + "\n")

    def run(self, cmd, log, limit):
        """cmd with its output appended to log as it comes (a kill from outside keeps what it printed); -> (exit
        status, None when it ran past its limit or what --budget-s had left; the output)."""
        limit = min(limit * (3 if self.args.device == "cpu" else 1), self.deadline - time.monotonic())
        if limit <= 0:
            return None, ""
        path = self.out / log
        with open(path, "a") as f:
            f.write(f"\n$ {' '.join(map(str, cmd))}\n")
            begin = f.tell()
            f.flush()
            proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                status = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                status = None
                _end(proc)
        with open(path) as f:
            f.seek(begin)
            return status, f.read()

    def step(self, name, fn):
        if name.split("-")[0] in self.args.skip or name in self.args.skip:
            self.line(f"SKIP  {name:15s} (--skip)")
            return
        if self.deadline - time.monotonic() <= 0:
            self.line(f"SKIP  {name:15s} (no time left in --budget-s)")
            self.incomplete = True
            return
        start = time.monotonic()
        try:
            verdict, text = fn()
        except Exception as e:  # (a step's own bug is that step's FAIL, the others still run)
            verdict, text = "FAIL", f"{type(e).__name__}: {e}"
        self.failed |= verdict == "FAIL"
        self.line(f"{verdict:5s} {name:15s} {text}  ({time.monotonic() - start:.0f} s)")


def _end(proc):
    """A run past its limit: SIGTERM to its process group (torchrun then stops its workers, which run in sessions of
    their own), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # (it ended meanwhile)
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def failure(status):
    """What a run that did not exit 0 did: timed out (None) or its exit status."""
    return "timed out" if status is None else f"exit {status}"


def last_line(output, pattern):
    found = [ln for ln in output.splitlines() if re.search(pattern, ln)]
    return found[-1].strip() if found else ""


def kernel_tests(c):
    status, out = c.run([sys.executable, "-m", "pytest", "-v", "-m", "gpu", "tests/fairseq_moe_kernels",
                            "-p", "no:cacheprovider"], "kernel_tests.log", LIMITS["kernel-tests"])
    counts = last_line(out, r"\d+ (passed|failed|skipped|error)")
    if status is None:  # (-v: each test's line as it ends, so a kill keeps what ran)
        done = {v: len(re.findall(rf" {v}\b", out)) for v in ("PASSED", "FAILED", "ERROR")}
        return "FAIL", f"timed out after {done['PASSED']} passed, {done['FAILED']} failed, {done['ERROR']} errors"
    if status == 0 and " passed" not in counts:  # (every one skipped: no CUDA here)
        return "SKIP", counts
    return ("PASS" if status == 0 else "FAIL"), counts or f"pytest exit {status}"


def translate(c, precision, corpus):
    cpu, work = c.args.device == "cpu", c.work / "translation"
    sizes = (["--max-update", "24", "--max-tokens", "512", "--log-interval", "4"] if cpu else
             ["--max-update", "200", "--max-tokens", "4096", "--log-interval", "50"])
    flags = ["--fp16"] if precision == "fp16" else ["--precision", precision]
    cmd = [sys.executable, "examples/translation/run.py", "--device", c.args.device, *flags, "--sequential",
           "--src-file", corpus[0], "--tgt-file", corpus[1], "--src-lang", "xx", "--tgt-lang", "yy",
           "--workdir", work, *sizes]
    status, out = c.run(cmd, "translate.log", LIMITS["translate"])
    if status != 0:
        return "FAIL", failure(status) + ": " + (
            last_line(out, r"error|Error") or "see translate.log")
    run_dir = next((work / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())["results"]
    figures, problems = {}, []
    for model in ("moe", "dense"):
        losses, wps = train_figures(run_dir / model / "train.log")
        with open(c.out / "translate.log", "a") as f:
            f.write(f"{precision} {model}: training losses {losses}, tokens/s {wps}\n")
        if len(losses) < 2 or not all(map(math.isfinite, losses)) or losses[-1] >= losses[0]:
            problems.append(f"{model}'s training loss not finite and falling: {losses}")
        figures[model] = (losses, wps, results[model]["bleu"])
    (m_loss, m_wps, m_bleu), (d_loss, d_wps, d_bleu) = figures["moe"], figures["dense"]
    text = (f"tokens/s MoE {m_wps:.0f} / dense {d_wps:.0f} (time per token, MoE / dense {d_wps / m_wps:.3f}); loss MoE "
            f"{m_loss[0]:.2f} -> {m_loss[-1]:.2f}, dense {d_loss[0]:.2f} -> {d_loss[-1]:.2f}; BLEU MoE {m_bleu}, dense "
            f"{d_bleu}")
    return ("FAIL", "; ".join(problems) + "; " + text) if problems else ("PASS", text)


def selftest(c):
    gpu = c.args.device == "cuda"
    features = c.args.selftest_only or SELFTEST_GPU
    limit = LIMITS["selftest"] * (1 if gpu else 3)
    cmd = [sys.executable, "-m", "fairseq_moe.selftest", "--nproc", "1", "--device", c.args.device,
           "--backend", "nccl" if gpu else "gloo", "--timeout", str(limit // 2),
           "--only", *features]  # (its own --timeout per run, so that a hung run is its FAIL line, not this step's)
    status, out = c.run(cmd, "selftest.log", LIMITS["selftest"])
    verdicts = re.findall(r"^(PASS|FAIL|SKIP)\s+(\S+)", out, re.M)
    text = ", ".join(f"{name} {v}" for v, name in verdicts) or "no feature line"
    if status is None:
        return "FAIL", f"timed out after: {text}"
    return ("PASS" if status == 0 and verdicts else "FAIL"), f"{cmd[cmd.index('--backend') + 1]} --nproc 1: {text}"


def kernels(c):
    cpu = c.args.device == "cpu"
    size = ["--smoke"] if cpu else ["--quick", "--budget-s", str(LIMITS["kernels"] - 30)]  # (the checks before it)
    status, out = c.run([sys.executable, "benchmarks/bench_kernels.py", *size, "--out", c.out / "kernels.json"],
                           "kernels.log", LIMITS["kernels"])
    correct = re.findall(r"^correctness: (\d+)/(\d+) pass", out, re.M)
    targets = last_line(out, r"\d+/\d+ PASS")  # (the speed targets: figures to record, not the verdict)
    text = (f"correctness {'/'.join(correct[-1])} pass" if correct else "no correctness line") + f"; targets {targets}"
    passed = bool(correct) and correct[-1][0] == correct[-1][1] != "0"
    if status is None and passed:  # (--budget-s is checked before each config: one may run past the limit)
        return "PASS", text + " (timings cut at the step's limit)"
    if status != 0:
        return "FAIL", f"{failure(status)}: {text}"
    return ("PASS" if passed else "FAIL"), text


def layer(c):
    cmd = [sys.executable, "benchmarks/bench_train.py", "--out", c.out / "layer.json",
           *(["--smoke"] if c.args.device == "cpu" else [])]
    status, out = c.run(cmd, "layer.log", LIMITS["layer"])
    text = last_line(out, r"MoE / dense")
    if status != 0:
        return "FAIL", f"{failure(status)}: {text}"
    return "PASS", text


def environment():
    import torch

    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts += [f"CUDA {torch.version.cuda}", torch.cuda.get_device_name(),
                  f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}"]
    for module in ("triton", "fairseq", "transformers"):
        try:
            parts.append(f"{module} {__import__(module).__version__}")
        except Exception as e:  # (a missing one is named: its steps then fail with their own line)
            parts.append(f"{module}: {type(e).__name__}")
    return ", ".join(parts)


def main(argv=None):
    args = parse(argv)
    c = Check(args)
    c.line(f"device check ({args.device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): {environment()}")
    c.step("kernel-tests", lambda: kernel_tests(c))
    corpus = synthetic_corpus(c.work, 2000 if args.device == "cpu" else 20000)
    for precision in (("fp32", "bf16") if args.device == "cpu" else ("fp16", "bf16")):
        c.step(f"translate-{precision}", lambda: translate(c, precision, corpus))
    c.step("selftest", lambda: selftest(c))
    c.step("kernels", lambda: kernels(c))
    c.step("layer", lambda: layer(c))
    verdict = "FAIL" if c.failed else "INCOMPLETE" if c.incomplete else "PASS"
    if verdict != "PASS" or args.work:
        c.line(f"{verdict}: the device check; logs in {c.out}, runs kept in {c.work}")
    else:
        shutil.rmtree(c.work, ignore_errors=True)
        c.line(f"PASS: the device check; logs in {c.out}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
