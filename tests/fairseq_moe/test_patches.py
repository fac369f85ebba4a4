"""patches.py is the whole story: loading the plugin changes exactly the table's permanent entries, and
importing the layer or the kernels alone changes nothing of fairseq's or torch's.

Each check runs in a fresh interpreter (this one has the plugin loaded already).
"""
import json
import subprocess
import sys

import pytest

from fairseq_moe import patches

# Snapshot every attribute of every fairseq module and of the classes defined in them (plus the few
# non-fairseq targets of the table), as (target, attribute) -> id of the value.
SNAPSHOT = r"""
import argparse, importlib, json, sys, inspect
import torch.serialization

def targets():
    names = [m for m in list(sys.modules) if m.split(".")[0] in ("fairseq", "fairseq_cli")]
    out = {}
    for name in names:
        module = sys.modules[name]
        if module is None or module.__name__ != name:  # an alias (fairseq.distributed_utils)
            continue
        out[name] = module
        for key, value in list(vars(module).items()):
            if inspect.isclass(value) and value.__module__ == name:
                out[f"{name}:{value.__qualname__}"] = value
    out["argparse:ArgumentParser"] = argparse.ArgumentParser
    return out

def snapshot():
    return {f"{t}|{k}": id(v) for t, obj in targets().items() for k, v in list(vars(obj).items())}

def ours():
    # attributes whose value is a function or class of fairseq_moe
    found = []
    for t, obj in targets().items():
        for k, v in list(vars(obj).items()):
            owner = getattr(v, "__module__", None) or getattr(getattr(v, "fget", None), "__module__", None)
            if isinstance(owner, str) and owner.startswith("fairseq_moe") and not t.startswith("fairseq_moe"):
                found.append(f"{t}|{k}")
    return found
"""

LOAD = SNAPSHOT + r"""
import fairseq
from fairseq_moe import patches   # fairseq_moe/__init__ runs with fairseq loaded: it loads the plugin...
"""


def run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loading_the_plugin_changes_exactly_the_table():
    modules = sorted({p.target.split(":")[0] for p in patches.PATCHES
                      if not p.scoped and p.target.split(".")[0] in ("fairseq", "fairseq_cli")
                      and "hydra" not in p.target})
    code = SNAPSHOT + f"""
import fairseq
for name in {modules!r}:
    importlib.import_module(name)
before = snapshot()
import fairseq_moe  # with fairseq loaded: as when fairseq imports it (--user-dir)
after = snapshot()
""" + r"""
known = {x.split("|")[0] for x in before}
changed = sorted(k for k in after if (k in before and after[k] != before[k]) or (k not in before
                 and k.split("|")[0] in known))
applied = sorted(f"{t}|{a}" for (t, a) in fairseq_moe.patches._originals)
print(json.dumps({"changed": changed, "applied": applied,
                  "safe": [g.__name__ for g in torch.serialization.get_safe_globals() if isinstance(g, type)]}))
"""
    got = run(code)
    expected = sorted(f"{p.target}|{p.attribute}" for p in patches.PATCHES
                      if not p.scoped and (p.when is None or p.when()) and p.attribute != "_safe_globals"
                      and not p.target.startswith("argparse"))
    # The hydra tool is patched only when it is the program (it warns when imported).
    expected = [e for e in expected if not e.startswith("fairseq_cli.hydra_train")]
    assert (sorted(set(got["changed"]) - set(expected)), sorted(set(expected) - set(got["changed"]))) == ([], [])
    assert set(expected) <= set(got["applied"])
    assert "Namespace" in got["safe"]


@pytest.mark.slow
def test_the_layer_and_the_kernels_alone_change_nothing():
    code = SNAPSHOT + r"""
import fairseq_moe_layer, fairseq_moe_kernels, fairseq_moe_kernels.backend
from fairseq_moe_layer import MoELayer
assert "fairseq" not in sys.modules  # the layer does not even import it
import fairseq, fairseq.checkpoint_utils, fairseq.trainer, fairseq_cli.train, fairseq.models.transformer_lm
print(json.dumps({"ours": ours(), "safe": [g.__name__ for g in torch.serialization.get_safe_globals()
                                           if isinstance(g, type)]}))
"""
    got = run(code)
    assert got["ours"] == [] and "Namespace" not in got["safe"]


def test_scoped_patches_are_only_the_tables():
    from fairseq import checkpoint_utils, trainer

    with patches.scoped(checkpoint_utils, "PathManager", "stand-in"):
        assert checkpoint_utils.PathManager == "stand-in"
    assert checkpoint_utils.PathManager != "stand-in"
    with pytest.raises(AssertionError, match="not a scoped patch"):
        with patches.scoped(checkpoint_utils, "verify_checkpoint_directory", None):
            pass
    with pytest.raises(AssertionError, match="not a scoped patch"):
        with patches.scoped(trainer.Trainer, "save_checkpoint", None):  # a permanent one, not scoped
            pass


def test_every_patch_names_its_reason_and_resolves():
    for p in patches.PATCHES:
        assert p.why and p.since.startswith("0.12"), p
        if p.when is None or p.when():
            module, _, name = p.replacement.partition(":")
            assert hasattr(patches.resolve(module), name), p.replacement
    assert patches.original("fairseq.checkpoint_utils", "load_checkpoint_to_cpu").__module__ == \
        "fairseq.checkpoint_utils"  # the plugin is loaded, and keeps fairseq's own for its hooks


@pytest.mark.slow
def test_a_dense_run_with_the_plugin_trains_as_without_it(data_bin, tmp_path):
    """fairseq-train of a dense transformer with and without --user-dir fairseq_moe: the same weights
    (with --required-batch-size-multiple 1 the kept last batch, a documented difference, changes nothing)."""
    import os

    import torch

    from tests.fairseq_moe.helpers import USER_DIR

    bin_dir = os.path.dirname(sys.executable)
    common = [data_bin, "--task", "translation", "--arch", "transformer", "--encoder-layers", "1",
              "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
              "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
              "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "500",
              "--max-update", "3", "--cpu", "--seed", "5", "--no-epoch-checkpoints", "--num-workers", "0",
              "--required-batch-size-multiple", "1", "--no-progress-bar"]
    runs = {name: subprocess.Popen([os.path.join(bin_dir, "fairseq-train"), *common, "--save-dir",
                                    str(tmp_path / name), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            for name, extra in (("plain", []), ("plugin", ["--user-dir", USER_DIR]))}  # side by side
    states = []
    for name, proc in runs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        states.append(torch.load(tmp_path / name / "checkpoint_last.pt", weights_only=True))
    torch.testing.assert_close(states[1]["model"], states[0]["model"], rtol=0, atol=0)
    assert states[1]["optimizer_history"][-1]["num_updates"] == 3


@pytest.mark.slow
def test_import_order_does_not_matter():
    """A script or notebook that imports fairseq_moe before fairseq gets the plugin registered, as fairseq's
    --user-dir does; importing fairseq_moe alone imports no fairseq."""
    got = run(SNAPSHOT + r"""
import fairseq_moe
alone = "fairseq" in sys.modules
import fairseq
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq import checkpoint_utils
print(json.dumps({"alone": alone, "arch": "moe_transformer" in ARCH_MODEL_REGISTRY,
                  "patched": checkpoint_utils.save_checkpoint.__module__, "loader": type(fairseq.__loader__).__name__}))
""")
    assert got == {"alone": False, "arch": True, "patched": "fairseq_moe.hooks.trainer", "loader": "SourceFileLoader"}
