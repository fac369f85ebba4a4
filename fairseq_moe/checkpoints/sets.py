"""Checkpoints of expert-parallel training: one file per rank for its experts, one shared file.

For a checkpoint NAME.pt written by W ranks whose experts are spread (the layout of fairseq's moe branch):

    NAME-shared.pt   fairseq's usual checkpoint without the spread experts: the shared weights and their
                     optimizer state, lr scheduler, data iterator, metrics. Written by rank 0.
    NAME-rank-R.pt   rank R's slice [E_l, ...] of every expert tensor and those experts' optimizer state
                     (keyed by parameter name). Written by rank R.

A save of many ranks commits its sets as a whole (commit.py): the files are written under staged names
(NAME-rank-R.pt.SAVEID.staged), then a journal moe-commit-SAVEID.json lists the names to switch. A reader
that meets such a journal finishes its renames for the set it opens (finish_renames), so it reads the
committed save, never half of one.

Every file carries the same manifest (update number, a save id drawn once per save, world size, expert
layout); loading checks each file against the shared file's and names the first missing or mismatched
one, so files of two saves never load together. A set loads at any world size: each rank's experts and
their optimizer state are cut from the old ranks' slices, read memory-mapped. No fairseq import here:
this is the file format, used by the trainer hooks (hooks/trainer.py) and reshard/consolidate.
"""
import contextlib
import filecmp
import glob
import json
import logging
import os
import pickle
import re
import stat
import time
import uuid
import zipfile

import torch

from ..errors import CheckpointError, MissingCheckpointError
from fairseq_moe_layer.comm import local_experts

logger = logging.getLogger(__name__)

FORMAT = 1
_SHARD = re.compile(r"^(?P<base>.*?)(-shared|-rank-(?P<rank>\d+))?\.pt$")


def set_base(path):
    """NAME for NAME.pt, NAME-shared.pt or NAME-rank-R.pt."""
    m = _SHARD.match(path)
    if m is None:
        raise ValueError(f"{path}: a checkpoint file name ends in .pt")
    return m.group("base")


def shared_path(base):
    return f"{base}-shared.pt"


def rank_path(base, rank):
    return f"{base}-rank-{rank}.pt"


def staged_path(final, save_id):
    """Where a save stages the file `final` until its commit (commit.py)."""
    return f"{final}.{save_id}.staged"


STAGED = re.compile(r"^(?P<final>.+\.pt)\.(?P<save_id>[0-9a-f]{32})\.staged$")
# moe-commit-SAVEID[SUFFIX].json: the run's --checkpoint-suffix in the name, so runs of one folder keep apart.
JOURNAL = re.compile(r"^moe-commit-(?P<save_id>[0-9a-f]{32})(?P<suffix>.*?)\.json(?P<tmp>\.tmp)?$")
# A journal is a few names: anything larger, or of more ranks than any run has, is not one of ours.
MAX_JOURNAL_BYTES = 1 << 20
MAX_WORLD_SIZE = 1 << 16
_warned = set()  # (path, mtime) of the journals refused so far in this process: one warning each


def run_names(suffix):
    """The file names of one run's checkpoints (checkpoint3, checkpoint_2_400, checkpoint_last,
    checkpoint_best, checkpoint.best_loss_3.2101 as fairseq names them; with --checkpoint-suffix), as sets,
    files or temporaries: group 1 is the name without the suffix."""
    return re.compile(r"^checkpoint(\d+|_\d+_\d+|_last|_best|\.best_\w+?_\d+\.?\d*)" + re.escape(suffix or "")
                      + r"(-shared|-rank-\d+)?\.pt(?P<tmp>\.tmp|\.[0-9a-f]{32}\.staged)?$")


def journal_path(folder, save_id, suffix=""):
    return os.path.join(folder, f"moe-commit-{save_id}{suffix or ''}.json")


