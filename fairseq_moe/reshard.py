"""Rewrite an expert-parallel checkpoint for another world size, optimizer state included.

    python -m fairseq_moe.reshard save/checkpoint_last.pt out/checkpoint_last.pt --world-size 8
    python -m fairseq_moe.reshard save/checkpoint_last.pt one/checkpoint.pt --world-size 1   # one file

IN is a set written by fairseq-train (NAME.pt, NAME-shared.pt or any NAME-rank-R.pt of it) or a single
file written by this command. OUT: NAME.pt; W' > 1 writes NAME-shared.pt and NAME-rank-0..W'-1.pt,
W' = 1 writes NAME.pt with every expert (what `python -m fairseq_moe.consolidate` does). Every input file
is checked (expert_checkpoint.read_set); existing files are never overwritten, and a command that fails
leaves no output behind.
"""
import argparse
import pickle
import sys

import torch

from . import expert_checkpoint as shards
from . import safe_eval
from .checkpoint import register_safe_globals
from fairseq_moe_layer.comm import expert_parallel_size
from .new_files import one_line, refuse_existing, write_new


def read_any(path):
    """The full state (every expert) of a set or of a single consolidated file. Files are read with
    torch.load(weights_only=True) only; whatever is not a readable checkpoint is an error naming a file."""
    found = shards.locate(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no such checkpoint (nor {shards.set_base(path)}-shared.pt)")
    if found[0] == "set":
        return shards.assemble(found[1])  # structure errors are named (expert_checkpoint.laid_out)
    return shards.read_file(found[1], what="the checkpoint to reshard")


def _check_state(state, src):
    """The expert manifest of a full-expert state, after checking what writing it relies on."""
    if not isinstance(state, dict):
        raise ValueError(f"{src}: not a fairseq checkpoint (it holds a {type(state).__name__}, not a dict)")
    experts = shards.manifest_of(state).get("experts")
    if not experts or not isinstance(experts, dict):
        raise ValueError(f"{src} holds no expert manifest: not a checkpoint of fairseq-moe training")
    model = state.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{src}: not a fairseq checkpoint (no model state)")
    for name, E in experts.items():
        t = model.get(name)
        if not isinstance(E, int) or E < 1 or not torch.is_tensor(t) or t.dim() < 1 or t.shape[0] != E:
            raise ValueError(f"{src}: its manifest lists {name} with {E!r} experts, but the model state "
                             f"holds {'no such tensor' if not torch.is_tensor(t) else tuple(t.shape)}")
    return experts


def reshard(src, out, world_size, ema=False):
    if not out.endswith(".pt"):
        raise ValueError(f"OUT {out}: name the checkpoint NAME.pt")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    base = shards.set_base(out)
    refuse_existing([out] if world_size == 1 else [shards.rank_path(base, r) for r in range(world_size)] + [
        shards.shared_path(base)])
    state = read_any(src)
    if ema:  # the EMA copy (--store-ema) as the model, for generation: no optimizer state, no second copy
        extra = state.get("extra_state") or {}
        if not isinstance(extra.get("ema"), dict):
            raise ValueError(f"{src} holds no EMA weights (it was trained without --store-ema)")
        state = {k: v for k, v in state.items() if k != "last_optimizer_state"}
        state.update(model=dict(extra["ema"]), extra_state=dict(shards.without_ema(extra), **{
            shards.MADE_BY: {"what": "the EMA weights written by reshard --ema"}}))  # (not resumed as a run)
    experts = _check_state(state, src)
    safe_eval.check_config(state, src)  # nothing runs here, but a checkpoint that would run code is not copied on
    for E in set(experts.values()):
        expert_parallel_size(E, world_size)  # names the flags when E and W' do not fit
    return write_new(out, lambda save: shards.write(state, out, world_size, save=save))


def run_tool(prog, work, report):
    """A checkpoint tool's main: work() with the safe globals registered; bad input (ValueError, OSError) is
    one `PROG: error:` line and exit code 2, else report(work's result) is printed and the code is 0."""
    register_safe_globals()
    try:
        result = work()
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(report(result))
    return 0


def main(argv=None, prog="python -m fairseq_moe.reshard", world_size=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="NAME.pt of a sharded set (or one of its files), or a single file")
    parser.add_argument("output", help="NAME.pt to write")
    if world_size is None:
        parser.add_argument("--world-size", type=int, required=True, help="ranks the output is for")
    parser.add_argument("--ema", action="store_true", help="write the EMA weights (--store-ema) as the model, "
                                                           "without optimizer state: for fairseq-generate")
    args = parser.parse_args(argv)
    register_safe_globals()
    try:
        written = reshard(args.input, args.output, world_size or args.world_size, ema=args.ema)
    except (ValueError, OSError, pickle.UnpicklingError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
