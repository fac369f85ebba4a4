"""The glue tests' fixtures (the toy corpora, a trained checkpoint), shared with the red-team tables."""
from ..glue.conftest import data_bin, lm_data_bin, ml_data_bin, trained_checkpoint  # noqa: F401 (fixtures)
