"""Fixes for the fairseq 0.12 releases this plugin supports (patches.py installs them when fairseq
loads the plugin; they apply to dense models run with the plugin too: see the README).

1. Dropped last batch (keep_last_batch, below). 2. Multi-rank resume under torch >= 2.6
(broadcast_with_omegaconf). 3. NumPy 2 (NUMPY_1): language modelling and bucketed translation data.

fairseq 0.12's data_utils.batch_by_size drops the last batch whenever its size is not a multiple of
--required-batch-size-multiple (default 8): fairseq-generate then silently skips the longest test
sentences (the score is computed on the rest) and training never sees the longest examples.
We keep that batch, as fairseq did before 0.12; batches stay within --max-tokens/--batch-size.
"""

import types

import numpy as np
import torch


def keep_last_batch(batch_by_size):
    def wrapped(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                required_batch_size_multiple=1, fixed_shapes=None):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = batch_by_size(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                                required_batch_size_multiple, fixed_shapes)
        covered = sum(len(b) for b in batches)
        if fixed_shapes is None and covered < len(indices):
            # The batches are consecutive slices of indices: what was dropped is the tail.
            batches = list(batches) + [indices[covered:]]
        return batches

    return wrapped


def _broadcast_globals():
    """What fairseq pickles when it broadcasts a loaded checkpoint from rank 0 to the others."""
    import collections
    import typing

    from fairseq.distributed import utils as distributed_utils

    import omegaconf
    from omegaconf import nodes
    from omegaconf.base import ContainerMetadata, Metadata

    node_types = [getattr(nodes, n) for n in ("AnyNode", "StringNode", "IntegerNode", "FloatNode",
                                             "BooleanNode", "EnumNode", "PathNode") if hasattr(nodes, n)]
    return [omegaconf.DictConfig, omegaconf.ListConfig, ContainerMetadata, Metadata, typing.Any,
            collections.defaultdict, distributed_utils._TensorPlaceholder, *node_types,
            dict, list, int, float, str, bool]  # builtins that OmegaConf's pickles name


def broadcast_with_omegaconf(broadcast_object_slow):
    """fairseq's resume on several ranks: rank 0 reads the checkpoint (weights_only=True) and
    broadcasts the state, in which fairseq has turned the config into an OmegaConf object; the other
    ranks unpickle it with torch.load, whose weights_only default (torch >= 2.6) refuses OmegaConf
    and fails every multi-rank resume. Allow exactly those config classes for this in-job transfer;
    checkpoint files stay loaded with the narrow list of checkpoint.py."""

    allowed = _broadcast_globals()

    def wrapped(obj, src_rank, group, dist_device):
        with torch.serialization.safe_globals(allowed):
            return broadcast_object_slow(obj, src_rank, group, dist_device)

    return wrapped


def _numpy_1_view():
    """numpy as fairseq 0.12 expects it, for its data modules only; numpy itself is left as it is.
    NumPy 2 removed np.compat.long (the builtin int), used by TokenBlockDataset (every --task
    language_modeling run with --sample-break-mode eos) and LanguagePairDataset (--num-batch-buckets),
    and percentile's `interpolation=` (now `method=`), used by data_utils.get_buckets (the same flag)."""
    view = types.ModuleType("numpy")
    view.__getattr__ = lambda name: getattr(np, name)
    view.compat = types.SimpleNamespace(long=int)

    def percentile(a, q, *args, interpolation=None, **kwargs):
        if interpolation is not None:
            kwargs["method"] = interpolation
        return np.percentile(a, q, *args, **kwargs)

    view.percentile = percentile
    return view


NUMPY_1 = _numpy_1_view()
