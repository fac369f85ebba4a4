"""Rewrite an expert-parallel checkpoint for another world size, optimizer state included.

    python -m fairseq_moe.reshard save/checkpoint_last.pt out/checkpoint_last.pt --world-size 8
    python -m fairseq_moe.reshard save/checkpoint_last.pt one/checkpoint.pt --world-size 1   # one file

IN is a set written by fairseq-train (NAME.pt, NAME-shared.pt or any NAME-rank-R.pt of it) or a single
file written by this command. OUT: NAME.pt; W' > 1 writes NAME-shared.pt and NAME-rank-0..W'-1.pt,
W' = 1 writes NAME.pt with every expert (what `python -m fairseq_moe.consolidate` does). Every input file
is checked (expert_checkpoint.read_set); existing files are never overwritten.
"""
import argparse
import os
import sys

import torch

from . import expert_checkpoint as shards
from .checkpoint import register_safe_globals
from .moe.comm import expert_parallel_size


def read_any(path):
    """The full state (every expert) of a set or of a single consolidated file."""
    found = shards.locate(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no such checkpoint (nor {shards.set_base(path)}-shared.pt)")
    if found[0] == "set":
        return shards.assemble(found[1])
    return torch.load(found[1], map_location="cpu", weights_only=True)


def _outputs(out, world_size):
    if world_size == 1:
        return [out]
    base = shards.set_base(out)
    return [shards.rank_path(base, r) for r in range(world_size)] + [shards.shared_path(base)]


def _save(obj, path):
    """Write whole or not at all: a file appears under its name only when complete."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def reshard(src, out, world_size):
    if not out.endswith(".pt"):
        raise ValueError(f"OUT {out}: name the checkpoint NAME.pt")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    existing = [p for p in _outputs(out, world_size) if os.path.exists(p)]
    if existing:
        raise FileExistsError(f"{existing[0]} exists; choose another OUT (nothing is overwritten)")
    state = read_any(src)
    experts = (state.get("extra_state", {}).get("moe_checkpoint") or {}).get("experts")
    if not experts:
        raise ValueError(f"{src} holds no expert manifest: not a checkpoint of fairseq-moe training")
    for E in set(experts.values()):
        expert_parallel_size(E, world_size)  # names the flags when E and W' do not fit
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return shards.write(state, out, world_size, save=_save)


def main(argv=None, prog="python -m fairseq_moe.reshard", world_size=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="NAME.pt of a sharded set (or one of its files), or a single file")
    parser.add_argument("output", help="NAME.pt to write")
    if world_size is None:
        parser.add_argument("--world-size", type=int, required=True, help="ranks the output is for")
    args = parser.parse_args(argv)
    register_safe_globals()
    try:
        written = reshard(args.input, args.output, world_size or args.world_size)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
