"""python -m fairseq_moe.selftest: the plugin's multi-process features, W ranks against one process, on this machine.

    python -m fairseq_moe.selftest                          # every feature; W: this node's GPUs, or 2 on a CPU
    python -m fairseq_moe.selftest --nproc 4 --only spread a2a-2d
    python -m fairseq_moe.selftest --device cpu --backend gloo --nproc 2 --list

Each feature trains a tiny MoE transformer (train_argv, which the tests train too) on a toy task written here
(nothing is downloaded) for a few updates, on W ranks and on one process with --update-freq W (the same global
batches; dropless, no dropout, SGD), and compares the parameters the two runs saved (the W ranks' set assembled:
every expert); generate compares fairseq-generate from that set on W ranks and on one process (every hypothesis,
its scores, the BLEU line). It prints one line per feature, e.g.

    PASS  spread       largest relative difference 2.7e-07 (at most 1e-04)     6.3 s

the difference being, over every parameter tensor, max |W ranks - one process| / max(max |one process|, 1e-3)
(generate and eval-lm: of the printed scores and loss too; atomic-save compares W ranks after the kill with W ranks
without it).
A feature the world size cannot run (the 2-D all-to-all needs 4 ranks or more) is a SKIP line; a run that fails or
times out (a collective that never returns: the run gets SIGTERM, then SIGKILL) is a FAIL line naming its log, kept
with the work folder. Exit status: 0 when nothing failed, 1 when a feature failed, 2 on bad input (one line, before
anything runs).
On a CPU the W ranks are `python -m fairseq_moe.launch` (gloo); on CUDA, torchrun (NCCL), one GPU per rank.
"""
import argparse
import dataclasses
import math
import os
import random
import shutil
import site
import subprocess
import sys
import tempfile
import time

from .errors import FlagError

# The toy task and the tiny model (the tests train them too: tests/fairseq_moe/helpers.py).
USER_DIR = os.path.dirname(os.path.abspath(__file__))


def write_corpus(folder, seed=0):
    """A toy translation task (reverse and upper-case the words), big enough for a few updates."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t".split()
    for split, n in (("train", 300), ("valid", 30), ("test", 20)):
        with open(f"{folder}/{split}.src", "w") as fs, open(f"{folder}/{split}.tgt", "w") as ft:
            for _ in range(n):
                s = [rng.choice(words) for _ in range(rng.randint(2, 11))]
                fs.write(" ".join(s) + "\n")
                ft.write(" ".join(w.upper() for w in reversed(s)) + "\n")


def write_lm_corpus(folder, seed=0):
    """A toy language (runs of the alphabet from a random letter)."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t".split()
    for split, n in (("train", 300), ("valid", 30), ("test", 20)):
        with open(f"{folder}/{split}.txt", "w") as f:
            for _ in range(n):
                start = rng.randrange(len(words))
                f.write(" ".join(words[(start + i) % len(words)] for i in range(rng.randint(3, 12))) + "\n")


def preprocess_argv(folder, lm=False):
    """fairseq-preprocess's arguments for write_corpus(folder) (lm: write_lm_corpus's), into folder/bin."""
    if lm:
        return ["--only-source", "--workers", "1", "--trainpref", f"{folder}/train.txt", "--validpref",
                f"{folder}/valid.txt", "--testpref", f"{folder}/test.txt", "--destdir", f"{folder}/bin"]
    return ["--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary", "--workers", "1",
            "--trainpref", f"{folder}/train", "--validpref", f"{folder}/valid", "--testpref", f"{folder}/test",
            "--destdir", f"{folder}/bin"]


def binarise(folder, in_process=True, lm=False, seed=0):
    """write_corpus (lm: write_lm_corpus) + fairseq-preprocess into folder/bin (in this process, or as a child that
    imports fairseq in its place); -> that path."""
    (write_lm_corpus if lm else write_corpus)(folder, seed)
    if in_process:
        from fairseq import options
        from fairseq_cli import preprocess

        preprocess.main(options.get_preprocessing_parser().parse_args(preprocess_argv(folder, lm)))
    else:
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", *preprocess_argv(folder, lm)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return os.path.join(str(folder), "bin")


