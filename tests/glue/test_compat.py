"""compat.py's fixes. fairseq 0.12 drops the last batch when its size is not a multiple of
--required-batch-size-multiple; the plugin keeps it, so that generation translates every sentence and
training sees every example. Its data modules call NumPy 1 functions that NumPy 2 removed."""
import numpy as np
import pytest
from fairseq.data import data_utils

import fairseq_moe  # noqa: F401  (the plugin, loaded by conftest.py, installs the fixes)


@pytest.mark.parametrize("use_vec", [False, True])
@pytest.mark.parametrize("n, max_sentences, max_tokens, mult", [(20, 8, None, 8), (37, None, 60, 8), (5, 8, None, 8), (16, 8, None, 8)])
def test_every_index_batched_once(use_vec, n, max_sentences, max_tokens, mult):
    lengths = np.random.RandomState(n).randint(1, 6, size=n).astype(np.int64)
    indices = np.argsort(lengths, kind="stable").astype(np.int64)
    batches = data_utils.batch_by_size(
        indices, lambda i: lengths[i], num_tokens_vec=lengths[indices] if use_vec else None,
        max_tokens=max_tokens, max_sentences=max_sentences, required_batch_size_multiple=mult,
    )
    assert np.array_equal(np.concatenate(batches), indices)
    for b in batches:
        assert max_sentences is None or len(b) <= max_sentences
        assert max_tokens is None or len(b) * lengths[b].max() <= max_tokens


def test_numpy_2_datasets():
    """fairseq's eos-block LM dataset and bucketed pair dataset use NumPy 1 calls gone in NumPy 2."""
    import torch
    from fairseq.data import Dictionary, LanguagePairDataset, TokenBlockDataset

    sentences = [torch.tensor([4, 5, 2]), torch.tensor([6, 2]), torch.tensor([7, 8, 9, 2])]
    blocks = TokenBlockDataset(sentences, [3, 2, 4], block_size=None, pad=1, eos=2, break_mode="eos")
    assert [blocks[i].tolist() for i in range(3)] == [s.tolist() for s in sentences]
    d = Dictionary()
    sizes = np.array([3, 2, 4])
    pairs = LanguagePairDataset(sentences, sizes, d, sentences, sizes, d, num_buckets=2)
    assert pairs.buckets is not None and len(pairs) == 3
    assert "compat" not in vars(np) or np.__version__ < "2"  # numpy itself is left as it was


LEAVE = """
import atexit, sys
from fairseq_moe.compat import leave_together
atexit.register(lambda: print("atexit ran", flush=True))
def main(code):
    print("trained", end="")  # (not flushed yet)
    if code == 3:
        raise RuntimeError("a bug")
    if code:
        raise SystemExit(code)
leave_together(main)(int(sys.argv[1]))
print("after the run")
"""


@pytest.mark.parametrize("code", [0, 1, 2, 3])
@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_leaves_with_its_exit_code_and_output(code, launched):
    """A launched rank leaves right after distributed_main (no interpreter teardown, where gloo ranks can
    abort) with the run's exit code (1 and the traceback for an exception, here code 3), its output flushed
    and its atexit handlers run; elsewhere the program goes on (or exits) as without the plugin."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK",
                                                             "SLURM_PROCID")}
    if launched:
        env["FAIRSEQ_MOE_LAUNCH_RANK"] = "0"
    out = subprocess.run([sys.executable, "-c", LEAVE, str(code)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == (1 if code == 3 else code), out.stderr[-2000:]
    assert out.stdout.startswith("trained") and "atexit ran" in out.stdout, out.stdout
    assert ("RuntimeError: a bug" in out.stderr) == (code == 3), out.stderr[-2000:]
    assert ("after the run" in out.stdout) == (not launched and code == 0), out.stdout
