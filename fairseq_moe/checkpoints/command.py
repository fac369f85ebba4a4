"""The kit every command of the package (`python -m fairseq_moe.NAME`, one file fairseq_moe/NAME.py each) is built
on: its name (PROG) and parser, one way to end (run), reading any checkpoint (read_any: a set whole or a file;
locate, config_file), a text file (read_text) or a data-bin's dictionaries (check_data), and the name of a new
checkpoint (new_checkpoint; new_files.write_new writes it). The commands are found by their files (a module at the
top of fairseq_moe/ with a main): there is no list of them to add a new one to.

PROG is how the user called the command, `python -m fairseq_moe.NAME`, the same name argparse's own usage
errors print. Bad input (a FlagError, CheckpointError or InputError, or an OSError of a file given: missing, a
folder, unreadable, an output name that is taken) is one line `PROG: error: MESSAGE` on stderr and exit code 2,
as argparse does; an output the disk could not take (a SaveError, a full disk, an I/O error while writing) is
one line too, with exit code 1: the input was fine; anything else keeps its traceback (a bug to report).
fairseq's own tools, with the plugin loaded, follow the same convention (cli.py). No fairseq import here
unless a command asks for the plugin, no torch import unless it reads a checkpoint.
"""
import argparse
import errno
import fnmatch
import os
import sys

from ..errors import CheckpointError, FlagError, MissingCheckpointError, SaveError
from .new_files import one_line, refuse_existing

PROG = "python -m fairseq_moe.{}"
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


class InputError(ValueError):
    """A file a command reads that is not what it should be (a statistics line, text that is not UTF-8): the
    message names the file (and the flag that gave it, where one did)."""


def parser(prog, doc, **kwargs):
    """The command's ArgumentParser: prog (PROG.format(NAME)), the description the module doc's first paragraph."""
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0], **kwargs)


