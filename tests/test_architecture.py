"""The floors of docs/architecture.md, read from the source: every import of every module of the three packages
(at its top or inside a function) points to its own floor or one below, and no modules import each other in a
circle. Floors are folders; a new file takes its folder's floor, and a new file at the top of fairseq_moe/ is a
command. The checker is shown to catch an upward import, a circle and a command borrowing from another."""
import ast
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fairseq_moe_kernels", "fairseq_moe_layer", "fairseq_moe")

# From the bottom up: (floor, what it holds, whether it may import fairseq). A module belongs to the floor of the
# longest name here that is it or its package. The door's files sit on the floors they serve: the error types at
# the bottom of the glue (every floor raises them), the two tables (patches, refusals) with the hooks they list.
FLOORS = [
    ("kernels", {"fairseq_moe_kernels"}, False),
    ("layer", {"fairseq_moe_layer"}, False),
    ("errors", {"fairseq_moe.errors"}, False),
    ("checkpoints", {"fairseq_moe.checkpoints"}, False),
    ("hooks", {"fairseq_moe.hooks", "fairseq_moe.patches", "fairseq_moe.refusals"}, True),
    ("registries", {"fairseq_moe.models", "fairseq_moe.criterions", "fairseq_moe.tasks"}, True),
    ("commands", {"fairseq_moe"}, True),  # __init__ (the door, load_plugin) and python -m fairseq_moe.NAME
]
# A command built on another (docs/architecture.md, "How to add a command"): at most three.
BUILT_ON = {("fairseq_moe.consolidate", "fairseq_moe.reshard"), ("fairseq_moe.inspect", "fairseq_moe.plot")}


def modules(root):
    """{module name: its file} of the three packages under root."""
    out = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
    return out


FAIRSEQ = {"fairseq", "fairseq_cli", "omegaconf", "hydra"}  # fairseq and the configuration stack it brings


def dynamic(call):
    """Whether a call imports a module named by a literal: importlib.import_module("x") or __import__("x"). (The
    names in patches.py's table are resolved by patches.resolve when the door applies it, and are not imports: the
    table lists what is patched, on every floor, which is why it sits with the hooks and is imported by the door.)"""
    f = call.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and f.id in (
        "__import__", "import_module"))
    return named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)


def imports(name, path, known):
    """The modules of ours that the module imports (a name imported from a package is its submodule where there is
    one, else the package), and whether it imports fairseq."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out, fairseq = set(), False
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and dynamic(node):  # importlib.import_module("x"), __import__("x")
            targets = [node.args[0].value]
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = ".".join(p for p in base if p)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            fairseq |= t.split(".")[0] in FAIRSEQ
            while t and t not in known:  # import a.b.c of a module a.b.c, or of a name in a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out, fairseq


def floor_of(name):
    best = max((p for _, held, _ in FLOORS for p in held if name == p or name.startswith(p + ".")), key=len)
    return next(i for i, (_, held, _) in enumerate(FLOORS) if best in held)


def is_command(name):
    return floor_of(name) == len(FLOORS) - 1 and name.count(".") == 1


def problems(root):
    """Every import that points up, imports fairseq where its floor may not, or is a command borrowing from a
    command not in BUILT_ON; and every circle."""
    known = modules(root)
    graph, wrong = {}, []
    for name, path in sorted(known.items()):
        graph[name], fairseq = imports(name, path, known)
        mine = floor_of(name)
        if fairseq and not FLOORS[mine][2]:
            wrong.append(f"{name} ({FLOORS[mine][0]}) imports fairseq")
        for t in sorted(graph[name]):
            if floor_of(t) > mine:
                wrong.append(f"{name} ({FLOORS[mine][0]}) imports {t} ({FLOORS[floor_of(t)][0]}), a floor above")
            elif is_command(name) and is_command(t) and (name, t) not in BUILT_ON:
                wrong.append(f"{name} imports the command {t}: share it through the kit (fairseq_moe/checkpoints/)")
    return wrong + [" -> ".join(c) for c in circles(graph)]


def circles(graph):
    """One circle per strongly connected group of modules (Tarjan), each as a path back to its start."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(path_around(graph, set(group), v))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def path_around(graph, group, start):
    """A path from start back to start inside group (breadth first)."""
    previous, todo = {start: None}, [start]
    for v in todo:
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1] + [start]
            if w in group and w not in previous:
                previous[w] = v
                todo.append(w)