def journals(folder, suffix=None):
    """[(path, journal)] of the committed saves whose switch has not finished in folder (oldest first), of
    one --checkpoint-suffix (None: of any), each proven to be a save of that run in this folder
    (journal_problem). Any other file named like a journal is left alone, with one warning naming it."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        m = JOURNAL.match(name)
        if m and not m.group("tmp") and suffix in (None, m.group("suffix")):
            path = os.path.join(folder, name)
            journal, why = read_journal(path)
            if journal is not None:
                why = journal_problem(folder, journal, m.group("save_id"), m.group("suffix"))
            if why is None:
                out.append((journal["mtime"], path, dict(journal, suffix=m.group("suffix"))))
            elif why is not _GONE:
                _warn_once(path, why)
    return [(path, journal) for _, path, journal in sorted(out)]


_GONE = "gone"  # (a journal removed while we looked: its switch has finished)


def _warn_once(path, why):
    with contextlib.suppress(OSError):
        key = (path, os.lstat(path).st_mtime_ns)
        if key not in _warned:
            _warned.add(key)
            logger.warning(f"{path}: not acted on, left as it is: {why}")


def _regular(path):
    """os.lstat(path) when path is a regular file (not a link, a FIFO, a device), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def read_journal(path):
    """(journal, None) for the journal at path ({"save_id", "world_size", "commit": [NAME], "retire": [NAME]},
    with "mtime" added), or (None, why it is not one). Only a regular file of at most MAX_JOURNAL_BYTES is
    opened (never a link, FIFO or device); a save writes it whole by a rename, so never half."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, _GONE
    except OSError as e:
        return None, f"cannot be opened ({'a symbolic link' if os.path.islink(path) else e.strerror or e})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size > MAX_JOURNAL_BYTES:
            return None, f"{st.st_size} bytes, more than a journal's {MAX_JOURNAL_BYTES}"
        data = f.read(MAX_JOURNAL_BYTES + 1)
    try:
        journal = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        return None, f"not JSON ({type(e).__name__})"
    W = journal.get("world_size") if isinstance(journal, dict) else None
    if not (isinstance(journal, dict) and isinstance(journal.get("save_id"), str)
            and type(W) is int and 1 <= W <= MAX_WORLD_SIZE
            and all(isinstance(journal.get(k), list) and all(isinstance(n, str) for n in journal[k])
                    for k in ("commit", "retire"))):
        return None, (f"not a journal: it needs save_id, world_size (1..{MAX_WORLD_SIZE}), commit and retire "
                      f"(lists of names)")
    return dict(journal, mtime=st.st_mtime), None


def journal_problem(folder, journal, save_id, suffix):
    """None when the journal is provably a committed save of the run with this --checkpoint-suffix in folder,
    else why not. Checked before anything is renamed or removed: its id is its file name's; it commits at least
    one set and retires others, every one named by the run's rules (run_names); its world size agrees with the
    files: each committed set's shared and rank 0..W-1 files are on disk, each staged by this save as a regular
    file or already renamed (its manifest carries this save's id); no file staged by this save lies outside
    it."""
    commit, retire, W = journal["commit"], journal["retire"], journal["world_size"]
    if journal["save_id"] != save_id:
        return f"its save_id {journal['save_id']!r} is not the one in its name"
    if not commit:
        return "it commits no set"
    names = run_names(suffix)
    for name in commit + retire:
        m = names.match(f"{name}-shared.pt")
        if m is None or m.group("tmp"):
            return f"{name!r} is not a checkpoint name of this run (--checkpoint-suffix {suffix!r})"
    if set(commit) & set(retire):
        return f"it both commits and retires {sorted(set(commit) & set(retire))[0]}"
    for name in retire:  # (a save retires sets of earlier saves only: commit and retire are disjoint)
        for path in set_files(os.path.join(folder, name)):
            if saved_by(path) == save_id:
                return f"it retires {path}, which is this save's"
    ours = {final for name in commit + retire for _, final in committed_files(os.path.join(folder, name), journal)}
    for name in os.listdir(folder):
        m = STAGED.match(name)
        if m and m.group("save_id") == save_id and os.path.join(folder, m.group("final")) not in ours:
            return f"{name} was staged by this save but is not one of the {W} ranks' files it commits"
    for name in commit:
        base = os.path.join(folder, name)
        for staged, final in committed_files(base, journal):
            if os.path.lexists(staged):
                if _regular(staged) is None:
                    return f"{staged} is not a regular file (a link?)"
                continue
            if not os.path.lexists(final):
                return f"{final} is missing (neither staged by this save nor renamed)"
            info = manifest_at(final)
            if info.get("save_id") != save_id:
                return f"{final} is not this save's (and nothing of this save is staged for it)"
            if info.get("world_size") != W:
                return f"{final} is of this save of {info.get('world_size')} ranks, not {W}"
        for old in set_files(base):  # (what the switch removes as a larger, earlier run's must not be this save's)
            rank = _SHARD.match(old).group("rank")
            if rank is not None and int(rank) >= W and manifest_at(old).get("save_id") == save_id:
                return f"{old} is this save's, beyond its world size {W}"
    return None


def manifest_at(path):
    """The manifest of the checkpoint file path (a shared file's, or a rank file's own), or {} (missing,
    unreadable, not a regular file)."""
    if _regular(path) is None:
        return {}
    try:
        state = read_file(path, mmap=True)
    except CheckpointError:
        return {}
    info = (state.get("moe_shard") or manifest_of(state)) if isinstance(state, dict) else None
    return info if isinstance(info, dict) else {}


def saved_by(path):
    """The save id in the manifest of the checkpoint file path, when it is one (32 hex digits), else None."""
    sid = manifest_at(path).get("save_id")
    return sid if isinstance(sid, str) and re.fullmatch(r"[0-9a-f]{32}", sid) else None


def aside_name(base, suffix, save_id):
    """NAME.damaged-ID for the set base (with the run's --checkpoint-suffix): a name no rule of the run
    (run_names) matches; it loads as a set by --restore-file NAME.damaged-ID.pt (fairseq adds the suffix)."""
    core = base[:len(base) - len(suffix)] if suffix and base.endswith(suffix) else base
    return f"{core}.damaged-{save_id[:8]}{suffix or ''}"


def rename_new(src, dst):
    """os.rename(src, dst) that fails with FileExistsError when dst exists (a dangling link too), unless dst is
    src already (a rename stopped between its link and its unlink: finished here)."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if os.path.samefile(src, dst) and not os.path.islink(dst):
                os.unlink(src)
                return
        raise FileExistsError(f"{dst} exists: {src} is not renamed over it") from None
    except OSError:  # (no hard links on this file system)
        if os.path.lexists(dst):
            raise FileExistsError(f"{dst} exists: {src} is not renamed over it") from None
        os.rename(src, dst)
        return
    os.unlink(src)


def keep_late_file(final, suffix=""):
    """final, about to be replaced, when it is a file of a set moved aside (commit.set_aside: it carries that
    set's save id) that arrived under its old name since (a copy still running then): moved to the set's new name,
    or beside it as NAME.damaged-ID.late-N when that name is taken by another file, so that nothing replaces it;
    a byte-identical copy of the file there is left to be replaced. Looked at only where the folder holds such a
    set."""
    folder, base = os.path.dirname(final) or ".", set_base(final)
    core = base[:len(base) - len(suffix)] if suffix and base.endswith(suffix) else base
    if _regular(final) is None or not any(n.startswith(os.path.basename(core) + ".damaged-") for n in os.listdir(folder)):
        return
    tag = saved_by(final)
    aside = aside_name(base, suffix, tag) if tag else None
    if not aside or not set_files(aside):
        return
    dst = aside + final[len(base):]
    if os.path.lexists(dst):
        if filecmp.cmp(final, dst, shallow=False):
            return  # (the same bytes are kept aside already)
        n = 1
        while set_files(f"{aside}.late-{n}"):
            n += 1
        dst = f"{aside}.late-{n}" + final[len(base):]
    rename_new(final, dst)
    logger.warning("%s belongs to the set moved aside as %s (it arrived after the move): kept as %s, not replaced",
                   final, aside, dst)


def committed_files(base, journal):
    """[(staged, final)] of the set NAME in a committed save's journal: its shared and rank files."""
    W, sid = journal["world_size"], journal["save_id"]
    finals = [shared_path(base)] + [rank_path(base, r) for r in range(W)]
    return [(staged_path(f, sid), f) for f in finals]


def finish_renames(base):
    """Give the staged files of a committed save of the set NAME their names (idempotent): what the save
    had left to do when it was stopped. Anyone may do it, any number of times; deleting is left to
    commit.recover(). Raises CheckpointError naming the journal when the folder cannot be changed."""
    folder = os.path.dirname(base) or "."
    for path, journal in journals(folder):
        if os.path.basename(base) not in journal["commit"]:
            continue
        for staged, final in committed_files(base, journal):
            if _regular(staged) is None:
                continue  # renamed already (or by someone else just now)
            try:
                keep_late_file(final, journal["suffix"])
                os.replace(staged, final)
            except FileNotFoundError:
                pass  # (renamed by someone else just now)
            except OSError as e:
                raise CheckpointError(f"{path}: the save it commits is complete on disk, but {staged} cannot be "
                                      f"renamed to {os.path.basename(final)} ({e.strerror or e}); resume the run "
                                      f"in a writable folder, or rename it by hand") from None


def locate(path):
    """("set", NAME), ("file", path) or None: resolve() without the reason."""
    found = resolve(path)
    return found[:2] if found else None


def resolve(path):
    """What a checkpoint path asks for: ("set", NAME, why), ("file", path, why), or None.

    A file named explicitly is the file loaded: NAME-shared.pt and NAME-rank-R.pt name the set NAME
    (or the single file of that name, when it is one). The bare NAME.pt names the set NAME or the single
    file NAME.pt, whichever exists; when both do (training in one folder at one and then at several
    ranks), the one saved later wins, so no run resumes from older weights. `why` says which was taken
    and why, for the log.
    """
    m = _SHARD.match(path)
    if m is None:
        return ("file", path, "named") if os.path.exists(path) else None
    base = m.group("base")
    finish_renames(base)
    if m.group(2):  # NAME-shared.pt / NAME-rank-R.pt
        if os.path.exists(path) and not _is_set_file(path):
            return ("file", path, "a single file (not part of a set)")
        return ("set", base, "named explicitly") if set_files(base) else None
    plain = f"{base}.pt"
    has_set, has_file = bool(set_files(base)), os.path.exists(plain)
    if has_set and has_file:
        if _later_or_same(base, plain):
            return ("set", base, f"saved later than the single file {plain}")
        return ("file", plain, f"saved later than the set {shared_path(base)}")
    if has_set:
        return ("set", base, "the only checkpoint of that name")
    return ("file", plain, "the only checkpoint of that name") if has_file else None


def set_files(base):
    """The files of the set NAME that exist: NAME-shared.pt and NAME-rank-R.pt (sorted)."""
    ranks = [p for p in glob.glob(glob.escape(base) + "-rank-*.pt")
             if (m := _SHARD.match(p)) and m.group("base") == base and m.group("rank") is not None]
    shared = [shared_path(base)] if os.path.exists(shared_path(base)) else []
    return shared + sorted(ranks)


def describe(found):
    """One line for the log: what locate() chose."""
    kind, target, why = found
    if kind == "file":
        return f"the single file {target} ({why})"
    return f"the expert-parallel set {shared_path(target)} + rank files ({why})"


def read_file(path, mmap=False, what=None):
    """torch.load(path, weights_only=True), passed explicitly: torch honours an explicit value over
    its environment overrides, so no setting turns pickle code execution back on. Every failure names
    the file (and, when it is missing, `what` it is for)."""
    if not os.path.exists(path):
        raise MissingCheckpointError(f"{path} is missing: {what}" if what else f"{path}: no such checkpoint file")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): a save that did not finish?")
    if mmap and not zipfile.is_zipfile(path):
        mmap = False  # (torch's legacy format cannot be memory-mapped: read whole)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        refused = re.search(r"(?i)unsupported (global|operand)[^\n]*", str(e))  # what it would have run
        raise CheckpointError(f"{path} is refused by safe loading (torch.load weights_only=True): it holds "
                              f"objects that are not tensors or plain data"
                              + (f" ({refused.group(0).strip()})" if refused else "")) from None
    except MemoryError:
        raise
    except Exception as e:  # truncated, or not a torch file at all
        raise CheckpointError(f"{path} cannot be read as a checkpoint (truncated, or not a checkpoint "
                              f"file?): {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def laid_out(what):
    """Surprises in the structure of a readable file (a foreign dict, wrong types or shapes) become one
    CheckpointError naming what was read, instead of an AttributeError deep in the loading code."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"{what} is not laid out as a fairseq(-moe) checkpoint: {type(e).__name__}: {e}") from None


def manifest_of(state):
    """The expert-parallel manifest a checkpoint state carries ({} when none)."""
    extra = state.get("extra_state") if isinstance(state, dict) else None
    info = extra.get("moe_checkpoint") if isinstance(extra, dict) else None
    return info if isinstance(info, dict) else {}


def _is_set_file(path):
    try:
        state = read_file(path, mmap=True)
    except CheckpointError:
        return True  # unreadable: let loading the set name it
    if not isinstance(state, dict) or "moe_shard" in state:
        return True  # (not a checkpoint at all: let loading name it)
    info = manifest_of(state)
    # A shared file has a save id and no experts; a consolidated file (reshard to 1) has its experts.
    return "save_id" in info and not any(name in state.get("model", {}) for name in info.get("experts", ()))


def _later_or_same(base, plain):
    """Was the set NAME saved no earlier than the single file NAME.pt?

    By the save times the manifests carry (the shared file's, or a rank file's when the shared file is
    missing); not by update numbers, which restart with --reset-optimizer or a fine-tuning run. Files
    that carry no save time (written before fairseq-moe recorded it) are compared by update number."""
    ia = None
    for path in set_files(base):
        try:
            state = read_file(path, mmap=True)
        except CheckpointError:
            continue
        ia = (state.get("moe_shard") or manifest_of(state)) if isinstance(state, dict) else None
        if isinstance(ia, dict) and ia:
            break
    if not ia:
        return True  # no readable file of the set: let loading it name what is wrong
    try:
        b = read_file(plain, mmap=True)
    except CheckpointError:
        return True  # a damaged single file cannot be the later save
    if not isinstance(b, dict):
        return True
    ib = manifest_of(b)
    if "saved_at" in ia and "saved_at" in ib:
        return ia["saved_at"] >= ib["saved_at"]
    with laid_out(plain):
        history = b.get("optimizer_history") or [{}]
        return ia.get("num_updates", 0) >= history[-1].get("num_updates", 0)


def new_save_id():
    return uuid.uuid4().hex


def manifest(num_updates, save_id, world_size, experts, optimizer_index, data_parallel_size):
    """experts: {parameter name: E}; optimizer_index: {parameter name: index in the optimizer state}."""
    return {"format": FORMAT, "num_updates": num_updates, "save_id": save_id, "world_size": world_size,
            "experts": dict(experts), "optimizer_index": dict(optimizer_index),
            "data_parallel_size": data_parallel_size, "saved_at": time.time()}


ZERO_KEY = "moe_zero"  # an optimizer state dict of --zero-sharding's ranks (optim.py): each rank's dense entries
EMA_PARTS = ("ema", "ema_fp32_params")  # extra_state entries of fairseq's --store-ema, keyed like the model
MADE_BY = "made_by"  # extra_state key of a checkpoint a tool wrote without optimizer state: what made it


def without_ema(extra_state):
    """extra_state without the EMA copy (for a checkpoint whose model is not the one the EMA followed, or that
    only generates)."""
    return {k: v for k, v in (extra_state or {}).items() if k not in EMA_PARTS}


def split(state, spread, rank, info):
    """Cut a fairseq checkpoint state of one rank into (shared state, this rank's shard).

    spread: {parameter name: (first expert, local experts)} of this rank's spread experts;
    info: the manifest (manifest()); its optimizer_index says where each expert's optimizer state sits.
    """
    model = dict(state["model"])
    shard = {"moe_shard": dict(info, rank=rank, slices={k: list(v) for k, v in spread.items()}),
             "model": {k: model.pop(k) for k in spread}, "optimizer": {}}
    extra = dict(state["extra_state"], moe_checkpoint=info)
    for part in EMA_PARTS:  # --store-ema: the EMA copy's experts go with the model's
        if extra.get(part) is not None:
            ema = dict(extra[part])
            shard[part] = {k: ema.pop(k) for k in spread if k in ema}
            extra[part] = ema
    shared = dict(state, model=model, extra_state=extra)
    opt = state.get("last_optimizer_state")
    if opt is not None:
        per_param = dict(opt["state"])
        for name, index in info["optimizer_index"].items():
            if index in per_param:
                shard["optimizer"][name] = per_param.pop(index)
        if ZERO_KEY in opt:  # --zero-sharding: this rank's share of the dense state stays in its own file
            shard["dense_optimizer"], per_param = per_param, {}
        shared["last_optimizer_state"] = dict(opt, state=per_param)
    return shared, shard


def read_set(base, shared=None):
    """(shared state, [rank shard of each rank]) after checking that every file belongs to one save.

    The shared file is read whole (what it holds is trained on, it must not stay backed by the file);
    the rank files are memory-mapped, so only the expert rows that are cut out are read.
    shared: the shared file's state when the caller has loaded it already.
    """
    with laid_out(f"the checkpoint set {base}-shared.pt + rank files"):
        shared_file = shared_path(base)
        if shared is None:
            shared = read_file(shared_file, what=f"the shared part of the expert-parallel checkpoint {base}.pt "
                               f"(found {len(glob.glob(glob.escape(base) + '-rank-*.pt'))} rank files)")
        info = shared.get("extra_state", {}).get("moe_checkpoint")
        if not info or "save_id" not in info:
            raise CheckpointError(f"{shared_file} has no expert-parallel manifest: not written by fairseq-moe")
        if info.get("format") != FORMAT:
            raise CheckpointError(f"{shared_file} is in checkpoint format {info.get('format')}; this fairseq-moe "
                                  f"reads format {FORMAT}")
        W = info["world_size"]
        shards = []
        for r in range(W):
            path = rank_path(base, r)
            shard = read_file(path, mmap=True, what=f"{shared_file} was written by {W} ranks and needs "
                              f"{base}-rank-0..{W - 1}.pt")
            mine = shard.get("moe_shard", {})
            for key in ("save_id", "num_updates", "world_size", "experts"):
                if mine.get(key) != info[key]:
                    raise CheckpointError(
                        f"{path} does not belong with {shared_file}: its {key} is {mine.get(key)!r}, the shared "
                        f"file's is {info[key]!r}. The files come from different saves (a save that did not "
                        f"finish?); resume from another checkpoint.")
            for name, (first, count) in mine["slices"].items():
                if (first, count) != local_experts(info["experts"][name], W, r):
                    raise CheckpointError(f"{path}: {name} holds experts {first}..{first + count - 1}, not what "
                                          f"rank {r} of {W} holds")
                for part in EMA_PARTS:  # an EMA copy's experts: all in the shared file (older sets) or per rank
                    ema = (shared.get("extra_state") or {}).get(part)
                    if isinstance(ema, dict) and name not in ema and (
                            name not in shard.get(part, {}) or shard[part][name].shape[0] != count):
                        raise CheckpointError(f"{path} lacks the {part} of its experts of {name} that "
                                              f"{shared_file} has for the other parameters")
            shards.append(shard)
        _check_dense_shares(shared, shards, base)
        return shared, shards


def _check_dense_shares(shared, shards, base):
    """A set of --zero-sharding: every rank file has its share of the dense optimizer state, no two the same
    parameter's."""
    opt = shared.get("last_optimizer_state")
    if not isinstance(opt, dict) or ZERO_KEY not in opt:
        return
    seen = {}
    for r, shard in enumerate(shards):
        share = shard.get("dense_optimizer")
        if not isinstance(share, dict):
            raise CheckpointError(f"{rank_path(base, r)} lacks its share of the optimizer state that "
                                  f"{shared_path(base)} says its ranks kept (--zero-sharding)")
        for index in share:
            if index in seen:
                raise CheckpointError(f"{rank_path(base, r)} and {rank_path(base, seen[index])} both hold the "
                                      f"optimizer state of parameter {index}: not one save's shares")
            seen[index] = r


def check_set(base):
    """read_set's checks with every file memory-mapped (cheap): raises naming the first file of the set
    NAME that is missing, empty, unreadable or from another save."""
    shared = shared_path(base)
    read_set(base, shared=read_file(shared, mmap=True) if os.path.exists(shared) else None)


def _cut(pieces, lo, hi):
    """Rows lo..hi-1 (experts) from pieces [(first expert, tensor [count, ...])] of one tensor."""
    parts = [t[max(lo, f) - f:min(hi, f + t.shape[0]) - f] for f, t in pieces if f < hi and f + t.shape[0] > lo]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _cut_optimizer_state(entries, lo, hi):
    """The optimizer state of experts lo..hi-1 from [(first, count, state dict of one shard)]."""
    out = {}
    first_entry = entries[0][2]
    for key, value in first_entry.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == entries[0][1]:
            out[key] = _cut([(f, e[key]) for f, _, e in entries], lo, hi)
        elif torch.is_tensor(value) and value.numel() > 1:
            # e.g. Adafactor's column statistics of a [E, f] bias, which mix the experts (fairseq's Adafactor
            # before fairseq-moe stepped each expert as its own parameter)
            raise ValueError(f"optimizer state {key!r} of shape {tuple(value.shape)} is not per expert: "
                             f"it cannot be cut into expert slices (resume it on one process first, or start the "
                             f"optimizer afresh with --reset-optimizer)")
        else:  # a scalar such as Adam's step: the same on every rank
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def assemble(base, want=None, shared=None):
    """The fairseq checkpoint state of a sharded set: the shared state with the experts put back.

    want: {parameter name: (lo, hi)} to take only experts lo..hi-1 of a tensor (a rank of a new world
    size), else all E. The optimizer state of the experts is cut the same way.
    shared: the shared file's state, when already loaded (see read_set).
    """
    with laid_out(f"the checkpoint set {base}-shared.pt + rank files"):
        shared, shards = read_set(base, shared)
        info = shared["extra_state"]["moe_checkpoint"]
        model = dict(shared["model"])
        extra = dict(shared["extra_state"])
        emas = {part: dict(extra[part]) for part in EMA_PARTS if extra.get(part) is not None}
        opt = shared.get("last_optimizer_state")
        per_param = dict(opt["state"]) if opt is not None else None
        for shard in shards if per_param is not None else ():  # (--zero-sharding: each rank's dense share,
            per_param.update({i: {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}  # copied out
                              for i, entry in shard.get("dense_optimizer", {}).items()})  # of the mapped file)
        for name, E in info["experts"].items():
            lo, hi = (want or {}).get(name, (0, E))
            owners = {}  # first expert -> shard (one replica of each slice)
            for shard in shards:
                owners.setdefault(shard["moe_shard"]["slices"][name][0], shard)
            model[name] = _cut([(f, s["model"][name]) for f, s in sorted(owners.items())], lo, hi)
            for part, ema in emas.items():
                if all(name in s.get(part, {}) for s in owners.values()):
                    ema[name] = _cut([(f, s[part][name]) for f, s in sorted(owners.items())], lo, hi)
            if per_param is not None and name in info["optimizer_index"]:
                entries = [(f, s["moe_shard"]["slices"][name][1], s["optimizer"][name])
                           for f, s in sorted(owners.items()) if name in s["optimizer"]]
                if entries:
                    per_param[info["optimizer_index"][name]] = _cut_optimizer_state(entries, lo, hi)
        state = dict(shared, model=model, extra_state=dict(extra, **emas))
        if opt is not None:
            state["last_optimizer_state"] = dict(opt, state=per_param)
        return state


def cut_for_rank(state, spread):
    """Slice a full-expert state (a consolidated file) down to this rank's experts, optimizer state too.

    spread: {parameter name: (first, count, E)}; tensors that already hold count experts are kept.
    """
    info = manifest_of(state)
    index = info.get("optimizer_index", {})
    opt = state.get("last_optimizer_state")
    model = dict(state["model"])
    extra = dict(state.get("extra_state") or {})
    emas = {part: dict(extra[part]) for part in EMA_PARTS if extra.get(part) is not None}
    per_param = dict(opt["state"]) if opt is not None else None
    for name, (first, count, E) in spread.items():
        for ema in emas.values():
            t = ema.get(name)
            if t is not None and t.shape[0] == E != count:
                ema[name] = t[first:first + count].clone()  # (a view would be saved with all of its storage)
        t = model.get(name)
        if t is not None and t.shape[0] == E != count:
            model[name] = t[first:first + count].clone()
            if per_param is not None and index.get(name) in per_param:
                per_param[index[name]] = _cut_optimizer_state([(0, E, per_param[index[name]])],
                                                              first, first + count)
    state = dict(state, model=model)
    if emas:
        state["extra_state"] = dict(extra, **emas)
    if opt is not None:
        state["last_optimizer_state"] = dict(opt, state=per_param)
    return state


def rescale_iterator(state, world_size, path):
    """Where the data iterator stands when a checkpoint of W ranks resumes on W' ranks.

    fairseq's iterator state counts the batches one rank has taken in this epoch (n); the W ranks took
    n * W of the epoch's batches, which W' ranks reach at n * W / W'.
    """
    info = manifest_of(state)
    old = info.get("data_parallel_size")
    itr = state.get("extra_state", {}).get("train_iterator")
    if not old or old == world_size or not itr or not itr.get("iterations_in_epoch"):
        return state
    n = itr["iterations_in_epoch"]
    if n * old % world_size:
        raise CheckpointError(
            f"{path}: written by {old} ranks after {n} batches each of epoch {itr['epoch']}; {world_size} "
            f"ranks cannot split those {n * old} batches evenly. Resume on a world size that divides "
            f"{n * old}, or start the epoch's data afresh with --reset-dataloader.")
    extra = dict(state["extra_state"], train_iterator=dict(itr, iterations_in_epoch=n * old // world_size))
    return dict(state, extra_state=extra)


def write(state, out, world_size, save=torch.save):
    """Write a full-expert state as a set of world_size ranks at out (NAME.pt), or one file when 1.

    Returns the paths written. The expert layout is the one expert_parallel() gives world_size ranks.
    """
    info = dict(state.get("extra_state", {}).get("moe_checkpoint") or {})
    experts = info.get("experts") or {}
    if not experts:
        raise ValueError(f"no expert-parallel manifest in the input of {out}: nothing to reshard")
    history = state.get("optimizer_history") or [{}]
    info.setdefault("num_updates", history[-1].get("num_updates", 0))  # a 1-process file has none
    info.update(format=FORMAT, save_id=new_save_id(), world_size=world_size)
    opt = state.get("last_optimizer_state")
    if isinstance(opt, dict) and ZERO_KEY in opt:  # (the whole dense state, in the shared file: any rank's share
        state = dict(state, last_optimizer_state={k: v for k, v in opt.items() if k != ZERO_KEY})  # loads from it)
    if world_size == 1:
        state = dict(state, extra_state=dict(state["extra_state"], moe_checkpoint=info))
        save(state, out)
        return [out]
    base = set_base(out)
    written = []
    for r in range(world_size):
        spread = {name: local_experts(E, world_size, r) for name, E in experts.items()}
        mine = cut_for_rank(state, {n: (f, c, experts[n]) for n, (f, c) in spread.items()})
        shared, shard = split(mine, spread, r, info)
        save(shard, rank_path(base, r))
        written.append(rank_path(base, r))
    save(shared, shared_path(base))
    return written + [shared_path(base)]
