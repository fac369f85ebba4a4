"""Bad input is one line, not a traceback: a FlagError or CheckpointError (errors.py) in a fairseq tool
prints `PROG: error: MESSAGE` once, on rank 0, and exits with 2, as argparse does (a SaveError the same
way, with exit code 1: the input was fine, the disk was not); any other exception
keeps its traceback (a bug to report). Under fairseq_moe.launch, ranks other than 0 exit silently on a
usage error (exit_quietly). patches.py installs both.
"""
import functools
import os
import sys

import torch.distributed as dist

from .compat import launcher_rank
from ..errors import CheckpointError, FlagError, SaveError
from ..checkpoints.new_files import one_line


def _rank():
    """This process's rank: the process group's, or before there is one the launcher's (RANK; an srun step's
    SLURM_PROCID)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launcher_rank()


def one_line_errors(main):
    @functools.wraps(main)  # main.__wrapped__: the tool's own main, for callers that want the exception
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (FlagError, CheckpointError, SaveError) as e:
            if _rank() == 0:
                print(f"{os.path.basename(sys.argv[0]) or 'fairseq'}: error: {one_line(e)}", file=sys.stderr, flush=True)
            else:
                _after_rank0()
            raise SystemExit(1 if isinstance(e, SaveError) else 2) from None

    return wrapped


def exit_quietly(parser, message):
    """ArgumentParser.error on a launched rank other than 0: rank 0 prints the same usage error."""
    _after_rank0()
    parser.exit(2)


RANK0_SECONDS = 2.0


def _after_rank0():
    """A silent rank's exit comes RANK0_SECONDS late: a launcher that stops the job when one rank ends (srun
    --kill-on-bad-exit, torchrun) would otherwise often stop rank 0 before it has printed the line."""
    import time

    time.sleep(RANK0_SECONDS)
