"""The two kinds of bad input the plugin refuses by name (no fairseq import here). Both are ValueErrors;
fairseq's command-line tools, with the plugin loaded, print either as one line and exit with 2 (cli.py).
A save that could not be made (a full disk) is a SaveError: one line too, exit code 1.
"""


class FlagError(ValueError):
    """A flag, or a combination of flags, that cannot work: the message names the flags."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: the message names the file and what is wrong."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint file that should be there is not: the message names it."""


class SaveError(RuntimeError):
    """A checkpoint save that was not made (or not finished): the message names the rank, the cause, and
    what is on disk now."""
