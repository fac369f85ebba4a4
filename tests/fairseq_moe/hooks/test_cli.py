"""Red-team table (issue 30, item 7): fairseq's own tools with the plugin loaded, given hostile input. Each row is
one input: the tool, its flags, and what is promised: one line `PROG: error: ...` naming the flag or the file
(exit 2, once over the ranks), or the behaviour of one process (eval-lm's --context-window on 2 ranks: its
perplexity), or a clean exit (fairseq-interactive with stdin closed)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fairseq_moe

fairseq_moe.load_plugin()

from tests import warm
from tests.fairseq_moe.helpers import (ML_ARGS, USER_DIR, binarise_toy_lm_corpus, error_lines, eval_lm_argv,  # noqa: E402
                                lm_train_argv, parse_train, run_eval_lm, run_train, tail, train_argv)

ENV = dict(os.environ, OMP_NUM_THREADS="1")
BIN = os.path.dirname(sys.executable)


def one_line(capsys, call):
    """call() through the plugin's door (cli.one_line_errors): its exit code and its stderr lines with ': error: '."""
    with pytest.raises(SystemExit) as exit_:
        call()
    return exit_.value.code, error_lines(capsys.readouterr().err)


def door_train(argv):
    """fairseq-train's main through fairseq's call_main, both as the plugin leaves them (one_line_errors)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train

    return lambda: distributed_utils.call_main(convert_namespace_to_omegaconf(parse_train(argv)), train.main)


def door_generate(argv):
    from fairseq import options
    from fairseq_cli import generate

    return lambda: generate.main(options.parse_args_and_arch(options.get_generation_parser(), argv))


def ml_train(data, save, *flags):
    return train_argv(data, save, "--task", "moe_translation_multi_simple_epoch", "--encoder-langtok", "src",
                      "--decoder-langtok", "--max-update", "1", *flags)


def ml_generate(data, *flags):
    return [data, "--user-dir", USER_DIR, "--path", "unused.pt", *ML_ARGS, "--gen-subset", "test", "--cpu", *flags]


LANGS = ("--langs", "en,xx,yy")
# (tool, flags, fragments of the one line); "{data}": the corpus folder
MULTILINGUAL = [
    ("train", ("--lang-pairs", "en-xx,en-yy", *LANGS, "MISSING_DICT"),
     ["--lang-pairs en-yy: no dictionary", "dict.yy.txt"]),
    ("train", ("--lang-pairs", "en-xx,en-zz", *LANGS), ["--lang-pairs en-zz: language zz is not in --langs en,xx,yy"]),
    ("train", ("--lang-pairs", "en-xx,xx-yy", *LANGS), ["--lang-pairs xx-yy: no valid data in {data}"]),
    ("train", ("--lang-pairs", "en-xx,en-yy", "--langs", "en,xx,yy", "--lang-dict", "langs.txt"),
     ["--langs and --lang-dict cannot both be given"]),
    ("generate", ("--source-lang", "en", "--target-lang", "qq"),
     ["--target-lang qq: language qq is not in --langs en,xx,yy"]),
    ("generate", ("--source-lang", "en"), ["--source-lang without --target-lang"]),
    ("generate", ("--source-lang", "en", "--target-lang", "yy", "--target-dict", "no-such-dict.txt"),
     ["--target-dict no-such-dict.txt: no such file"]),
]


@pytest.mark.parametrize("tool, flags, fragments", MULTILINGUAL,
                         ids=["missing-dictionary", "unknown-language", "missing-data", "langs-and-lang-dict",
                              "unknown-target-lang", "source-lang-alone", "missing-target-dict"])
def test_multilingual_task_bad_input_is_one_line(ml_data_bin, tmp_path, capsys, tool, flags, fragments):
    data = ml_data_bin
    if "MISSING_DICT" in flags:  # the corpus without its yy dictionary
        data = str(tmp_path / "bin")
        shutil.copytree(ml_data_bin, data)
        os.remove(os.path.join(data, "dict.yy.txt"))
        flags = tuple(f for f in flags if f != "MISSING_DICT")
    if tool == "train":
        call = door_train(ml_train(data, tmp_path / "save", *flags))
    else:
        call = door_generate(ml_generate(data, *flags))
    code, errors = one_line(capsys, call)
    assert code == 2 and len(errors) == 1, errors
    for fragment in fragments:
        assert fragment.format(data=data) in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("tool, flags, fragment", [
    ("fairseq-train", ("--lang-pairs", "en-xx,en-zz", *LANGS), "--lang-pairs en-zz: language zz"),
    ("fairseq-generate", ("--source-lang", "en", "--target-lang", "qq"), "--target-lang qq: language qq"),
], ids=["train-unknown-language", "generate-unknown-target-lang"])
def test_multilingual_bad_input_on_two_ranks_is_one_line_in_all(ml_data_bin, tmp_path, tool, flags, fragment):
    """On 2 ranks every rank meets the bad input: rank 0 prints the line, the other exits quietly."""
    argv = ml_train(ml_data_bin, tmp_path / "save", *flags) if tool == "fairseq-train" else ml_generate(ml_data_bin, *flags)
    out = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", tool, *argv],
                   capture_output=True, text=True, env=ENV, timeout=600)
    errors = error_lines(out.stderr)
    assert out.returncode == 2 and len(errors) == 1 and fragment in errors[0], tail(out.stderr)
    assert "Traceback" not in out.stderr


# --fp16 sets and --fp16 resumes: fairseq refuses a change of precision for a dense model too ("Optimizer does not
# match", an AssertionError): one line naming the flag and the file; --reset-optimizer resumes and trains.
FP16 = [
    (("--fp16",), (), ["checkpoint_last.pt was saved with --fp16", "--reset-optimizer"]),
    ((), ("--fp16",), ["checkpoint_last.pt was saved without --fp16", "--reset-optimizer"]),
    (("--fp16",), ("--reset-optimizer",), None),
]


@pytest.mark.parametrize("first, then, fragments", FP16, ids=["fp16-then-fp32", "fp32-then-fp16",
                                                              "fp16-then-fp32-reset-optimizer"])
def test_a_change_of_precision_on_resume(data_bin, tmp_path, capsys, first, then, fragments):
    def argv(updates, *extra):
        return train_argv(data_bin, tmp_path, "--moe-expert-count", "4", "--required-batch-size-multiple", "1",
                          "--max-update", str(updates), *extra)

    run_train(argv(2, *first))
    if fragments is None:
        run_train(argv(4, *then))
        state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
        assert state["optimizer_history"][-1]["optimizer_name"] == "FairseqAdam"
        assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
        loss = state["extra_state"]["val_loss"]
        assert loss == loss and abs(loss) != float("inf")
        return
    code, errors = one_line(capsys, door_train(argv(4, *then)))
    assert code == 2 and len(errors) == 1, errors
    for fragment in fragments:
        assert fragment in errors[0]


PRECISION = [  # (the saved optimizer's name, this run's flags, refused: the flag the line names)
    ("FP16Optimizer", {}, "--fp16 or --bf16"),
    ("MemoryEfficientFP16Optimizer", {}, "--memory-efficient-fp16"),
    ("AMPOptimizer", {}, "--amp"),
    ("FairseqAdam", {"fp16": True}, "without --fp16"),
    ("FairseqAdam", {"bf16": True}, "without --fp16"),
    ("FP16Optimizer", {"fp16": True}, None),
    ("FP16Optimizer", {"bf16": True}, None),
    ("FairseqAdam", {}, None),
    ("FP16Optimizer", {"reset_optimizer": True}, None),
    ("FairseqBMUF", {"fp16": True}, None),  # (--use-bmuf --fp16: the wrapper's name says nothing of precision)
]


@pytest.mark.parametrize("saved, flags, refused", PRECISION)
def test_check_resumed_precision(saved, flags, refused):
    """optim.check_resumed_precision, the check before the load, on each pair of saved optimizer and flags."""
    import argparse

    from fairseq_moe.errors import CheckpointError
    from fairseq_moe.hooks.optim import check_resumed_precision

    common = argparse.Namespace(**{k: flags.get(k, False) for k in ("fp16", "bf16", "amp")})
    state = {"optimizer_history": [{"optimizer_name": saved}], "last_optimizer_state": {"state": {}}}
    check = lambda: check_resumed_precision(state, common, "ckpt/x.pt", flags.get("reset_optimizer", False))  # noqa
    if refused is None:
        check()
        return
    with pytest.raises(CheckpointError) as e:
        check()
    assert str(e.value).startswith("ckpt/x.pt was saved ") and refused in str(e.value)
    assert "--reset-optimizer" in str(e.value)


@pytest.fixture(scope="module")
def mt_checkpoint(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("mt_save")
    run_train(train_argv(data_bin, save, "--max-update", "2", "--moe-expert-count", "4",
                         "--required-batch-size-multiple", "1"))
    return save / "checkpoint_last.pt"


INTERACTIVE = [(1, "< /dev/null"), (1, "0<&-"), (2, "0<&-")]


@pytest.mark.slow
@pytest.mark.parametrize("W, stdin", INTERACTIVE, ids=["devnull", "closed", "closed-2-ranks"])
def test_interactive_with_no_input_exits_cleanly(data_bin, mt_checkpoint, W, stdin):
    """Nothing to translate: exit 0, no traceback (stdin closed: Python's sys.stdin is None)."""
    argv = ["fairseq-interactive", data_bin, "--user-dir", USER_DIR, "--path", str(mt_checkpoint), "--task",
            "moe_translation", "--source-lang", "src", "--target-lang", "tgt", "--beam", "2", "--cpu"]
    cmd = [os.path.join(BIN, argv[0]), *argv[1:]] if W == 1 else [sys.executable, "-m", "fairseq_moe.launch",
                                                                  "--nproc", str(W), "--", *argv]
    out = subprocess.run(["bash", "-c", " ".join(f"'{x}'" for x in cmd) + " " + stdin], capture_output=True,
                         text=True, env=ENV, timeout=600)
    assert out.returncode == 0 and "Traceback" not in out.stderr, tail(out.stderr)
    assert not [line for line in out.stdout.splitlines() if line[:2] in ("S-", "H-")]


@pytest.mark.slow
@pytest.mark.parametrize("W", [2])
def test_eval_lm_context_window_on_ranks_is_one_process(tmp_path_factory, W):
    """fairseq-eval-lm --context-window on W ranks: every rank collates the set in order (each batch's context is the
    previous batch's end, as on one process) and keeps its share; the perplexity is one process's (with the
    context: without it, another), rather than a KeyError from a filler batch."""
    folder = tmp_path_factory.mktemp("lm")
    data = binarise_toy_lm_corpus(folder)
    run_train(lm_train_argv(data, folder / "save", "--max-update", "4", "--moe-capacity-factor", "0",
                            "--moe-eval-capacity-token-fraction", "0", "--required-batch-size-multiple", "1"))
    path = folder / "save" / "checkpoint_last.pt"
    small = ("--max-tokens", "60", "--num-workers", "0")
    one = float(run_eval_lm(data, path, *small, "--context-window", "8")["loss"])
    assert one != pytest.approx(float(run_eval_lm(data, path, *small)["loss"]), abs=1e-3)
    out = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--", "fairseq-eval-lm",
                    *eval_lm_argv(data, path, *small, "--context-window", "8")],
                   capture_output=True, text=True, env=ENV, timeout=600)
    lines = [line for line in out.stderr.splitlines() if "Loss (base 2):" in line]
    assert out.returncode == 0 and len(lines) == 1, tail(out.stderr)
    assert float(lines[0].split("Loss (base 2): ")[1].split(",")[0]) == pytest.approx(one, abs=1e-4)


