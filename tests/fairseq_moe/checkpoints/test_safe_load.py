"""Checkpoints made to run code when loaded: nothing runs, and the error names the file (and the field).

Two ways a checkpoint could run code in fairseq 0.12:
1. its config: fairseq builds the loaded model from the checkpoint's own config and eval()s some of its
   strings. The plugin refuses, at load, a non-literal string in any field it knows fairseq evaluates
   (safe_eval.EVALUATED_FIELDS), and binds `eval` to a literal reader in every fairseq module that
   calls it (safe_eval.EVAL_MODULES). The table tests hold both lists against fairseq's source.
2. its pickle: every load passes torch.load(weights_only=True) explicitly, so even
   TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 cannot turn pickle execution back on.

Each payload, were it run, would create a MARKER file; the tests check that it never appears, and the
control tests check that the payloads are real (they do create it when run unguarded).
"""
import argparse
import ast
import functools
import importlib
import os
import shlex
import shutil
import sys
import warnings

import fairseq
import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe.checkpoints import safe_load as safe_eval
from fairseq_moe.errors import CheckpointError
from fairseq_moe.reshard import main as reshard_main

from tests import warm
from tests.fairseq_moe import helpers
from tests.fairseq_moe.helpers import USER_DIR, lm_train_argv, run_eval_lm, run_generate, run_train, train_argv, unwrapped

FIELD = "adaptive_softmax_cutoff"  # the field of the original report

# Modules that call the builtin eval() on something that is not a checkpoint's configuration.
NOT_CONFIGURATION = {
    "fairseq.data.codedataset": "evaluates the lines of a user's data manifest, never a checkpoint",
}


# ---------------------------------------------------------------------------------------------------
# Payloads and checkpoints that carry them


def payload(marker):
    """A Python expression that creates marker when evaluated."""
    return f"__import__('os').system({('touch ' + shlex.quote(str(marker)))!r})"


