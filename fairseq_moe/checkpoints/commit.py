"""A save of many ranks replaces the previous checkpoint sets as a whole, or changes nothing.

With the experts spread, one save writes NAME-shared.pt and NAME-rank-R.pt for each name it saves
(checkpoint_last, checkpoint_E_U, ...: sets.py), and retires the sets that fairseq's --keep-*
rules drop. Its steps on every rank, and what a kill -9 or a full disk at each one leaves:

1. write   each rank writes its files under staged names (NAME-rank-R.pt.SAVEID.staged) and flushes them
           to disk (fsync). Stopped here: the previous sets are untouched; recover() removes the staged files.
2. agree   every rank tells every other whether its files are on disk, and which sets fairseq retired on
           it (a gather). When one failed (a full disk), every rank removes its staged files and raises.
3. commit  rank 0 writes the journal moe-commit-SAVEID.json (whole, by a rename, flushed): the names to
           switch and the sets to retire. This is the commit point: from here on the save counts as made.
4. switch  rank 0 renames the staged files over the old ones, then deletes the retired sets and the
           journal. Stopped here: recover() (and, for its renames, any reader) redoes it from the journal.
5. done    rank 0 tells every rank how the switch went (a second gather).

recover() is called by rank 0 before a save and before a resume, when no rank writes; it alone deletes.
A shared file system is assumed (rank 0 renames every rank's files), as loading a set already does.
No fairseq import here: the collectives come in as a gather function (hooks/trainer.py gives torch's).
"""
import contextlib
import json
import logging
import os
import shutil

from . import sets as shards
from ..errors import SaveError
from .new_files import one_line, os_error_in, write_exclusive

logger = logging.getLogger(__name__)


