"""fairseq-moe: Mixture-of-Experts transformers as a fairseq plugin (`--user-dir fairseq_moe`).

The one door to fairseq is load_plugin(): it registers the models, criterions and tasks and installs
the table of patches.py. It runs when fairseq imports the plugin (--user-dir), when this package is
imported with fairseq loaded, and, for a program that imports fairseq_moe first, as soon as fairseq
itself has been imported (the order of the two imports does not matter). The layer (fairseq_moe_layer,
a package of its own) and the kernels, imported alone, change nothing of fairseq's or torch's.
"""
import importlib.abc
import importlib.util
import sys


_loading = []  # non-empty while load_plugin runs (its imports import fairseq: the finder below calls it again)


def load_plugin():
    """Register with fairseq and install patches.py's table (idempotent)."""
    if _loading:
        return
    _loading.append(True)
    try:
        from . import patches

        # Importing these modules registers them with fairseq.
        from .criterions import distillation, moe_cross_entropy  # noqa: F401
        from .models import moe_mixtral_lm, moe_transformer, moe_transformer_lm  # noqa: F401
        from .tasks import moe_language_modeling, moe_translation, moe_translation_multi_simple_epoch  # noqa: F401

        patches.apply()
    finally:
        _loading.clear()


def with_fairseq():
    """The setup of a command that builds models (inspect, prune): fairseq imported, the plugin registered."""
    import fairseq  # noqa: F401  (imported first: its import then runs load_plugin, through the finder below)

    load_plugin()


class _AfterFairseq(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """On sys.meta_path until fairseq is imported: fairseq's own loader runs, then load_plugin()."""

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq":
            return None
        sys.meta_path.remove(self)  # once, and so that the real finder answers now
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # (fairseq's own, for its resources)
        self.loader.exec_module(module)
        load_plugin()


if sys.modules.get("fairseq") is not None:  # fairseq is loading us (--user-dir), or its program imported us
    load_plugin()
elif not any(isinstance(f, _AfterFairseq) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterFairseq())