def train_argv(data, save_dir, *extra, cpu=True):
    """fairseq-train of a tiny MoE transformer (2 + 2 layers of width 32, FFN 64) on the toy task; extra last."""
    return [
        data, "--user-dir", USER_DIR, "--task", "moe_translation", "--arch", "moe_transformer_tiny",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--max-tokens", "800", *(["--cpu"] if cpu else []), "--seed", "3",
        "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "1", "--num-workers", "0", "--no-progress-bar",
        *(() if "--optimizer" in extra else ("--optimizer", "adam", "--lr", "0.003")), *extra,
    ]


# The LM data flags, shared by training and fairseq-eval-lm (one sentence per block, as evaluated).
LM_DATA = ("--sample-break-mode", "eos", "--tokens-per-sample", "32")


def lm_train_argv(data, save_dir, *extra, cpu=True):
    """fairseq-train of a tiny MoE decoder-only LM (2 layers of width 32, FFN 64) on the toy language; extra last."""
    return [
        data, "--user-dir", USER_DIR, "--task", "moe_language_modeling", "--arch", "moe_transformer_lm_tiny",
        "--criterion", "moe_cross_entropy", *LM_DATA,
        "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-layers", "2",
        "--decoder-attention-heads", "2", "--max-tokens", "400", *(["--cpu"] if cpu else []), "--seed", "1",
        "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "1", "--num-workers", "0", "--no-progress-bar",
        *(() if "--optimizer" in extra else ("--optimizer", "adam", "--lr", "0.003")), *extra,
    ]


def eval_lm_argv(data, path, *extra, cpu=True):
    """fairseq-eval-lm of a checkpoint of lm_train_argv on the toy language's valid set."""
    return [data, "--user-dir", USER_DIR, "--path", str(path), "--task", "language_modeling", *LM_DATA,
            "--gen-subset", "valid", "--max-tokens", "400", *(["--cpu"] if cpu else []), *extra]


PROG = "python -m fairseq_moe.selftest"
# Dropless, no dropout, SGD: W ranks can equal one process to float rounding (Adam would turn the rounding of
# the key projections' biases, whose gradient is exactly zero, into full-size steps of random sign).
EXACT = ("--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9", "--moe-capacity-factor", "0", "--dropout", "0",
         "--attention-dropout", "0", "--required-batch-size-multiple", "1")
FP32, FP16, BF16 = 1e-4, 1e-2, 3e-2  # largest relative difference allowed (fp16 / bf16: a few ulps of 2^-10, 2^-7)


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    what: str
    flags: tuple = ()  # both runs' ({E}: the expert count of the run, {E2}: twice it)
    ranks_only: tuple = ()  # the W ranks' alone (one process has no such thing)
    tolerance: float = FP32
    min_ranks: int = 1
    even_ranks: bool = False
    kind: str = "train"  # train: the two runs' parameters; resume: W ranks train half the updates, one process
    # resumes their set for the rest; generate: fairseq-generate from the W ranks' set, on W ranks and on one process;
    # eval-bleu: train's, and every validation's BLEU the same; atomic-save: W ranks with the last rank killed
    # while it writes the set of update 4, resumed on W ranks, against W ranks without the kill
    updates: int = 4


