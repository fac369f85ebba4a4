"""Rewrite an expert-parallel checkpoint for another world size, optimizer state included.

    python -m fairseq_moe.reshard save/checkpoint_last.pt out/checkpoint_last.pt --world-size 8
    python -m fairseq_moe.reshard save/checkpoint_last.pt one/checkpoint.pt --world-size 1   # one file

IN is a set written by fairseq-train (NAME.pt, NAME-shared.pt or any NAME-rank-R.pt of it) or a single
file written by this command. OUT: NAME.pt; W' > 1 writes NAME-shared.pt and NAME-rank-0..W'-1.pt,
W' = 1 writes NAME.pt with every expert (what `python -m fairseq_moe.consolidate` does). Every input file
is checked (checkpoints/sets.read_set); existing files are never overwritten, and a command that fails
leaves no output behind.
"""
import sys

import torch

from .checkpoints import sets as shards
from .checkpoints import safe_load
from .checkpoints.command import PROG, parser, read_any, run, safe_globals
from .errors import CheckpointError, FlagError
from fairseq_moe_layer.comm import expert_parallel_size
from .checkpoints.new_files import refuse_existing, write_new


def _check_state(state, src):
    """The expert manifest of a full-expert state (a dict), after checking what writing it relies on."""
    experts = shards.manifest_of(state).get("experts")
    if not experts or not isinstance(experts, dict):
        raise CheckpointError(f"{src} holds no expert manifest: not a checkpoint of fairseq-moe training")
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{src}: not a fairseq checkpoint (no model state)")
    for name, E in experts.items():
        t = model.get(name)
        if not isinstance(E, int) or E < 1 or not torch.is_tensor(t) or t.dim() < 1 or t.shape[0] != E:
            raise CheckpointError(f"{src}: its manifest lists {name} with {E!r} experts, but the model state "
                                  f"holds {'no such tensor' if not torch.is_tensor(t) else tuple(t.shape)}")
    return experts


def reshard(src, out, world_size, ema=False):
    if not out.endswith(".pt"):
        raise FlagError(f"OUT {out}: name the checkpoint NAME.pt")
    if world_size < 1:
        raise FlagError(f"--world-size must be >= 1, got {world_size}")
    base = shards.set_base(out)
    refuse_existing([out] if world_size == 1 else [shards.rank_path(base, r) for r in range(world_size)] + [
        shards.shared_path(base)])
    state = read_any(src)
    if ema:  # the EMA copy (--store-ema) as the model, for generation: no optimizer state, no second copy
        extra = state.get("extra_state") if isinstance(state.get("extra_state"), dict) else {}
        if not isinstance(extra.get("ema"), dict):
            raise CheckpointError(f"{src} holds no EMA weights (it was trained without --store-ema)")
        state = {k: v for k, v in state.items() if k != "last_optimizer_state"}
        state.update(model=dict(extra["ema"]), extra_state=dict(shards.without_ema(extra), **{
            shards.MADE_BY: {"what": "the EMA weights written by reshard --ema"}}))  # (not resumed as a run)
    experts = _check_state(state, src)
    safe_load.check_config(state, src)  # nothing runs here, but a checkpoint that would run code is not copied on
    for name, E in experts.items():
        try:
            expert_parallel_size(E, world_size)
        except ValueError:
            raise FlagError(f"--world-size {world_size}: {src} has {E} experts in {name.rsplit('.', 2)[0]}; one must "
                            f"be a multiple of the other (E/W experts per rank, or W/E replicas of each)") from None
    return write_new(out, lambda save: write(state, src, out, world_size, save))


def write(state, src, out, world_size, save):
    """shards.write, its refusal of optimizer state that is not per expert (a plain ValueError of the format's)
    named by the input file."""
    try:
        return shards.write(state, out, world_size, save=save)
    except ValueError as e:
        if isinstance(e, (FlagError, CheckpointError)):
            raise
        raise CheckpointError(f"{src}: {e}") from None


def main(argv=None, prog=PROG.format("reshard"), world_size=None):
    p = parser(prog, __doc__)
    p.add_argument("input", help="NAME.pt of a sharded set (or one of its files), or a single file")
    p.add_argument("output", help="NAME.pt to write")
    if world_size is None:
        p.add_argument("--world-size", type=int, required=True, help="ranks the output is for")
    p.add_argument("--ema", action="store_true", help="write the EMA weights (--store-ema) as the model, "
                                                      "without optimizer state: for fairseq-generate")
    a = p.parse_args(argv)
    return run(p.prog, lambda: reshard(a.input, a.output, world_size or a.world_size, ema=a.ema),
               lambda written: "\n".join(written), setup=safe_globals)


if __name__ == "__main__":
    sys.exit(main())
