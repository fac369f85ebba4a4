"""Helpers of the fairseq glue tests: a toy corpus, and fairseq-train/-generate in this process."""
import random

import torch

from fairseq_moe import selftest
from fairseq_moe.selftest import (LM_DATA, USER_DIR, eval_lm_argv, lm_train_argv,  # noqa: F401  (one place:
                                   train_argv)  # the tests' and the self-test's)


def binarise_toy_corpus(folder):
    """selftest.write_corpus + fairseq-preprocess into folder/bin; returns that path."""
    return selftest.binarise(folder)


ML_PAIRS = "en-xx,en-yy"
ML_ARGS = ("--task", "moe_translation_multi_simple_epoch", "--lang-pairs", ML_PAIRS, "--langs", "en,xx,yy",
           "--encoder-langtok", "src", "--decoder-langtok")


def binarise_toy_multilingual_corpus(folder, seed=0):
    """A toy two-direction corpus for translation_multi_simple_epoch: en-xx (reversed, upper-cased) and en-yy (every
    word doubled), one dictionary for every language; fairseq-preprocess into folder/bin; returns that path."""
    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq_cli import preprocess

    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t".split()
    pairs = {"xx": lambda s: [w.upper() for w in reversed(s)], "yy": lambda s: [w + w for w in s]}
    joined = Dictionary()
    for tgt, f in pairs.items():
        for split, n in (("train", 200), ("valid", 20), ("test", 12)):
            with open(f"{folder}/{split}.en-{tgt}.en", "w") as fs, open(f"{folder}/{split}.en-{tgt}.{tgt}", "w") as ft:
                for _ in range(n):
                    s = [rng.choice(words) for _ in range(rng.randint(2, 9))]
                    fs.write(" ".join(s) + "\n")
                    ft.write(" ".join(f(s)) + "\n")
                    for w in s + f(s):
                        joined.add_symbol(w)
    joined.finalize(padding_factor=8)
    joined.save(f"{folder}/dict.txt")
    for tgt in pairs:
        preprocess.main(options.get_preprocessing_parser().parse_args([
            "--source-lang", "en", "--target-lang", tgt, "--srcdict", f"{folder}/dict.txt", "--tgtdict",
            f"{folder}/dict.txt", "--workers", "1", "--trainpref", f"{folder}/train.en-{tgt}", "--validpref",
            f"{folder}/valid.en-{tgt}", "--testpref", f"{folder}/test.en-{tgt}", "--destdir", f"{folder}/bin"]))
    return str(folder / "bin")


def binarise_toy_lm_corpus(folder, seed=0):
    """selftest.write_lm_corpus + fairseq-preprocess into folder/bin; -> that path."""
    return selftest.binarise(folder, lm=True, seed=seed)


def run_eval_lm(data, path, *extra):
    """fairseq-eval-lm in this process on the valid set; -> its {'loss' (base 2), 'perplexity'}."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import eval_lm

    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, eval_lm_argv(data, path, *extra))
    return unwrapped(eval_lm.main)(convert_namespace_to_omegaconf(args))


def parse_train(argv):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, argv)


def build(argv):
    """(task, model, criterion) as fairseq-train would build them from argv."""
    from fairseq import tasks

    args = parse_train(argv)
    torch.manual_seed(args.seed)  # as fairseq-train does: the same argv builds the same weights
    task = tasks.setup_task(args)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    return task, model, criterion, args


def run_train(argv):
    """fairseq-train in this process (a CLI start-up costs seconds)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train

    from fairseq import checkpoint_utils

    cfg = convert_namespace_to_omegaconf(parse_train(argv))
    # fairseq keeps the best validation score on the save function: forget the previous run's, as a
    # new fairseq-train process would (else whether checkpoint_best is written depends on test order).
    if hasattr(checkpoint_utils.save_checkpoint, "best"):
        del checkpoint_utils.save_checkpoint.best
    unwrapped(distributed_utils.call_main)(cfg, unwrapped(train.main))


def assert_same_params(b, a):
    assert set(a) == set(b)
    for name, pa in a.items():
        torch.testing.assert_close(b[name], pa, rtol=1e-5, atol=1e-6, msg=name)


def run_generate(argv):
    """fairseq-generate in this process; returns the scorer's result string."""
    from fairseq import options
    from fairseq_cli import generate

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, argv)
    return unwrapped(generate.main)(args)


def unwrapped(main):
    """A fairseq tool's main without the plugin's one-line error printing (cli.py): the tests see the
    exception itself."""
    return getattr(main, "__wrapped__", main)


def error_lines(text):
    """The lines `PROG: error: ...` of a command's output (what the plugin promises to print, once, on bad input)."""
    return [line for line in text.splitlines() if ": error: " in line]


def one_error_line(err, prog):
    """The check that a command refused its input as promised: its stderr `err` is exactly one line
    `PROG: error: ...` (prog: the command's name, or a tuple of names it may go by); -> that line."""
    lines = err.splitlines()
    progs = (prog,) if isinstance(prog, str) else tuple(prog)
    assert len(lines) == 1 and lines[0].startswith(tuple(f"{p}: error: " for p in progs)), err
    return lines[0]


def tail(log, n=3000):
    """The end of a process's output for an assertion message; where Python died on a fatal signal
    (PYTHONFAULTHANDLER, set in tests/conftest.py), the stacks faulthandler printed instead."""
    start = log.find("Fatal Python error")
    if start >= 0:  # the stacks, then the end (what the other ranks and the launcher said)
        return log[start:start + n // 2] + "\n[...]\n" + log[-n // 2:]
    return log[-n:]
