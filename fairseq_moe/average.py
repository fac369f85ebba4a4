"""The last N checkpoints of a run averaged into one: fairseq's scripts/average_checkpoints.py, for sets too.

    python -m fairseq_moe.average --inputs save/ --num-update-checkpoints 5 --output save/average.pt
    python -m fairseq_moe.average --inputs save/checkpoint8.pt save/checkpoint9.pt --output average.pt

--inputs: checkpoints, each a single file or an expert-parallel set (NAME.pt, or one of its files: a set is read
whole, every expert); or, with --num-epoch-checkpoints N or --num-update-checkpoints N, one folder (a run's
--save-dir), of which the N newest checkpointEPOCH.pt or checkpoint_EPOCH_UPDATE.pt are taken, files or sets, by
their epoch or update number (with --checkpoint-upper-bound B none past B), newest first: fairseq's flags and
names. Every floating tensor of the model is the mean over the inputs, summed in fp32 (fp64 in fp64) in their
order and cast back to its dtype (fairseq's script leaves an fp16 mean in fp32 and sums bf16 in bf16);
everything else (the model's other tensors, the config, the optimizer state, the EMA, the data iterator) is the
first input's, the newest when they are chosen by number, as fairseq's script keeps them. The inputs must be one
model: the same parameters, of the same shapes, the same experts per MoE layer; else one line names the input
that differs, and nothing is written.

OUTPUT (NAME.pt) is one file with every expert, as `python -m fairseq_moe.consolidate` writes: fairseq-generate
reads it (at any world size) and `python -m fairseq_moe.reshard` spreads it over ranks. It is new, never written
over a file or the set of that name, and written whole or not at all.
"""
import os
import re
import sys

import torch

from .checkpoints import safe_load
from .checkpoints import sets as shards
from .checkpoints.command import PROG, new_checkpoint, parser, read_any, run, safe_globals
from .checkpoints.new_files import write_new
from .errors import CheckpointError, FlagError

# fairseq's names: checkpoint{epoch}.pt at the end of an epoch, checkpoint_{epoch}_{update}.pt every
# --save-interval-updates (checkpoint_utils.save_checkpoint); the number they are ordered by
NUMBERED = {False: (re.compile(r"checkpoint(\d+)"), "checkpointEPOCH.pt", "--num-epoch-checkpoints"),
            True: (re.compile(r"checkpoint_\d+_(\d+)"), "checkpoint_EPOCH_UPDATE.pt", "--num-update-checkpoints")}


def last_checkpoints(folder, n, by_update, upper_bound=None):
    """The n newest checkpoints (files or sets, as NAME.pt) in folder, newest first, by epoch or update number
    (none past upper_bound), as fairseq's last_n_checkpoints picks them."""
    pattern, names, flag = NUMBERED[by_update]
    if n < 1:
        raise FlagError(f"{flag} {n}: must be >= 1")
    if not os.path.isdir(folder):
        what = "no such folder" if not os.path.exists(folder) else "not a folder"
        raise FlagError(f"--inputs {folder}: {what}; with {flag}, --inputs is the run's folder (its --save-dir)")
    run_names = shards.run_names("")  # (files, sets, and the temporaries of a save a reader finishes)
    found = {}
    for f in os.listdir(folder):
        m = run_names.match(f)
        number = pattern.fullmatch("checkpoint" + m.group(1)) if m else None
        if number and (upper_bound is None or int(number.group(1)) <= upper_bound):
            found["checkpoint" + m.group(1)] = int(number.group(1))
    chosen = []
    for name, _ in sorted(found.items(), key=lambda item: (item[1], item[0]), reverse=True):
        path = os.path.join(folder, name + ".pt")
        if shards.locate(path) is not None:  # (a file or a set there, not only a temporary)
            chosen.append(path)
        if len(chosen) == n:
            return chosen
    bound = f" up to {upper_bound} (--checkpoint-upper-bound)" if upper_bound is not None else ""
    raise FlagError(f"{flag} {n}: {folder} has {len(chosen)} checkpoints named {names} (files or sets){bound}, "
                    f"fewer than {n}")


def experts_of(state):
    """{MoE parameter: experts} of a full state's manifest ({} for a model without MoE layers)."""
    return dict(shards.manifest_of(state).get("experts") or {})


