"""fairseq_moe_kernels/host.py: a counts tensor is read from the device once, however many ops need its values."""
import pytest
import torch

from fairseq_moe_kernels import host

from tests.host_reads import counted


def test_sizes_reads_a_tensor_once():
    counts = torch.tensor([[3, 0], [2, 5]])
    with counted() as found:
        assert host.sizes(counts) == [3, 0, 2, 5]
        assert host.sizes(counts) == [3, 0, 2, 5]
    assert sum(found.values()) == 1, found


def test_read_takes_the_unknown_ones_in_one_read():
    a, b, c = torch.tensor([1, 2]), torch.tensor([3]), host.known(torch.tensor([4, 5, 6]), [4, 5, 6])
    with counted() as found:
        assert host.read(a, b, c) == ([1, 2], [3], [4, 5, 6])
        assert host.read(c, b, a) == ([4, 5, 6], [3], [1, 2])
    assert sum(found.values()) == 1, found
    with counted() as found:
        assert host.read(c) == ([4, 5, 6],)
    assert not found


def test_known_must_fit_its_tensor():
    with pytest.raises(ValueError, match="2 host sizes for 3 counts"):
        host.known(torch.zeros(3, dtype=torch.long), [1, 2])
    view = host.known(torch.zeros(4, dtype=torch.long), [0] * 4).view(2, 2)  # (another tensor: read afresh)
    with counted() as found:
        assert host.sizes(view) == [0, 0, 0, 0]
    assert sum(found.values()) == 1


def test_full_is_known_without_a_read():
    with counted() as found:
        counts = host.full(3, 7, "cpu")
        assert host.sizes(counts) == [7, 7, 7]
    assert torch.equal(counts, torch.tensor([7, 7, 7])) and counts.dtype == torch.long
    assert not found
