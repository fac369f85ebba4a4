"""Consolidate an expert-parallel set into one file with every expert (and their optimizer state: it
resumes on one process, and loads at any world size). Same as reshard with --world-size 1.

    python -m fairseq_moe.consolidate save/checkpoint_best.pt model.pt
"""
import sys

from .reshard import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fairseq_moe.consolidate", world_size=1))