def disk_failed(e):
    """Whether an OSError is the disk failing a write (full, over quota, an I/O error, a file-size limit), not bad
    input: new_files.Writer reports it as an OSError caused by the one the write met (under torch's RuntimeError)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS or isinstance(e, RuntimeError) and "write" in str(e).lower():
            return True  # (torch's own writer: "PytorchStreamWriter failed writing file ...")
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return False


def exit_code(e):
    """2 for bad input, 1 for a save the disk did not take, None for a bug (its traceback is kept)."""
    if isinstance(e, SaveError):
        return 1
    if isinstance(e, (FlagError, CheckpointError, InputError)):
        return 2
    if isinstance(e, OSError):
        return 1 if disk_failed(e) else 2
    return None


def run(prog, work, report=None, setup=None):
    """A command's main after parsing: setup(), then work(); returns the exit code. Bad input and failed
    saves are one `PROG: error:` line (exit_code), else report(work's result) is printed and the code is 0."""
    try:
        if setup is not None:
            setup()
        result = work()
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return code
    text = report(result) if report is not None else None
    if text:
        print(text)
    return 0


def safe_globals():
    """setup of a command that reads checkpoints: the globals weights_only loading accepts."""
    from .safe_load import register_safe_globals

    register_safe_globals()


def locate(path):
    """("set", NAME) or ("file", path) of a checkpoint given to a command (sets.locate), or a
    MissingCheckpointError naming it."""
    from . import sets as shards  # (here: plot imports no torch)

    found = shards.locate(str(path))
    if found is None:
        also = f" (nor the set {shards.set_base(str(path))}-shared.pt)" if str(path).endswith(".pt") else ""
        raise MissingCheckpointError(f"{path}: no such checkpoint{also}")
    return found


def config_file(path):
    """The file of a checkpoint given to a command that holds its config: the file, or the set's shared file."""
    from . import sets as shards

    kind, found = locate(path)
    return shards.shared_path(found) if kind == "set" else found


def read_any(path):
    """The full state (every expert: a dict with a model) of a set or of a single consolidated file. Files are read with
    torch.load(weights_only=True) only; whatever is not a readable checkpoint is an error naming a file."""
    from . import sets as shards  # (here: plot imports no torch)

    kind, found = locate(path)
    if kind == "set":
        return shards.assemble(found)  # structure errors are named (sets.laid_out)
    state = shards.read_file(found, what="the checkpoint")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        what = "no model state" if isinstance(state, dict) else f"it holds a {type(state).__name__}, not a dict"
        raise CheckpointError(f"{found}: not a fairseq checkpoint ({what})")
    return state


def read_text(path, flag):
    """The lines of a text file given by flag, read as fairseq-interactive reads its input (UTF-8, strict):
    a folder, a missing file or bytes that are not UTF-8 are one InputError naming the flag and the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except IsADirectoryError:
        raise InputError(f"{flag} {path} is a folder, not a text file") from None
    except FileNotFoundError:
        raise InputError(f"{flag} {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{flag} {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}; "
                         f"fairseq-interactive reads UTF-8 too): convert it, e.g. iconv -f latin1 -t utf-8") from None


def new_checkpoint(out, flag="OUT"):
    """Refuse a checkpoint name to write one file at that is not NAME.pt, or is taken: by a file (a link too) or
    by the set NAME (NAME-shared.pt, which a reader of NAME.pt would weigh against the file). Nothing is written."""
    if not str(out).endswith(".pt"):
        raise FlagError(f"{flag} {out}: name the checkpoint NAME.pt")
    from . import sets as shards

    refuse_existing([str(out), shards.shared_path(shards.set_base(str(out)))], out=flag)


def infer_language_pair(folder):
    """(source, target) as fairseq's data_utils.infer_language_pair finds them in a data-bin (the first file
    named SPLIT.SRC-TGT.*), or (None, None)."""
    for name in os.listdir(folder):
        parts = name.split(".")
        if len(parts) >= 3 and len(parts[1].split("-")) == 2:
            return parts[1].split("-")
    return None, None


def language_pair(cfg, data):
    """(source, target) of a bilingual translation task's settings cfg: as saved, or where the checkpoint saved
    none, as fairseq infers them from DATA (its train.SRC-TGT.* files), or one line saying it cannot."""
    langs = (cfg.get("source_lang"), cfg.get("target_lang"))
    if None in langs:
        langs = infer_language_pair(str(data).split(os.pathsep)[0])
    if None in langs:
        raise FlagError(f"--data {data}: the checkpoint saved no language pair and fairseq infers it from the "
                        f"data-bin's train.SRC-TGT.* files; there are none: give the data-bin it was trained on")
    return langs


def check_data(state, path, data):
    """--data holds the dictionaries the task of the checkpoint (state, read from path) reads (dict.SRC.txt and
    dict.TGT.txt for translation, dict.txt for a language model), or one line says what is missing."""
    from .state import task_config

    if not os.path.isdir(data):
        what = "a file, not a folder" if os.path.exists(data) else "no such folder"
        raise FlagError(f"--data {data}: {what} (the data-bin the checkpoint was trained on)")
    cfg = task_config(state, path)
    if not cfg:
        return  # (nothing to tell the task by: fairseq's own error, if any)
    dictionaries = fnmatch.filter(os.listdir(data), "dict.*.txt")
    pair_saved = None not in (cfg.get("source_lang"), cfg.get("target_lang"))
    if "source_lang" in cfg and (cfg.get("lang_pairs") or not pair_saved) and \
            len(dictionaries) < 2:  # multilingual, or a pair to infer from the dictionaries
        missing, kind = ["dict.SRC.txt and dict.TGT.txt"], "a translation task"
    elif "source_lang" in cfg and not cfg.get("lang_pairs"):  # bilingual translation
        langs = language_pair(cfg, data)
        missing = [f"dict.{lang}.txt" for lang in langs if not os.path.isfile(os.path.join(data, f"dict.{lang}.txt"))]
        kind = f"a translation task ({'-'.join(langs)})"
    elif "source_lang" in cfg:
        missing = []
    else:
        missing, kind = [] if os.path.isfile(os.path.join(data, "dict.txt")) else ["dict.txt"], "a language model"
    if missing:
        raise FlagError(f"--data {data} has no {missing[0]}: the checkpoint is of {kind}; give the data-bin "
                        f"it was trained on")
