"""Shared fixtures. Tests use tiny shapes: one intra-op thread is faster and immune to a busy machine."""
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (fp32). It must be chosen
# before triton is first imported, so here, before any test module imports kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A rank that dies on a fatal signal (SIGABRT, SIGSEGV) prints every thread's Python stack (helpers.tail).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def free_port():
    """A TCP port on 127.0.0.1 free now, for a rendezvous of ranks: fairseq_moe.launch's (below the kernel's
    ephemeral range, so that no outgoing connection takes it before rank 0 listens). Every test takes its port
    from here."""
    from fairseq_moe.launch import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


# The files that take longest (minutes each on 2 cores: the per-file profile of 2026-12-02), longest first:
# pytest-xdist hands the files to its workers in collection order (scripts/test.sh passes --no-loadscope-reorder: by
# default it puts the files of many tests first, which left these few-test files for the end, one worker running alone
# for ten minutes). A file not listed runs after them, in collection order; a listed file that no longer exists (moved,
# renamed) stops the run, so that the list cannot go stale unseen.
LONGEST_FIRST = (
    "tests/fairseq_moe/hooks/test_trainer_save_faults.py",
    "tests/fairseq_moe/hooks/test_optim.py",
    "tests/fairseq_moe/hooks/test_spread.py",
    "tests/fairseq_moe/hooks/test_trainer_damaged_folders.py",
    "tests/fairseq_moe/hooks/test_fsdp.py",
    "tests/fairseq_moe/hooks/test_cli.py",
    "tests/fairseq_moe_kernels/test_triton_grouped_mlp.py",
    "tests/fairseq_moe/hooks/test_trainer_expert_parallel.py",
    "tests/fairseq_moe/models/test_moe_transformer_lm.py",
    "tests/fairseq_moe/test_selftest.py",
)


def pytest_collection_modifyitems(config, items):
    gone = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {', '.join(gone)}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # (a stable sort: the other files keep their order)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
