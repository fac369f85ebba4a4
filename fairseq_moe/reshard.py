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
import contextlib
import os
import pickle
import re
import shutil
import sys
import tempfile

import torch

from . import expert_checkpoint as shards
from . import safe_eval
from .checkpoint import register_safe_globals
from .moe.comm import expert_parallel_size


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


def _publish(tmp, path):
    """Give the written file tmp the name path, unless something has that name (a dangling link too)."""
    exists = FileExistsError(f"{path} appeared while this command was writing (nothing is overwritten)")
    try:
        os.link(tmp, path)  # atomic, and fails when path exists
    except FileExistsError:
        raise exists from None
    except OSError:  # no hard links on this file system: check, then rename
        if os.path.lexists(path):
            raise exists from None
        os.rename(tmp, path)


class Writer:
    """Writes each output whole (in a fresh private folder beside it, then linked to its name), never over
    anything, and can take back what it published."""

    staging = None  # the private folder, made at the first save: new, so nothing in it is a link

    def __init__(self):
        self.published = []  # (path, (st_dev, st_ino)) of the files this command created

    def save(self, obj, path):
        try:
            if self.staging is None:
                self.staging = tempfile.mkdtemp(prefix=".reshard-", dir=os.path.dirname(os.path.abspath(path)))
            tmp = os.path.join(self.staging, os.path.basename(path))
            with open(tmp, "xb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
                st = os.fstat(f.fileno())
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as RuntimeError
            raise OSError(f"{path}: cannot write it ({type(e).__name__}: {e})") from e
        _publish(tmp, path)
        self.published.append((path, (st.st_dev, st.st_ino)))

    def undo(self):
        """Remove the files this command published, each only while it is still the file written."""
        removed = []
        for path, ident in reversed(self.published):
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == ident:
                    os.unlink(path)
                    removed.append(path)
        return removed

    def close(self):
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def _make_folder(folder):
    """os.makedirs(folder); returns the folders it created, deepest first."""
    created, f = [], folder
    while not os.path.lexists(f) and os.path.dirname(f) != f:
        created.append(f)
        f = os.path.dirname(f)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"{folder}: cannot create the output folder ({e.strerror or e})") from e
    return created


def refuse_existing(paths):
    """Raise FileExistsError for the first of paths that exists (a dangling link too): nothing is overwritten."""
    existing = [p for p in paths if os.path.lexists(p)]
    if existing:
        what = " (a symbolic link)" if os.path.islink(existing[0]) else ""
        raise FileExistsError(f"{existing[0]} exists{what}; choose another OUT (nothing is overwritten)")


def write_new(out, write):
    """write(save) with save(obj, path) writing one new file beside out each: whole files or none. On any
    failure the files written so far and the folders made for them are removed again."""
    created = _make_folder(os.path.dirname(os.path.abspath(out)))
    writer = Writer()
    try:
        return write(writer.save)
    except BaseException as e:
        removed = writer.undo()
        writer.close()
        for folder in created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty
        if removed and isinstance(e, (ValueError, OSError)):
            kind = next(k for k in (FileExistsError, OSError, ValueError) if isinstance(e, k))
            raise kind(f"{one_line(e)}; removed the {len(removed)} file(s) this command had written "
                       f"({', '.join(removed)})") from e
        raise
    finally:
        writer.close()


def reshard(src, out, world_size):
    if not out.endswith(".pt"):
        raise ValueError(f"OUT {out}: name the checkpoint NAME.pt")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    base = shards.set_base(out)
    refuse_existing([out] if world_size == 1 else [shards.rank_path(base, r) for r in range(world_size)] + [
        shards.shared_path(base)])
    state = read_any(src)
    experts = _check_state(state, src)
    safe_eval.check_config(state, src)  # nothing runs here, but a checkpoint that would run code is not copied on
    for E in set(experts.values()):
        expert_parallel_size(E, world_size)  # names the flags when E and W' do not fit
    return write_new(out, lambda save: shards.write(state, out, world_size, save=save))


def one_line(e):
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    else:
        msg = str(e)
    return re.sub(r"\s*[\r\n]+\s*", " ", msg).strip()


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
    args = parser.parse_args(argv)
    register_safe_globals()
    try:
        written = reshard(args.input, args.output, world_size or args.world_size)
    except (ValueError, OSError, pickle.UnpicklingError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
