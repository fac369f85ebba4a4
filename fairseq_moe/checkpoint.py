"""Safe loading of fairseq checkpoints with torch.load(weights_only=True).

torch >= 2.6 loads with weights_only=True, which refuses any class it was not told about.
A fairseq 0.12 checkpoint pickles one such class, argparse.Namespace (its "args"). We allow exactly
the classes listed here, so fairseq-generate and --restore-file work while an arbitrary pickled
object is still refused. Never switch weights_only off instead.
"""
import argparse

import torch

SAFE_GLOBALS = [argparse.Namespace]


def register_safe_globals():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
