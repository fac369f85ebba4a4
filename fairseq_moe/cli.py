"""fairseq's command-line tools with the plugin loaded: bad input is one line, not a traceback.

A FlagError or CheckpointError (errors.py) raised anywhere in fairseq-train, -generate, -interactive,
-eval-lm, -validate or -hydra-train prints `PROG: error: MESSAGE` on stderr, like argparse does for a
bad flag, once (rank 0; the other ranks, which meet the same error, stay silent), and exits with code 2.
Every other exception keeps its traceback: it is a bug to report, not bad input. (patches.py wraps
each tool's main, and fairseq's call_main, which sets up the ranks, with one_line_errors when fairseq
loads the plugin.)

Under `python -m fairseq_moe.launch` every rank parses the same command line: on ranks other than 0 an
argparse usage error (a bad flag value or choice) exits with code 2 silently, so the usage and the error
are printed once, by rank 0, and not once per rank (exit_quietly, patches.py).
"""
import functools
import os
import sys

import torch.distributed as dist

from .errors import CheckpointError, FlagError


def _rank():
    """This process's rank: the process group's, or before there is one the launcher's (RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def one_line_errors(main):
    @functools.wraps(main)  # main.__wrapped__: the tool's own main, for callers that want the exception
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (FlagError, CheckpointError) as e:
            if _rank() == 0:
                print(f"{os.path.basename(sys.argv[0]) or 'fairseq'}: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapped


def exit_quietly(parser, message):
    """ArgumentParser.error on a launched rank other than 0: rank 0 prints the same usage error."""
    parser.exit(2)
