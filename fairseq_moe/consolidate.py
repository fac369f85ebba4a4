"""Consolidate an expert-parallel set into one file with every expert (and their optimizer state: it
resumes on one process, and loads at any world size). Same as reshard with --world-size 1.

    python -m fairseq_moe.consolidate save/checkpoint_best.pt model.pt
"""
import sys

from . import reshard
from .checkpoints.command import PROG


def main(argv=None):
    return reshard.main(argv, prog=PROG.format("consolidate"), world_size=1)


if __name__ == "__main__":
    sys.exit(main())