def test_every_import_points_down_and_none_go_round():
    assert problems(ROOT) == []


def test_every_folder_and_file_has_a_floor():
    """A new folder in the glue must be placed (FLOORS); a module at the top of fairseq_moe/ is the door or a
    command (it has a main)."""
    known = modules(ROOT)
    door = {"fairseq_moe", "fairseq_moe.errors", "fairseq_moe.patches", "fairseq_moe.refusals"}
    for name, path in known.items():
        parts = name.split(".")
        if parts[0] == "fairseq_moe" and len(parts) > 2 or path.endswith("__init__.py") and len(parts) == 2:
            assert any(name == p or name.startswith(p + ".") for p in set().union(*(h for _, h, _ in FLOORS[2:-1]))), (
                f"{name}: put its folder on a floor (FLOORS here, docs/architecture.md)")
        elif parts[0] == "fairseq_moe" and name not in door:
            assert "def main(" in open(path, encoding="utf-8").read(), f"{name}: the top of fairseq_moe/ holds commands"


@pytest.fixture
def scratch(tmp_path):
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_checker_sees_an_upward_import_a_circle_and_a_borrowing_command(scratch):
    (scratch / "fairseq_moe" / "checkpoints" / "upward.py").write_text("def f():\n    from ..hooks import trainer\n")
    (scratch / "fairseq_moe_layer" / "one.py").write_text("from . import two\n")
    (scratch / "fairseq_moe_layer" / "two.py").write_text("from .one import x\n")
    (scratch / "fairseq_moe" / "average.py").write_text("from .upcycle import main\n")
    found = problems(scratch)
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq_moe.hooks.trainer (hooks), a floor above" in found
    assert "fairseq_moe_layer.one -> fairseq_moe_layer.two -> fairseq_moe_layer.one" in found
    assert any(p.startswith("fairseq_moe.average imports the command fairseq_moe.upcycle") for p in found)
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq" not in found
    (scratch / "fairseq_moe" / "checkpoints" / "upward.py").write_text("import fairseq.utils\n")
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq" in problems(scratch)
    (scratch / "fairseq_moe" / "checkpoints" / "upward.py").write_text(
        "import importlib\ndef f():\n    return importlib.import_module('fairseq_moe.hooks.trainer')\n")
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq_moe.hooks.trainer (hooks), a floor above" in (
        problems(scratch))
    (scratch / "fairseq_moe" / "checkpoints" / "upward.py").write_text("from omegaconf import OmegaConf\n")
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq" in problems(scratch)
    (scratch / "fairseq_moe" / "checkpoints" / "upward.py").write_text("def f():\n    __import__('fairseq')\n")
    assert "fairseq_moe.checkpoints.upward (checkpoints) imports fairseq" in problems(scratch)


# Test files that are about the repository as a whole rather than one module: this file (docs/architecture.md),
# the shipped hydra configs (configs/, tested with the glue's toy corpora), the docs' links (docs/), the suite's
# own warm starts of fairseq commands (tests/warm.py).
WHOLE = {"tests/test_architecture.py", "tests/fairseq_moe/test_configs.py", "tests/test_docs.py",
         "tests/fairseq_moe/test_warm.py"}


