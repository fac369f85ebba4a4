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


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