def fsync_folder(folder):
    """Make the names created or removed in folder durable (where the file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fresh(path):
    """Remove whatever has the name path (a left-over, or a link: never written through)."""
    if os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def _named(path):
    """A failure to write the file path inside is an OSError naming it (torch's zip writer hides the OSError under
    a RuntimeError, and a write's own OSError has no file name)."""
    try:
        yield
    except Exception as e:
        io = os_error_in(e)
        if io is None or io.filename is not None:
            raise
        raise (OSError(io.errno, io.strerror or str(io), path) if io.errno is not None
               else OSError(f"{path}: {one_line(io)}")) from e


def write_synced(obj, path):
    """torch.save(obj) to the new file path, flushed to disk. A failure to write is an OSError naming path."""
    _fresh(path)
    with _named(path):
        write_exclusive(obj, path)


def copy_synced(src, dst):
    """src copied to the new file dst, flushed to disk. A failure to write is an OSError naming dst."""
    _fresh(dst)
    with open(src, "rb") as a, _named(dst):
        write_exclusive(a, dst, dump=lambda a, b: shutil.copyfileobj(a, b, 1 << 22))


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def remove_quietly(path):
    """Remove the file path if it is there; any failure (the disk that failed a write) is ignored."""
    with contextlib.suppress(OSError):
        os.remove(path)


def write_journal(folder, save_id, suffix, world_size, commit, retire):
    """Step 3: the commit point. commit, retire: set names (NAME, without the folder). Returns (path,
    journal)."""
    path = shards.journal_path(folder, save_id, suffix)
    journal = {"save_id": save_id, "world_size": world_size, "commit": sorted(commit), "retire": sorted(retire)}
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(journal, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_folder(folder)
    return path, journal


def switch(folder, journal, path, renamed_all=None, suffix=""):
    """Step 4, from the journal at path (every part can be redone): the staged files take their names,
    rank files beyond the save's world size go (a set of an earlier, larger run); once every committed file
    is in place (renamed here or by a reader; else SaveError, and the journal and the retired sets stay),
    renamed_all() when given, then the retired sets go, their staged files of this save too, and the
    journal. Returns the number of files renamed here."""
    W, renamed = journal["world_size"], 0
    for name in journal["commit"]:
        base = os.path.join(folder, name)
        for staged, final in shards.committed_files(base, journal):
            if os.path.lexists(staged):
                shards.keep_late_file(final, suffix)
            with contextlib.suppress(FileNotFoundError):
                os.replace(staged, final)
                renamed += 1
        for old in shards.set_files(base):
            rank = shards._SHARD.match(old).group("rank")
            if rank is not None and int(rank) >= W:
                shards.keep_late_file(old, suffix)
                _remove(old)
    fsync_folder(folder)
    for name in journal["commit"]:
        for staged, final in shards.committed_files(os.path.join(folder, name), journal):
            if os.path.lexists(staged) or not os.path.exists(final):
                raise SaveError(f"{final} is not in place after the switch of {os.path.basename(path)}")
    if renamed_all is not None:
        renamed_all()
    for name in journal["retire"]:
        base = os.path.join(folder, name)
        for staged, _ in shards.committed_files(base, journal):
            _remove(staged)
        for old in shards.set_files(base):
            _remove(old)
    fsync_folder(folder)
    _remove(path)
    fsync_folder(folder)
    return renamed


def recover(folder, suffix):
    """What a stopped save left in folder, for one run's names (shards.run_names): a committed save's switch
    is finished, an uncommitted one's staged files are removed, and so are fairseq's NAME.pt.tmp. A journal
    that is not provably this run's (shards.journal_problem) is left alone with one warning, and so are the
    staged files of its save id. Called when no rank writes (rank 0, before a save or a resume). Every action
    is one log line."""
    if not os.path.isdir(folder):
        return
    for path, journal in shards.journals(folder, suffix or ""):
        try:
            n = switch(folder, journal, path, suffix=suffix or "")
        except SaveError as e:  # (a file of the committed save went since: the resume falls back to another set)
            logger.warning(f"{e}: the journal and the sets it retires are left as they are")
            continue
        except OSError as e:  # (the folder cannot be changed: the next recovery tries again)
            logger.warning(f"{path}: its switch cannot be finished now ({error_line(e)}); left as it is")
            continue
        logger.info("finished the save %s committed before a stop: %d file(s) renamed, sets %s in place%s",
                    os.path.basename(path), n, ", ".join(journal["commit"]),
                    f", {', '.join(journal['retire'])} retired" if journal["retire"] else "")
    names, listing = shards.run_names(suffix), sorted(os.listdir(folder))
    journaled = {m.group("save_id") for m in map(shards.JOURNAL.match, listing) if m and not m.group("tmp")}
    for name in listing:
        m, journal = names.match(name), shards.JOURNAL.match(name)
        if journal and journal.group("suffix") == (suffix or "") and journal.group("tmp"):
            # a journal being written when the save stopped: nothing was committed
            _remove(os.path.join(folder, name))
            logger.info("removed %s, left by a save that did not commit", name)
        elif m and m.group("tmp") and not ((staged := shards.STAGED.match(name))
                                            and staged.group("save_id") in journaled):
            _remove(os.path.join(folder, name))
            logger.info("removed %s, left by a save that did not finish", name)


def set_aside(base, suffix=""):
    """Rename every file of the set NAME (base: with the folder and the run's --checkpoint-suffix) to
    NAME.damaged-ID: a name that none of the run's rules (shards.run_names) matches, so no save, --keep-* rule or
    recover() touches it, and that loads as a set by --restore-file. ID: the save id its files carry (so a move
    stopped half-way goes on under the same name), else a new one. Never over a file. Returns the new NAME."""
    files = shards.set_files(base)
    tag = next(filter(None, map(shards.saved_by, files)), None) or shards.new_save_id()
    aside = shards.aside_name(base, suffix, tag)
    for path in files:
        shards.rename_new(path, aside + path[len(base):])
    fsync_folder(os.path.dirname(base) or ".")
    return aside


class SetSave:
    """One save of the sets of a run whose experts are spread, on one rank (steps 1-5 above).

    gather(obj) -> [the obj of every rank, by rank], the same collective on every rank; save_id is the
    same on every rank (drawn on rank 0); suffix: the run's --checkpoint-suffix. on_step(name), when given,
    is called at each step ("writing", "written", "agreed", then on rank 0 "committed", "switched", and
    "done"): tests stop a rank there."""

    def __init__(self, folder, save_id, rank, world_size, gather, suffix="", on_step=None):
        self.folder, self.save_id, self.rank, self.world_size = folder, save_id, rank, world_size
        self.gather, self.suffix, self.on_step = gather, suffix or "", on_step
        self.staged, self.retired = [], set()  # the final paths this rank staged; set names retired here
        self.started = False

    def _step(self, name):
        if self.on_step is not None:
            self.on_step(name)

    def write(self, obj, final):
        """Step 1 for one file: obj staged for the name final."""
        self.staged.append(final)
        if not self.started:
            self.started = True
            self._step("writing")
        write_synced(obj, shards.staged_path(final, self.save_id))

    def copy(self, src, dst):
        """The staged file of src copied as the staged file of dst (fairseq's copies to more names)."""
        self.staged.append(dst)
        copy_synced(shards.staged_path(src, self.save_id), shards.staged_path(dst, self.save_id))

    def retire(self, path):
        """fairseq dropped path (one file of a set): the whole set goes, once the save is committed."""
        self.retired.add(os.path.basename(shards.set_base(path)))

    def listing(self, folder):
        """The names in folder as fairseq's --keep-* rules on this rank should count them, the same sets on
        every rank: each set that has its shared file, or that this save writes, as NAME-rank-R.pt of this
        rank (whether or not its file of this rank is there: sets of a smaller world lack it); other files
        as they are."""
        here, names = os.path.abspath(folder), set()
        finals = [os.path.basename(f) for f in self.staged if os.path.dirname(os.path.abspath(f)) == here]
        for name in os.listdir(folder) + finals:
            m = shards._SHARD.match(name)
            if m is None or (m.group(2) is None and not name.endswith("-shared.pt")):
                names.add(name)  # (not a set file; a single file NAME.pt)
            elif name.endswith("-shared.pt") or name in finals:
                names.add(f"{m.group('base')}-rank-{self.rank}.pt")
        return sorted(names)

    def has(self, path):
        """Whether path is one of listing()'s names (fairseq asks before it deletes)."""
        return os.path.basename(path) in self.listing(os.path.dirname(path) or ".")

    def _discard(self):
        for final in self.staged:
            _remove(shards.staged_path(final, self.save_id))

    def finish(self, error=None):
        """Steps 2-5. error: this rank's failure in step 1, if any. Raises SaveError on every rank when the
        save was not made (nothing of the previous sets changed then), or when its switch failed; on the rank
        that failed, an error that is no I/O error (a bug) is raised as it was, with its traceback."""
        self._step("written")
        for folder in {os.path.dirname(os.path.abspath(f)) for f in self.staged}:
            fsync_folder(folder)  # (the staged names too, before this rank says its files are on disk)
        names = sorted({os.path.basename(shards.set_base(f)) for f in self.staged})
        mine = {"error": None if error is None else error_line(error), "names": names,
                "retired": sorted(self.retired)}
        reports = self.gather(mine)
        self._step("agreed")
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if not failed and any(rep["names"] != reports[0]["names"] for rep in reports):
            failed = [(r, f"staged {rep['names']}, rank 0 {reports[0]['names']}")
                      for r, rep in enumerate(reports) if rep["names"] != reports[0]["names"]][:1]
        if failed:
            self._discard()
            if error is not None and not _io_error(error):
                raise error
            rank, why = failed[0]
            raise SaveError(f"the checkpoint save of {', '.join(names) or 'nothing'} in {self.folder} failed on rank "
                            f"{rank} of {self.world_size} ({why}); nothing was replaced: the previous checkpoints "
                            f"are as they were") from error
        outcome = None
        if self.rank == 0:
            outcome = self._commit_and_switch(reports)
        outcome = self.gather(outcome)[0]
        self._step("done")
        if outcome is not None:
            committed, why = outcome
            if not committed:
                self._discard()
            raise SaveError(f"the checkpoint save in {self.folder} " + (
                f"was committed but its switch failed on rank 0 ({why}); the next resume finishes it" if committed
                else f"could not be committed on rank 0 ({why}); nothing was replaced"))

    def _commit_and_switch(self, reports):
        """Steps 3 and 4 on rank 0: None, or (committed?, why) when something failed."""
        retire = set().union(*(rep["retired"] for rep in reports))
        commit = set(reports[0]["names"]) - retire  # (a name written and dropped in the same save goes)
        journal = {"save_id": self.save_id, "world_size": self.world_size, "commit": sorted(commit), "retire": []}
        missing = [staged for name in sorted(commit) for staged, _ in
                   shards.committed_files(os.path.join(self.folder, name), journal) if not os.path.exists(staged)]
        if missing:  # (every rank said its files are on disk; someone removed one since)
            return False, f"{missing[0]} is gone"
        if not commit:  # (only sets to retire: nothing to switch, and a journal must commit something)
            try:
                for name in sorted(retire):
                    base = os.path.join(self.folder, name)
                    for old in shards.set_files(base) + [staged for staged, _ in shards.committed_files(base, journal)]:
                        _remove(old)
            except Exception as e:
                return True, error_line(e)
            if retire:
                logger.info("retired the checkpoint sets %s (%d ranks)", ", ".join(sorted(retire)), self.world_size)
            return None
        try:  # (before the commit point: a late file that cannot be kept means nothing is replaced)
            for name in sorted(commit):
                for old in shards.set_files(os.path.join(self.folder, name)):
                    shards.keep_late_file(old, self.suffix)
        except OSError as e:
            return False, error_line(e)
        try:
            path, journal = write_journal(self.folder, self.save_id, self.suffix, self.world_size, commit, retire)
        except Exception as e:
            return False, error_line(e)
        self._step("committed")
        try:
            switch(self.folder, journal, path, renamed_all=lambda: self._step("switched"), suffix=self.suffix)
        except Exception as e:
            return True, error_line(e)
        logger.info("committed the checkpoint sets %s (%d ranks)%s", ", ".join(sorted(commit)), self.world_size,
                    f"; retired {', '.join(sorted(retire))}" if retire else "")
        return None


def _io_error(e):
    """An I/O failure (os_error_in), or torch's zip writer failing to write with no OSError to show."""
    return os_error_in(e) is not None or (isinstance(e, RuntimeError) and "write" in str(e).lower())


def error_line(e):
    """An exception as one line: its type and its message (new_files.one_line); for a failure to write, the
    OSError underneath (torch's own message says only "unexpected pos")."""
    e = os_error_in(e) or e
    return f"{type(e).__name__}: {one_line(e)}"