def test_tests_mirror_the_packages():
    """tests/PACKAGE/FOLDER/test_NAME.py (or test_NAME_ASPECT.py) tests the module PACKAGE/FOLDER/NAME.py (test_init:
    the folder's __init__), and tests/benchmarks/test_NAME.py the script benchmarks/NAME.py."""
    wrong = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(folder, ROOT)
        mirrored = os.path.join(ROOT, *rel.split(os.sep)[1:]) if rel != "tests" else None
        for f in sorted(files):
            if not (f.startswith("test_") and f.endswith(".py")) or os.path.join(rel, f) in WHOLE:
                continue
            words = f[len("test_"):-3].split("_")
            names = {"_".join(words[:i]) for i in range(1, len(words) + 1)}
            there = set() if mirrored is None or not os.path.isdir(mirrored) else {
                m[:-3] for m in os.listdir(mirrored) if m.endswith(".py")}
            if not names & ({"init"} if "__init__" in there else set()) | (names & there - {"__init__"}):
                wrong.append(os.path.join(rel, f))
    assert wrong == [], f"name each test file after the module it tests (test_MODULE[_ASPECT].py): {wrong}"


# Modules whose behaviour is tested in the file of another (the module that drives them), not in one of their own.
TESTED_IN = {
    "fairseq_moe/consolidate.py": "tests/fairseq_moe/test_reshard.py (consolidate is reshard to one file)",
    "fairseq_moe/checkpoints/hf_lm.py": "tests/fairseq_moe/test_import_hf.py and test_export_hf_lm.py (both ways)",
    "fairseq_moe/checkpoints/state.py": "the commands' tests (test_upcycle, test_prune, test_convert_moe_branch)",
    "fairseq_moe/checkpoints/new_files.py": "tests/fairseq_moe/checkpoints/test_command_input.py (nothing written)",
    "fairseq_moe/models/moe_ffn.py": "tests/fairseq_moe/models/test_moe_transformer*.py (the layers it builds)",
    "fairseq_moe/models/expert_use.py": "tests/fairseq_moe/test_prune.py (the routed weight, recomputed token by token)",
    "fairseq_moe/tasks/moe_language_modeling.py": "tests/fairseq_moe/models/test_moe_transformer_lm.py",
    "fairseq_moe/tasks/moe_translation.py": "tests/fairseq_moe/models/test_moe_transformer.py",
    "fairseq_moe/criterions/moe_cross_entropy.py": "tests/fairseq_moe/criterions/test_moe_loss.py",
    "fairseq_moe/errors.py": "every test of a refusal (the error types only)",
    "fairseq_moe_layer/experts.py": "tests/fairseq_moe_layer/test_layer.py (the experts against the loop oracle)",
    "fairseq_moe_layer/options.py": "tests/fairseq_moe_layer/test_config.py (the settings and their flags)",
    "fairseq_moe_layer/pipeline.py": "tests/fairseq_moe_layer/test_comm.py (overlap against one exchange)",
    "fairseq_moe_layer/__main__.py": "tests/fairseq_moe_layer/test_config.py (the flag table it prints)",
    "fairseq_moe_layer/__init__.py": "the layer's tests (its exports)",
    "fairseq_moe_kernels/__init__.py": "the kernels' tests (its exports)",
}


def test_every_module_has_its_test_file():
    """The other way round: every module has tests/.../test_MODULE[_ASPECT].py, or is named in TESTED_IN with the
    file that tests it (which must exist)."""
    tests = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        tests |= {os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.startswith("test_")}
    missing = []
    for name, path in sorted(modules(ROOT).items()):
        rel = os.path.relpath(path, ROOT)
        body = ast.parse(open(path, encoding="utf-8").read()).body
        if rel.endswith("__init__.py") and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                               for n in body):
            continue  # (a folder's docstring)
        folder, module = os.path.split(rel)
        module = "init" if module == "__init__.py" else module[:-3]
        mine = os.path.join("tests", folder)
        if not any(t.startswith(os.path.join(mine, f"test_{module}")) and t[len(mine) + 6 + len(module):][:1] in (
                ".", "_") for t in tests) and rel not in TESTED_IN:
            missing.append(rel)
    assert missing == [], f"give each a test file named after it, or say in TESTED_IN which file tests it: {missing}"
    for rel, where in TESTED_IN.items():
        assert os.path.exists(os.path.join(ROOT, rel)), f"TESTED_IN names {rel}, which is gone"
        first = where.split(" ")[0]
        assert not first.startswith("tests/") or any(t.startswith(first.rstrip("*.py").rstrip("*")) for t in tests), where
