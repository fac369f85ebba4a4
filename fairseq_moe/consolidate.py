"""Consolidate an expert-parallel checkpoint set into one file with every expert.

    python -m fairseq_moe.consolidate save/checkpoint_best.pt model.pt

The file holds the optimizer state of all experts too, so it resumes training on one process, and it
loads at any world size (each rank takes its experts). Same as `python -m fairseq_moe.reshard IN OUT
--world-size 1`.
"""
import sys

from .reshard import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fairseq_moe.consolidate", world_size=1))
