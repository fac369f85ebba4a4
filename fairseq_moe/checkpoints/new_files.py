"""Tools write new files only: each output whole or not at all, never over a file or through a link that is
there, and a command that fails takes back what it wrote (write_new: every command that writes a file).
No torch import unless a checkpoint is written.
"""
import contextlib
import os
import re
import shutil
import tempfile


def one_line(e):
    """An error as one line (an OSError as FILE: REASON)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    else:
        msg = str(e)
    return re.sub(r"\s*[\r\n]+\s*", " ", msg).strip()


def os_error_in(e):
    """The OSError e is, or that torch's zip writer met while it wrote (a full disk, a file-size limit: torch
    raises RuntimeError "unexpected pos" with the OSError only in __context__); else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


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


def write_exclusive(obj, path, dump=None):
    """Write obj as the new file path (created here: never a file or link that is there), flushed to disk:
    dump(obj, binary file), torch.save by default. Returns its os.stat."""
    with open(path, "xb") as f:
        if dump is None:
            import torch

            torch.save(obj, f)
        else:
            dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
        return os.fstat(f.fileno())


class Writer:
    """Writes each output whole (in a fresh private folder beside it, then linked to its name), never over
    anything, and can take back what it published."""

    staging = None  # the private folder, made at the first save: new, so nothing in it is a link

    def __init__(self):
        self.published = []  # (path, (st_dev, st_ino)) of the files this command created

    def save(self, obj, path, dump=None):
        """Write obj as the new file path: dump(obj, binary file), torch.save by default."""
        try:
            if self.staging is None:
                self.staging = tempfile.mkdtemp(prefix=".new-", dir=os.path.dirname(os.path.abspath(path)))
            tmp = os.path.join(self.staging, os.path.basename(path))
            st = write_exclusive(obj, tmp, dump)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as RuntimeError
            cause = os_error_in(e)
            if cause is None and not (isinstance(e, RuntimeError) and "write" in str(e).lower()):
                raise  # (a bug: its traceback is kept)
            cause = cause or e
            raise OSError(f"{path}: cannot write it ({type(cause).__name__}: {one_line(cause)})") from e
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


def refuse_existing(paths, out="OUT"):
    """Raise FileExistsError for the first of paths that exists (a dangling link too): nothing is overwritten.
    out: the argument that chose the paths, for the message."""
    existing = [p for p in paths if os.path.lexists(p)]
    if existing:
        what = " (a symbolic link)" if os.path.islink(existing[0]) else ""
        raise FileExistsError(f"{existing[0]} exists{what}; choose another {out} (nothing is overwritten)")


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
            # (the same kind of error where it takes a message alone: a FlagError too; else the nearest that does)
            kind = next(k for k in (type(e), FileExistsError, OSError, ValueError) if isinstance(e, k) and (
                k.__init__ is ValueError.__init__ or k in (OSError, FileExistsError, ValueError)))
            raise kind(f"{one_line(e)}; removed the {len(removed)} file(s) this command had written "
                       f"({', '.join(removed)})") from e
        raise
    finally:
        writer.close()