def check_like(state, path, first, first_path):
    """state (read from path) is the model of first (read from first_path), or one line says how it is not."""
    if experts_of(state) != experts_of(first):
        ours, theirs = experts_of(state), experts_of(first)
        name = next(k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"{path}: {name} has {ours.get(name, 'no')} experts, in {first_path} "
                              f"{theirs.get(name, 'no')}: not the same model")
    model, model0 = state["model"], first["model"]
    missing, extra = sorted(set(model0) - set(model)), sorted(set(model) - set(model0))
    if missing or extra:
        what = f"has no {missing[0]}" if missing else f"has {extra[0]}, which {first_path} has not"
        raise CheckpointError(f"{path} {what}: not the same model as {first_path}")
    for key, t0 in model0.items():
        t = model[key]
        if torch.is_tensor(t0) != torch.is_tensor(t) or torch.is_tensor(t0) and (
                t.shape != t0.shape or t.is_floating_point() != t0.is_floating_point()):
            describe = lambda x: f"{tuple(x.shape)} {x.dtype}" if torch.is_tensor(x) else type(x).__name__  # noqa: E731
            raise CheckpointError(f"{path}: {key} is {describe(t)}, in {first_path} {describe(t0)}: not the same "
                                  f"model")


def summed_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def average(inputs, out):
    """Write OUT, the average of the checkpoints inputs (see the module's doc); returns the files written."""
    new_checkpoint(out, "--output")
    for path in inputs:
        if os.path.isdir(path):
            raise FlagError(f"--inputs {path} is a folder: give --num-epoch-checkpoints N or --num-update-checkpoints "
                            f"N to average its newest N checkpoints, or name the checkpoints")
    first, sums = None, {}
    for path in inputs:  # one at a time: the first (whose fields are kept), the sums and the one being read
        state = read_any(path)
        if first is None:
            safe_load.check_config(state, path)  # (its config is copied on: nothing that would run code)
            first = state
            sums = {k: t.to(summed_dtype(t), copy=True) for k, t in state["model"].items()
                    if torch.is_tensor(t) and t.is_floating_point()}
            continue
        check_like(state, path, first, inputs[0])
        for key, total in sums.items():
            total += state["model"][key].to(total.dtype)
        del state
    model = {k: (sums[k] / len(inputs)).to(t.dtype) if k in sums else t for k, t in first["model"].items()}
    averaged = dict(first, model=model)

    def write(save):
        if experts_of(first):  # (reshard's one file: a fresh save id, world size 1, every expert)
            return shards.write(averaged, out, 1, save=save)
        save(averaged, out)  # (a model without MoE layers: as fairseq's script writes it)
        return [out]

    return write_new(out, write)


def main(argv=None):
    p = parser(PROG.format("average"), __doc__)
    p.add_argument("--inputs", required=True, nargs="+", metavar="CKPT",
                   help="checkpoints (single files or sets, NAME.pt), or with --num-*-checkpoints the run's folder")
    p.add_argument("--output", required=True, metavar="OUT.pt", help="the averaged checkpoint (new): one file")
    number = p.add_mutually_exclusive_group()
    number.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                        help="average the N newest checkpointEPOCH.pt of the folder --inputs")
    number.add_argument("--num-update-checkpoints", type=int, metavar="N",
                        help="average the N newest checkpoint_EPOCH_UPDATE.pt of the folder --inputs")
    p.add_argument("--checkpoint-upper-bound", type=int, metavar="B",
                   help="with --num-*-checkpoints: none past epoch / update B")
    a = p.parse_args(argv)
    by_update = a.num_update_checkpoints is not None
    n = a.num_update_checkpoints if by_update else a.num_epoch_checkpoints

    def work():
        if n is None and a.checkpoint_upper_bound is not None:
            raise FlagError("--checkpoint-upper-bound goes with --num-epoch-checkpoints or --num-update-checkpoints")
        if n is not None and len(a.inputs) != 1:
            raise FlagError(f"{NUMBERED[by_update][2]}: give --inputs one folder (the run's --save-dir), not "
                            f"{len(a.inputs)} paths")
        inputs = a.inputs if n is None else last_checkpoints(a.inputs[0], n, by_update, a.checkpoint_upper_bound)
        return inputs, average(inputs, a.output)

    return run(p.prog, work, lambda done: f"{a.output}: the average of {len(done[0])} checkpoints "
                                          f"({', '.join(done[0])})", setup=safe_globals)


if __name__ == "__main__":
    sys.exit(main())