FEATURES = (
    Feature("spread", "experts spread over the ranks, the flat all-to-all"),
    Feature("overlap", "the all-to-all cut in 3 chunks overlapped with the experts",
            ranks_only=("--moe-a2a-overlap-degree", "3")),
    Feature("a2a-2d", "the 2-D (hierarchical) all-to-all, 2 ranks a node", ranks_only=("--moe-a2a-local-size", "2"),
            min_ranks=4, even_ranks=True),
    Feature("per-layer", "each MoE layer its own expert count (--moe-expert-count E,2E), each spread over the ranks",
            flags=("--moe-expert-count", "{E},{E2}")),
    Feature("zero", "--zero-sharding os: the dense optimizer state cut over the ranks",
            ranks_only=("--zero-sharding", "os")),
    Feature("fsdp", "--ddp-backend fully_sharded: the dense parameters cut over the ranks",
            ranks_only=("--ddp-backend", "fully_sharded", "--min-params-to-wrap", "0")),
    Feature("fp16", "--fp16 (the flat fp32 copy, the loss scaler)", flags=("--fp16",), tolerance=FP16),
    Feature("bf16", "--bf16 (fp32 master weights)", flags=("--bf16",), tolerance=BF16),
    Feature("reshard", "a set of W ranks resumed on one process (the experts re-cut, their optimizer state too)",
            kind="resume"),
    Feature("generate", "fairseq-generate on W ranks from the set, the experts spread: the hypotheses and their "
            "scores of one process", kind="generate", updates=40),
    Feature("eval-bleu", "--eval-bleu in training: every validation's beam search on W ranks, its BLEU one "
            "process's", flags=("--eval-bleu", "--eval-bleu-detok", "space", "--eval-bleu-args",
                                '{"beam": 2, "max_len_b": 20}', "--max-tokens", "1600"), kind="eval-bleu", updates=6),
    Feature("atomic-save", "a rank killed while it writes a set: the folder keeps the set before, and the W ranks "
            "resume from it as a run without the kill", flags=("--max-tokens", "100", "--batch-size", "2",
                                                               "--save-interval-updates", "2",
                                                               "--keep-interval-updates", "1"),
            kind="atomic-save", updates=6, min_ranks=2),
    Feature("eval-lm", "an MoE language model trained on W ranks, and fairseq-eval-lm from its set on W ranks: one "
            "process's parameters and loss", flags=("--moe-eval-capacity-token-fraction", "0"), kind="eval-lm"),
)
BY_NAME = {f.name: f for f in FEATURES}
WIDTH = max(len(f.name) for f in FEATURES)
# fairseq-train with the rank of RANK argv[1] killed (SIGKILL) while it writes its file of update 4's set, after
# writing half of it; the rest of argv is fairseq-train's.
KILLED_MID_WRITE = """\
import os, re, signal, sys
import fairseq  # (first: the plugin, which the --user-dir names, then registers as fairseq loads it)
from fairseq_moe.checkpoints import commit
victim, write = sys.argv[1], commit.write_synced
def killed_mid_write(obj, path):
    if os.environ.get("RANK", "0") == victim and re.search(r"checkpoint_\\d+_4-", os.path.basename(path)):
        with open(path, "wb") as f:
            f.write(b"PK half a file")
            f.flush()
        open(MARK, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return write(obj, path)
commit.write_synced = killed_mid_write
from fairseq_cli.train import cli_main
sys.argv = ["fairseq-train"] + sys.argv[2:]
cli_main()
"""
GENERATE = ("--task", "moe_translation", "--gen-subset", "test", "--beam", "4", "--batch-size", "8")


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, help="ranks (default: this node's GPUs with --device cuda, else 2)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where torch sees a GPU, else cpu")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--only", nargs="+", choices=[f.name for f in FEATURES], metavar="FEATURE",
                   help="these features only: " + ", ".join(f.name for f in FEATURES))
    p.add_argument("--list", action="store_true", help="print the features and what each checks, and exit")
    p.add_argument("--work", help="the folder of the runs (default: a temporary one, removed unless a run fails)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    return p


def settle(args):
    """The defaults from the machine; a FlagError naming the flag for anything this machine cannot run."""
    import torch

    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.device == "cuda" and not cuda:
        raise FlagError("--device cuda: torch sees no CUDA device here (--device cpu runs the ranks on this CPU)")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if (args.device, args.backend) not in (("cuda", "nccl"), ("cpu", "gloo")):
        raise FlagError(f"--backend {args.backend} with --device {args.device}: the self-test runs nccl on CUDA and "
                        f"gloo on the CPU")
    if args.backend == "nccl" and not torch.distributed.is_nccl_available():
        raise FlagError("--backend nccl: this torch has no NCCL")
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.nproc < 1:
        raise FlagError(f"--nproc must be >= 1, got {args.nproc}")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        raise FlagError(f"--nproc {args.nproc}: this node has {torch.cuda.device_count()} GPUs (one rank each)")
    if args.timeout <= 0:
        raise FlagError(f"--timeout must be > 0, got {args.timeout}")
    if args.work and os.path.exists(args.work) and not os.path.isdir(args.work):
        raise FlagError(f"--work {args.work}: not a folder")
    if args.work and os.path.isdir(args.work) and os.listdir(args.work):
        raise FlagError(f"--work {args.work}: the folder is not empty (the runs need a new one)")
    return args


def program(name):
    """A console script of this interpreter's environment (the venv need not be on PATH), else PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.isfile(beside) else shutil.which(name) or name


def experts(nproc):
    """The least multiple of W that is 4 or more: every rank holds as many experts (W > 4: one each)."""
    return nproc * math.ceil(4 / nproc)


def commands(args, feature, data, folder):
    """([(name, command, environment additions[, "dies": a run whose rank is to be killed])] of the feature's runs,
    in order; (the reference run, the run compared with it)), each run saving into folder/NAME."""
    W, cpu = args.nproc, args.device == "cpu"
    E = experts(W)
    common = (*EXACT, "--moe-expert-count", str(E),
              *(f.replace("{E2}", str(2 * E)).replace("{E}", str(E)) for f in feature.flags))
    lm = feature.kind == "eval-lm"
    corpus = data["lm" if lm else "translation"]
    train = lambda name, *extra: (lm_train_argv if lm else train_argv)(  # noqa: E731
        corpus, os.path.join(folder, name), *common, *extra, cpu=cpu)
    if cpu:
        ranks = lambda tool: [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--", tool]  # noqa: E731
        alone = lambda tool: [sys.executable, "-m", "fairseq_moe.launch", "--nproc", "1", "--", tool]  # noqa: E731
    else:
        ranks = lambda tool: [sys.executable, "-m", "torch.distributed.run", "--standalone",  # noqa: E731
                              "--nproc-per-node", str(W), program(tool), "--distributed-world-size", str(W)]
        # (fairseq's default world size is every visible GPU: one process is asked for)
        alone = lambda tool: [program(tool), "--distributed-world-size", "1"]  # noqa: E731
    dist = ("--distributed-backend", args.backend,
            *(() if "--ddp-backend" in feature.ranks_only else ("--ddp-backend", "legacy_ddp")))
    env = {"OMP_NUM_THREADS": "1"} if cpu else {}
    on_ranks = lambda updates: ("ranks", [*ranks("fairseq-train"), *train(  # noqa: E731
        "ranks", *feature.ranks_only, *dist, "--max-update", str(updates))], env)
    alone_until = lambda name, updates, *extra: (name, [*alone("fairseq-train"), *train(  # noqa: E731
        name, "--update-freq", str(W), "--max-update", str(updates), *extra)], env)
    last, updates = os.path.join(folder, "{}", "checkpoint_last.pt"), feature.updates
    if feature.kind in ("train", "eval-bleu"):
        return [on_ranks(updates), alone_until("one", updates)], ("one", "ranks")
    if feature.kind == "atomic-save":
        script = os.path.join(folder, "killed_mid_write.py")
        with open(script, "w") as f:
            f.write(KILLED_MID_WRITE.replace("MARK", repr(os.path.join(folder, "killed.mark"))))
        if cpu:  # (the launcher's ranks get 5 s to leave once one is dead; fairseq and the plugin are loaded before
            # the ranks fork, as for fairseq-train itself)
            killed = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--grace-seconds", "5",
                      "--preload", "fairseq_cli.train", "--", sys.executable, script, str(W - 1)]
        else:  # (torchrun runs the script with this interpreter)
            killed = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(W),
                      script, str(W - 1), "--distributed-world-size", str(W)]
        argv = lambda name: train(name, *feature.ranks_only, *dist, "--max-update", str(updates))  # noqa: E731
        return [("killed", [*killed, *argv("ranks")], env, "dies"),
                ("ranks", [*ranks("fairseq-train"), *argv("ranks")], env),
                ("reference", [*ranks("fairseq-train"), *argv("reference")], env)], ("reference", "ranks")
    if lm:  # (fairseq-eval-lm in blocks of 60 tokens: each rank's share of the sentences differs in length)
        argv = [*eval_lm_argv(corpus, last.format("ranks"), "--max-tokens", "60", cpu=cpu)]
        return [on_ranks(updates), alone_until("one", updates), ("evaluated-one", [*alone("fairseq-eval-lm"), *argv],
                                                                 env),
                ("evaluated", [*ranks("fairseq-eval-lm"), *argv, *dist[:2]], env)], ("one", "ranks")
    if feature.kind == "generate":
        argv = [corpus, "--user-dir", USER_DIR, "--path", last.format("ranks"), *GENERATE,
                *(["--cpu"] if cpu else [])]
        return [on_ranks(updates), ("one", [*alone("fairseq-generate"), *argv], env),
                ("generated", [*ranks("fairseq-generate"), *argv, *dist[:2]], env)], ("one", "generated")
    # Half the updates, then a restart: the W ranks' set and one process's own checkpoint each resume on one
    # process (fairseq's resume is not a continuous run's to the bit: an epoch's last batches group differently).
    half = updates // 2
    return [on_ranks(half), alone_until("one", half), alone_until("one", updates),
            alone_until("resumed", updates, "--restore-file", last.format("ranks"))], ("one", "resumed")


def saved(folder):
    """The model state a run saved last: its checkpoint_last.pt, or its set assembled (every expert)."""
    import torch

    from .checkpoints import sets
    from .checkpoints.safe_load import register_safe_globals

    register_safe_globals()  # (fairseq pickles its args: argparse.Namespace)
    path = os.path.join(folder, "checkpoint_last.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True, map_location="cpu")["model"]
    return sets.assemble(os.path.join(folder, "checkpoint_last"))["model"]


def compare(folder, a_name, b_name):
    """(largest relative difference, a message or None) of b's saved parameters against a's."""
    a, b = saved(os.path.join(folder, a_name)), saved(os.path.join(folder, b_name))
    if set(a) != set(b):
        return math.inf, f"the runs saved different parameters: {sorted(set(a) ^ set(b))[:3]}"
    worst, where = 0.0, None
    for name, want in a.items():
        got = b[name]
        if got.shape != want.shape:
            return math.inf, f"{name}: shape {tuple(got.shape)} against {tuple(want.shape)}"
        want, got = want.double(), got.double()
        diff = ((got - want).abs().max() / max(want.abs().max().item(), 1e-3)).item() if want.numel() else 0.0
        if not math.isfinite(diff) or diff > worst:
            worst, where = diff if math.isfinite(diff) else math.inf, name
    return worst, where


PRINTED = 1e-4  # fairseq prints scores and eval-lm's loss to 4 decimals: a last digit's rounding is no difference


def generated(log):
    """{"H-12": [fields after the key], ...} of fairseq-generate's S/T/H/D/P lines, and its BLEU line, from a log."""
    lines, bleu = {}, []
    with open(log, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line[:2] in ("S-", "T-", "H-", "D-", "P-") and "\t" in line:
                key, rest = line.split("\t", 1)
                lines.setdefault(key, []).append(rest)
            elif line.startswith("Generate test") and "BLEU" in line:
                bleu.append(line)
    return lines, bleu


def compare_generated(folder, a_name, b_name):
    """(largest relative difference of the scores, a message or None) of b's generated lines against a's: the same
    sentences, the same texts, the same BLEU line, or an infinite difference and what differs."""
    (a, bleu_a), (b, bleu_b) = (generated(os.path.join(folder, f"{name}.log")) for name in (a_name, b_name))
    if not a or a.keys() != b.keys():
        return math.inf, f"the runs generated different sentences ({len(a)} and {len(b)} lines)"
    if bleu_a != bleu_b or len(bleu_a) != 1:
        return math.inf, f"the BLEU lines differ: {bleu_a} against {bleu_b}"
    lengths = {len(x.split("\t", 1)[1].split()) for key, rows in a.items() if key[0] == "H" for x in rows}
    if len(lengths) < 2:  # (then every rank's beam search took as many steps: the ranks' lockstep went untried)
        return math.inf, "every hypothesis has the same length: train the model longer"
    worst, where = 0.0, None
    for key, want in a.items():
        got = b[key]
        if len(got) != len(want):
            return math.inf, f"{key}: {len(got)} lines against {len(want)}"
        for x, y in zip(want, got):
            if key[0] in "HD":
                (sx, tx), (sy, ty) = x.split("\t", 1), y.split("\t", 1)
                if tx != ty:
                    return math.inf, f"{key}: the texts differ"
                pairs = [(float(sx), float(sy))]
            elif key[0] == "P":
                pairs = list(zip(map(float, x.split()), map(float, y.split())))
            elif x != y:
                return math.inf, f"{key}: the lines differ"
            else:
                pairs = []
            for u, v in pairs:
                diff = max(abs(u - v) - PRINTED, 0.0) / max(abs(u), 1e-2)
                if diff > worst:
                    worst, where = diff, key
    return worst, where


def valid_bleus(log):
    """The BLEU of every validation in a training log (fairseq's `valid | ... | bleu B` lines)."""
    with open(log, errors="replace") as f:
        return [line.split("| bleu ")[1].split()[0] for line in f if "| bleu " in line and " valid " in line]


def compare_with_bleu(folder, a_name, b_name):
    """compare's, and an infinite difference where the validations' BLEU differ (or there was none)."""
    a, b = (valid_bleus(os.path.join(folder, f"{name}.log")) for name in (a_name, b_name))
    if not a or a != b:
        return math.inf, f"the validations' BLEU differ: {a} against {b}"
    return compare(folder, a_name, b_name)


def eval_loss(log):
    """fairseq-eval-lm's loss (base 2) in a log, or None."""
    with open(log, errors="replace") as f:
        found = [line.split("Loss (base 2): ")[1].split(",")[0] for line in f if "Loss (base 2): " in line]
    return float(found[-1]) if found else None


def compare_with_eval_lm(folder, a_name, b_name):
    """compare's, and fairseq-eval-lm's loss on W ranks against one process's from the same set."""
    one, many = (eval_loss(os.path.join(folder, f"{name}.log")) for name in ("evaluated-one", "evaluated"))
    if one is None or many is None:
        return math.inf, f"no fairseq-eval-lm loss in the logs ({one} on one process, {many} on the ranks)"
    diff, where = compare(folder, a_name, b_name)
    loss_diff = max(abs(many - one) - PRINTED, 0.0) / max(abs(one), 1e-3)
    return (loss_diff, "fairseq-eval-lm's loss") if loss_diff > diff else (diff, where)


def compare_resumed(folder, a_name, b_name):
    """compare's, and an infinite difference where b's set was not resumed from update 2's (the set before the
    killed save) or does not end at a's update."""
    from .checkpoints import sets
    from .checkpoints.safe_load import register_safe_globals

    register_safe_globals()
    history = [h["num_updates"] for h in sets.assemble(os.path.join(folder, b_name, "checkpoint_last"))[
        "optimizer_history"]]
    want = [h["num_updates"] for h in sets.assemble(os.path.join(folder, a_name, "checkpoint_last"))[
        "optimizer_history"]]
    if history[-2:] != [2, want[-1]]:
        return math.inf, f"the set after the kill resumed from update {history[:-1]} (not 2) to {history[-1]}"
    return compare(folder, a_name, b_name)


COMPARE = {"generate": compare_generated, "eval-bleu": compare_with_bleu,  # (else compare: the parameters)
           "eval-lm": compare_with_eval_lm, "atomic-save": compare_resumed}


def run_feature(args, feature, data, work):
    """-> (status, line) of one feature."""
    folder = os.path.join(work, feature.name)
    if args.nproc < feature.min_ranks or (feature.even_ranks and args.nproc % 2):
        even = "an even number of ranks, " if feature.even_ranks else ""
        return "SKIP", f"needs {even}{feature.min_ranks} ranks or more (--nproc {args.nproc})"
    os.makedirs(folder)
    start = time.monotonic()
    runs, (reference, other) = commands(args, feature, data, folder)
    for name, cmd, env, *dies in runs:
        log = os.path.join(folder, f"{name}.log")
        code = run(cmd, env, folder, log, args.timeout)
        if code is None:
            return "FAIL", f"the {name} run took over {args.timeout:g} s (a collective that never returned?): {log}"
        if dies and (code == 0 or not os.path.exists(os.path.join(folder, "killed.mark"))):
            return "FAIL", (f"the {name} run exited {code} without its rank killed mid-save: {last_error(log)} "
                            f"({log})")
        if code != 0 and not dies:
            return "FAIL", f"the {name} run exited {code}: {last_error(log)} ({log})"
    try:
        diff, where = COMPARE.get(feature.kind, compare)(folder, reference, other)
    except Exception as e:  # (a run that ended well without a readable checkpoint: this feature fails, not the test)
        return "FAIL", f"reading what the runs saved: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    seconds = time.monotonic() - start
    status = "PASS" if diff <= feature.tolerance else "FAIL"
    detail = f"largest relative difference {diff:.1e} (at most {feature.tolerance:.0e})"
    if status == "FAIL":
        detail += f" in {where}" if where and math.isfinite(diff) else f": {where}"
    return status, f"{detail}  {seconds:6.1f} s"


GRACE_SECONDS = 30  # after a timeout's SIGTERM, before SIGKILL


def run(cmd, env, cwd, log, timeout):
    """cmd to its end, its output appended to log; -> its exit code, or None where it ran past timeout: then it
    gets SIGTERM (the launcher and torchrun stop their ranks on it: torchrun's workers would outlive a SIGKILL of
    torchrun, in sessions of their own), and SIGKILL GRACE_SECONDS later."""
    # (the runs import the plugin from where this process did, whatever their cwd: the --user-dir they name)
    parent = os.path.dirname(USER_DIR)  # (an installed plugin's is site-packages: nothing to add before the stdlib)
    installed = parent in {*site.getsitepackages(), site.getusersitepackages()}
    path = os.pathsep.join(p for p in (None if installed else parent, os.environ.get("PYTHONPATH")) if p)
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(os.environ, **env, PYTHONPATH=path))
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None


def last_error(log):
    """The last line of a failed run's log that looks like the error (not torchrun's summary of it), else its last
    line."""
    with open(log, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "error:" in line) and "ChildFailedError" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for f in FEATURES:
            print(f"{f.name:{WIDTH}}  {f.what}")
        return 0
    try:
        settle(args)
    except FlagError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    chosen = [BY_NAME[name] for name in args.only] if args.only else list(FEATURES)
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="fairseq_moe_selftest_"))  # (the runs' cwd: theirs)
    os.makedirs(work, exist_ok=True)
    print(f"{PROG}: {len(chosen)} features, {args.nproc} ranks against 1 process, {args.device}, {args.backend}; "
          f"runs in {work}", flush=True)
    data = {}
    try:
        for name in ["translation"] + (["lm"] if any(f.kind == "eval-lm" for f in chosen) else []):
            os.makedirs(os.path.join(work, "data", name))
            data[name] = binarise(os.path.join(work, "data", name), in_process=False, lm=name == "lm")
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines() or ["(no output)"]
        print(f"{PROG}: error: fairseq-preprocess of the toy task failed: {lines[-1][:300]}", file=sys.stderr)
        return 1
    failed = 0
    for feature in chosen:
        status, line = run_feature(args, feature, data, work)
        failed += status == "FAIL"
        print(f"{status}  {feature.name:{WIDTH}}  {line}", flush=True)
    if failed:
        print(f"{failed} of {len(chosen)} features failed; their runs' logs are in {work}", flush=True)
    elif not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