@pytest.mark.parametrize("flags", [("--lang-pairs", "en-xx,en-yy"),
                                   ("--lang-pairs", "en-xx,en-yy", "--source-lang", "en", "--target-lang", "yy")],
                         ids=["train", "generate"])
def test_the_languages_of_the_pairs_are_a_valid_language_list(ml_data_bin, tmp_path, flags):
    """The control: without --langs or --lang-dict fairseq infers the languages from --lang-pairs (a string when the
    checks run): the task is set up as fairseq sets it up."""
    from fairseq import tasks

    args = parse_train(train_argv(ml_data_bin, tmp_path, "--task", "moe_translation_multi_simple_epoch",
                                  "--encoder-langtok", "src", "--decoder-langtok", *flags))
    task = tasks.setup_task(args)
    assert sorted(task.langs) == ["en", "xx", "yy"]
    assert task.lang_pairs == (["en-yy"] if "--source-lang" in flags else ["en-xx", "en-yy"])  # (fairseq's rule)


def test_a_language_of_the_pairs_without_a_dictionary_is_one_line(ml_data_bin, tmp_path, capsys):
    """No --langs: zz is a language (of the pairs), and its missing dictionary is named."""
    code, errors = one_line(capsys, door_train(ml_train(ml_data_bin, tmp_path / "save", "--lang-pairs", "en-xx,en-zz")))
    assert code == 2 and len(errors) == 1 and "--lang-pairs en-zz: no dictionary" in errors[0], errors