class Evil:
    """Pickled, it is a call of os.system: unpickling it (weights_only=False) creates the marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ("touch " + shlex.quote(self.marker),))


def with_field(state, section, field, value):
    """A copy of the checkpoint state with cfg[section].field (or args.field, section "args") = value.
    The pristine state is not changed: cfg and the section are copied, the tensors shared."""
    state = dict(state)
    if section == "args":
        node = state.get("args") or argparse.Namespace()
    else:
        state["cfg"] = dict(state["cfg"])
        node = state["cfg"][section]
    if isinstance(node, argparse.Namespace):
        node = argparse.Namespace(**vars(node))
        setattr(node, field, value)
    else:
        assert isinstance(node, dict), type(node)
        node = dict(node, **{field: value})
    if section == "args":
        state["args"] = node
    else:
        state["cfg"][section] = node
    return state


def save_with_payload(state, path, marker, section="model", field=FIELD):
    torch.save(with_field(state, section, field, payload(marker)), path)
    return str(path)


def save_evil_pickle(path, marker):
    torch.save({"model": Evil(marker)}, path)
    return str(path)


def refused(excinfo, path, where=None):
    """The error names the file, and the field when given."""
    message = str(excinfo.value)
    assert str(path) in message, message
    if where is not None:
        assert where in message, message
    return message


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a checkpoint ran code"


@pytest.fixture(scope="module")
def state(trained_checkpoint):
    """The trained checkpoint as read from disk (not to be changed: with_field copies)."""
    return torch.load(trained_checkpoint, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def checkpoint_set(trained_checkpoint, tmp_path_factory):
    """The trained checkpoint as an expert-parallel set of 2 ranks: FOLDER/set-shared.pt + set-rank-R.pt."""
    folder = tmp_path_factory.mktemp("set")
    assert reshard_main([str(trained_checkpoint), str(folder / "set.pt"), "--world-size", "2"]) == 0
    assert sorted(os.listdir(folder)) == ["set-rank-0.pt", "set-rank-1.pt", "set-shared.pt"]
    return folder


@pytest.fixture(scope="module")
def lm_state(lm_data_bin, tmp_path_factory):
    """A checkpoint of moe_transformer_lm_tiny after 1 update, as read from disk."""
    save = tmp_path_factory.mktemp("lm")
    run_train(lm_train_argv(lm_data_bin, save, "--max-update", "1"))
    return torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)


def generate_argv(data_bin, path):
    return [data_bin, "--user-dir", USER_DIR, "--path", str(path), "--task", "moe_translation",
            "--gen-subset", "test", "--beam", "2", "--cpu"]


# ---------------------------------------------------------------------------------------------------
# 1. The lists of safe_eval against fairseq 0.12's source


@functools.lru_cache(maxsize=None)
def fairseq_eval_calls():
    """({module calling the builtin eval()}, {(NAME, module)} of eval/eval_str_list/eval_str_dict/
    eval_bool called on an attribute x.NAME), from the installed fairseq's source (examples/ left out)."""
    root = os.path.dirname(os.path.abspath(fairseq.__file__))
    evaluators = {"eval", "eval_str_list", "eval_str_dict", "eval_bool"}
    modules, fields = set(), set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (folder == root and d == "examples"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
            module = module[:-len(".__init__")] if module.endswith(".__init__") else module
            with open(path, "rb") as f, warnings.catch_warnings():
                for category in (DeprecationWarning, SyntaxWarning):  # fairseq's invalid escapes ('\d' in a str)
                    warnings.simplefilter("ignore", category)
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if isinstance(func, ast.Name) and func.id == "eval":
                    modules.add(module)
                if called in evaluators and node.args and isinstance(node.args[0], ast.Attribute):
                    fields.add((node.args[0].attr, module))
    return frozenset(modules), frozenset(fields)


@pytest.mark.slow
def test_the_source_walk_finds_fairseqs_evaluations():
    """Not vacuous: the walk sees what is known to be there."""
    modules, fields = fairseq_eval_calls()
    assert {"fairseq.utils", "fairseq.models.fconv", "fairseq.optim.adam", "fairseq.data.codedataset"} <= modules
    assert {("adaptive_softmax_cutoff", "fairseq.models.transformer.transformer_decoder"),
            ("adam_betas", "fairseq.optim.adam"), ("character_filters", "fairseq.models.transformer_lm"),
            ("encoder_layers", "fairseq.models.fconv")} <= fields


def test_every_module_that_calls_eval_is_guarded():
    modules, _ = fairseq_eval_calls()
    unguarded = sorted(modules - set(safe_eval.EVAL_MODULES) - set(NOT_CONFIGURATION))
    assert unguarded == [], f"fairseq modules calling eval() missing from safe_eval.EVAL_MODULES: {unguarded}"
    # The documented exceptions are still needed (none went stale).
    assert set(NOT_CONFIGURATION) <= modules


def test_every_evaluated_field_is_listed():
    _, fields = fairseq_eval_calls()
    missing = sorted({(name, module) for name, module in fields if name not in safe_eval.EVALUATED_FIELDS})
    assert missing == [], f"fields fairseq evaluates, missing from safe_eval.EVALUATED_FIELDS: {missing}"


def test_eval_is_rebound_in_every_importable_eval_module():
    imported = []
    for name in safe_eval.EVAL_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # optional dependencies (audio models): its eval() cannot run either
            continue
        assert module.eval is safe_eval.literal, name
        imported.append(name)
    assert {"fairseq.utils", "fairseq.models.fconv", "fairseq.models.transformer_lm", "fairseq.optim.adam",
            "fairseq.optim.adamax"} <= set(imported)


def test_guarded_eval_refuses_a_payload_and_reads_literals(marker):
    from fairseq import options, utils

    for evaluate in (utils.eval_str_list, utils.eval_str_dict, utils.eval_bool, options.eval_str_list):
        with pytest.raises(ValueError):
            evaluate(payload(marker))
    with pytest.raises(TypeError):
        safe_eval.literal(payload(marker).encode())  # builtin eval() would run bytes too
    assert utils.eval_str_list("[10, 20]", type=int) == [10, 20]
    assert utils.eval_bool("True") is True
    assert safe_eval.literal("[(512, 3)] * 2 + [(1024, 3)]") == [(512, 3), (512, 3), (1024, 3)]
    assert not marker.exists()


def test_control_the_config_payload_is_real(tmp_path):
    """The payload string does run code when the builtin eval() gets it."""
    control = tmp_path / "CONTROL"
    eval(payload(control))  # noqa: S307 (the point of the control)
    assert control.exists()


# ---------------------------------------------------------------------------------------------------
# 2. Every evaluated field, at load (checkpoint_utils.load_checkpoint_to_cpu, as patched by the plugin)


@pytest.mark.parametrize("field", sorted(safe_eval.EVALUATED_FIELDS))
def test_payload_in_any_evaluated_model_field_is_refused(state, tmp_path, marker, field):
    path = save_with_payload(state, tmp_path / "bad.pt", marker, "model", field)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    refused(e, path, f"cfg.model.{field}")
    assert not marker.exists()


@pytest.mark.parametrize("section, field", [
    ("task", "left_pad_source"), ("task", "left_pad_target"), ("optimizer", "adam_betas"),
    ("optimizer", "lamb_betas"), ("args", "adaptive_softmax_cutoff"), ("args", "adam_betas"),
])
def test_payload_in_other_sections_is_refused(state, tmp_path, marker, section, field):
    """cfg.task and cfg.optimizer are dicts in this checkpoint; "args" is the legacy Namespace."""
    path = save_with_payload(state, tmp_path / "bad.pt", marker, section, field)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    refused(e, path, f"{section}.{field}" if section == "args" else f"cfg.{section}.{field}")
    assert not marker.exists()


@pytest.mark.parametrize("text", [
    "  {payload}", "\n{payload}\n", "(lambda: {payload})()", "[10, {payload}]", "exec({payload!r})",
])
def test_disguised_payloads_are_refused(state, tmp_path, marker, text):
    path = tmp_path / "bad.pt"
    torch.save(with_field(state, "model", FIELD, text.format(payload=payload(marker))), path)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    refused(e, path, f"cfg.model.{FIELD}")
    assert not marker.exists()


@pytest.mark.parametrize("text", ["1" + "+1" * 1000, "-" * 10000 + "1", "1/0", "{[]: 1}",
                                  "[0] * 100000 + [0] * 100000", "0" * 200_000],
                         ids=["sum-of-1001", "10000-minus", "division-by-zero", "unhashable-key", "huge-list",
                              "huge-text"])
def test_deeply_nested_string_is_a_named_error(state, tmp_path, text):
    path = tmp_path / "deep.pt"
    torch.save(with_field(state, "model", FIELD, text), path)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    refused(e, path, f"cfg.model.{FIELD}")


@pytest.mark.parametrize("section, field, value", [
    ("model", "adam_betas", "(0.9, 0.98)"), ("optimizer", "adam_betas", "(0.9, 0.98)"),
    ("model", "encoder_layers", "[(512, 3)] * 20 + [(1024, 3)]"),  # fconv's spec arithmetic
])
def test_literals_in_evaluated_fields_load(state, tmp_path, section, field, value):
    path = tmp_path / "ok.pt"
    torch.save(with_field(state, section, field, value), path)
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    node = loaded["cfg"][section]
    assert (getattr(node, field) if isinstance(node, argparse.Namespace) else node[field]) == value
    assert loaded["model"].keys() == state["model"].keys()


# ---------------------------------------------------------------------------------------------------
# 3. End to end: the payload in cfg.model.adaptive_softmax_cutoff through every tool that loads


def test_generate_refuses(state, data_bin, tmp_path, marker):
    bad = save_with_payload(state, tmp_path / "bad.pt", marker)
    with pytest.raises(CheckpointError) as e:
        run_generate(generate_argv(data_bin, bad))
    refused(e, bad, f"cfg.model.{FIELD}")
    assert not marker.exists()


def test_interactive_refuses(state, data_bin, tmp_path, marker):
    from fairseq import options
    from fairseq_cli import interactive

    bad = save_with_payload(state, tmp_path / "bad.pt", marker)
    source = tmp_path / "input.txt"
    source.write_text("a b c\nd e f g\n")
    parser = options.get_interactive_generation_parser()
    args = options.parse_args_and_arch(parser, [
        data_bin, "--user-dir", USER_DIR, "--path", bad, "--task", "moe_translation",
        "--source-lang", "src", "--target-lang", "tgt", "--input", str(source), "--beam", "2", "--cpu",
    ])
    with pytest.raises(CheckpointError) as e:
        unwrapped(interactive.main)(args)
    refused(e, bad, f"cfg.model.{FIELD}")
    assert not marker.exists()


@pytest.mark.parametrize("field", ["character_filters", "adaptive_input_cutoff"])
def test_eval_lm_refuses(lm_state, lm_data_bin, tmp_path, marker, field):
    assert isinstance(lm_state["cfg"]["model"], argparse.Namespace)  # a legacy (argparse) model
    bad = save_with_payload(lm_state, tmp_path / "bad.pt", marker, "model", field)
    with pytest.raises(CheckpointError) as e:
        run_eval_lm(lm_data_bin, bad)
    refused(e, bad, f"cfg.model.{field}")
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--restore-file", "--finetune-from-model"])
def test_training_from_it_refuses(state, data_bin, tmp_path, marker, flag):
    bad = save_with_payload(state, tmp_path / "bad.pt", marker)
    save = tmp_path / "save"
    with pytest.raises(CheckpointError) as e:
        run_train(train_argv(data_bin, save, "--max-update", "3", "--moe-expert-count", "4",
                             "--required-batch-size-multiple", "1", flag, bad))
    refused(e, bad, f"cfg.model.{FIELD}")
    assert not marker.exists()
    assert not list(save.glob("checkpoint*.pt"))  # nothing trained, nothing saved


def one_error_line(capsys):
    captured = capsys.readouterr()
    assert captured.out == ""
    return helpers.one_error_line(captured.err, ("python -m fairseq_moe.reshard", "python -m fairseq_moe.consolidate"))


@pytest.mark.parametrize("world_size", [2, 1])  # 1: what python -m fairseq_moe.consolidate does
def test_reshard_refuses(state, tmp_path, marker, capsys, world_size):
    bad = save_with_payload(state, tmp_path / "bad.pt", marker)
    out = tmp_path / "out"
    if world_size == 1:
        rc = reshard_main([bad, str(out / "one.pt")], prog="python -m fairseq_moe.consolidate", world_size=1)
    else:
        rc = reshard_main([bad, str(out / "set.pt"), "--world-size", str(world_size)])
    assert rc == 2
    line = one_error_line(capsys)
    assert bad in line and f"cfg.model.{FIELD}" in line, line
    assert not out.exists()  # nothing written
    assert not marker.exists()


def test_payload_in_the_shared_file_of_a_set_is_refused(checkpoint_set, data_bin, tmp_path, marker):
    folder = tmp_path / "set"
    shutil.copytree(checkpoint_set, folder)
    shared = folder / "set-shared.pt"
    save_with_payload(torch.load(shared, map_location="cpu", weights_only=True), shared, marker)
    with pytest.raises(CheckpointError) as e:
        run_generate(generate_argv(data_bin, shared))
    refused(e, shared, f"cfg.model.{FIELD}")
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------
# 4. The real command line: one line on stderr, exit code 2, no traceback


@pytest.mark.slow
def test_fairseq_generate_cli_prints_one_error_line(state, data_bin, tmp_path, marker):
    bad = save_with_payload(state, tmp_path / "bad.pt", marker)
    cli = os.path.join(os.path.dirname(sys.executable), "fairseq-generate")
    out = warm.run([cli, data_bin, "--user-dir", USER_DIR, "--path", bad, "--task", "moe_translation",
                    "--gen-subset", "test", "--cpu"], cwd=tmp_path, capture_output=True, text=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = [line for line in out.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("fairseq-generate: error:"), out.stderr[-3000:]
    assert bad in last and f"cfg.model.{FIELD}" in last, last
    assert "Traceback" not in out.stderr
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------
# 5. Pickles that run code, with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1


@pytest.fixture
def force_no_weights_only(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def test_control_the_pickle_payload_is_real(tmp_path, force_no_weights_only):
    """With the variable set, a torch.load that does not pass weights_only runs the pickle."""
    control = tmp_path / "CONTROL"
    path = save_evil_pickle(tmp_path / "evil.pt", control)
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        torch.load(path)
    assert control.exists()


def test_pickle_refused_by_load_checkpoint_to_cpu(tmp_path, marker, force_no_weights_only):
    evil = save_evil_pickle(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(evil)
    assert "weights_only" in refused(e, evil)
    assert not marker.exists()


def test_numpy_data_loads_and_a_pickle_inside_an_object_array_is_still_refused(tmp_path, marker,
                                                                                force_no_weights_only):
    """fairseq's --eval-bleu keeps its BLEU counts as NumPy arrays in the metrics of every checkpoint: they load
    (a resume of such a run once failed here), while an object array whose item would run code is refused."""
    import numpy as np

    from fairseq_moe.checkpoints.sets import read_file

    data = {"extra_state": {"metrics": [(10, "_bleu_counts", "AverageMeter",
                                         {"val": np.array([8, 0, 0, 0]), "sum": np.float64(2.5)})]}}
    torch.save(data, tmp_path / "bleu.pt")
    loaded = read_file(str(tmp_path / "bleu.pt"))  # (what every checkpoint read of the plugin goes through)
    counts = loaded["extra_state"]["metrics"][0][3]
    assert counts["val"].tolist() == [8, 0, 0, 0] and counts["sum"] == 2.5
    evil = np.empty(1, dtype=object)
    evil[0] = Evil(marker)
    torch.save({"model": evil}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as e:
        read_file(str(tmp_path / "evil.pt"))
    assert "weights_only" in refused(e, tmp_path / "evil.pt")
    assert not marker.exists()


def test_pickle_refused_by_generate(data_bin, tmp_path, marker, force_no_weights_only):
    evil = save_evil_pickle(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError) as e:
        run_generate(generate_argv(data_bin, evil))
    refused(e, evil)
    assert not marker.exists()


def test_pickle_refused_by_restore_file(data_bin, tmp_path, marker, force_no_weights_only):
    evil = save_evil_pickle(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError) as e:
        run_train(train_argv(data_bin, tmp_path / "save", "--max-update", "3", "--restore-file", evil))
    refused(e, evil)
    assert not marker.exists()


def test_pickle_refused_by_reshard(tmp_path, marker, capsys, force_no_weights_only):
    evil = save_evil_pickle(tmp_path / "evil.pt", marker)
    assert reshard_main([evil, str(tmp_path / "out" / "set.pt"), "--world-size", "2"]) == 2
    assert evil in one_error_line(capsys)
    assert not (tmp_path / "out").exists()
    assert not marker.exists()


def test_pickle_as_a_rank_file_of_a_set_is_refused(checkpoint_set, data_bin, tmp_path, marker,
                                                    force_no_weights_only):
    folder = tmp_path / "set"
    shutil.copytree(checkpoint_set, folder)
    rank1 = save_evil_pickle(folder / "set-rank-1.pt", marker)
    with pytest.raises(CheckpointError) as e:
        run_generate(generate_argv(data_bin, folder / "set-shared.pt"))
    refused(e, rank1)
    assert not marker.exists()
