"""fairseq-moe: Mixture-of-Experts transformers as a fairseq plugin (`--user-dir fairseq_moe`).

The one door to fairseq is load_plugin(): it registers the models, criterions and tasks and installs
the table of patches.py. It runs when fairseq imports the plugin (--user-dir), i.e. when this package is
imported with fairseq loaded; a program that imports fairseq_moe first calls it itself. The layer
(fairseq_moe.moe) and the kernels, imported alone, change nothing of fairseq's or torch's.
"""
import sys


def load_plugin():
    """Register with fairseq and install patches.py's table (idempotent)."""
    from . import patches

    # Importing these modules registers them with fairseq.
    from .criterions import moe_cross_entropy  # noqa: F401
    from .models import moe_transformer, moe_transformer_lm  # noqa: F401
    from .tasks import moe_language_modeling, moe_translation  # noqa: F401

    patches.apply()


if sys.modules.get("fairseq") is not None:  # fairseq is loading us (--user-dir), or its program imported us
    load_plugin()
