"""Fixes for the fairseq 0.12 releases this plugin supports, applied when the plugin is imported.

fairseq 0.12's data_utils.batch_by_size drops the last batch whenever its size is not a multiple of
--required-batch-size-multiple (default 8): fairseq-generate then silently skips the longest test
sentences (the score is computed on the rest) and training never sees the longest examples.
We keep that batch, as fairseq did before 0.12; batches stay within --max-tokens/--batch-size.
"""

import numpy as np
from fairseq.data import data_utils



def _keep_last_batch(batch_by_size):
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

    wrapped.keeps_last_batch = True
    return wrapped


def apply():
    if not getattr(data_utils.batch_by_size, "keeps_last_batch", False):
        data_utils.batch_by_size = _keep_last_batch(data_utils.batch_by_size)
