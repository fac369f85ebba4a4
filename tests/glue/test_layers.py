"""Imports point down, in the glue too (docs/architecture.md's picture): every import of every module of
fairseq_moe, at its top or inside a function, read from the source."""
import ast
import os

import fairseq_moe

PACKAGE = os.path.dirname(os.path.abspath(fairseq_moe.__file__))

# From the bottom up: a module may import only what sits in its own layer or below (and fairseq where
# allowed). The layer (fairseq_moe_layer) and the kernels are below them all.
LAYERS = [
    ("formats", {"errors", "safe_eval", "expert_checkpoint", "commit", "new_files"}, False),
    ("hooks", {"fits", "refusals", "patches", "compat", "cli", "checkpoint", "spread", "optim", "fsdp"}, True),
    ("fairseq's registries", {"models", "criterions", "tasks"}, True),
    ("tools", {"__init__", "command", "reshard", "consolidate", "upcycle", "convert_moe_branch", "export_hf",
               "prune", "inspect", "plot", "launch"}, True),
]


def imported(path, module):
    """The fairseq_moe top-level names (moe, checkpoint, models, ...) and whether fairseq is imported."""
    names, fairseq = set(), False
    package = module.split(".")[:-1] if not path.endswith("__init__.py") else module.split(".")
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                fairseq |= parts[0] in ("fairseq", "fairseq_cli")
                if parts[0] == "fairseq_moe" and len(parts) > 1:
                    names.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")
            fairseq |= base[0] in ("fairseq", "fairseq_cli")
            if base[0] == "fairseq_moe":
                names |= {base[1]} if len(base) > 1 else {a.name for a in node.names}
    return names, fairseq


def test_every_glue_module_imports_only_its_layer_and_below():
    layer_of = {name: i for i, (_, names, _) in enumerate(LAYERS) for name in names}
    wrong = []
    for root, _, files in os.walk(PACKAGE):
        rel = os.path.relpath(root, PACKAGE).split(os.sep)
        if "__pycache__" in rel:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            top = rel[0] if rel != ["."] else f[:-3]
            assert top in layer_of, f"{top}: put it in one of docs/architecture.md's layers (LAYERS here)"
            module = ".".join(["fairseq_moe"] + ([] if rel == ["."] else rel) + [f[:-3]])
            names, fairseq = imported(os.path.join(root, f), module)
            mine = layer_of[top]
            if fairseq and not LAYERS[mine][2]:
                wrong.append(f"{module} imports fairseq")
            wrong += [f"{module} ({LAYERS[mine][0]}) imports fairseq_moe.{n} ({LAYERS[layer_of[n]][0]})"
                      for n in sorted(names) if n in layer_of and layer_of[n] > mine]
    assert wrong == []
