"""Shared fixtures. Tests use tiny shapes: one intra-op thread is faster and immune to a busy machine."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
