"""fairseq_moe_layer/malloc.py against glibc's own account of its blocks (mallinfo2), in a fresh interpreter:
the setting is the whole process's, so this test process keeps glibc's defaults."""
import os
import subprocess
import sys

import pytest

from fairseq_moe_layer import malloc

PROBE = """
import torch
from fairseq_moe_layer import malloc

def mapped_by(nbytes):  # -> bytes of blocks mapped apart while a tensor of nbytes lives
    before = malloc.info().hblkhd
    x = torch.empty(nbytes, dtype=torch.uint8)
    x.fill_(1)
    return malloc.info().hblkhd - before

big = 64 << 20  # over glibc's 32 MB, above which every block is mapped apart by default
print(mapped_by(big), malloc.keep_freed_memory(), mapped_by(big), mapped_by(4 * big), malloc.info().hblkhd,
      malloc.info().fordblks)
"""
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.skipif(malloc.info() is None, reason="not glibc (no mallinfo2)")
def test_after_keep_freed_memory_no_block_is_mapped_apart():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    default, took, kept, kept_larger, mapped_at_end, free_in_heap = out.stdout.split()
    assert int(default) >= 64 << 20  # glibc's default: the 64 MB tensor is a block of its own
    assert took == "True"
    assert int(kept) == 0 and int(kept_larger) == 0  # from the heap, and freed back to it (not to the kernel)
    assert int(mapped_at_end) < 64 << 20  # the first tensor's block went back to the kernel when freed
    # the 256 MB freed last stays in the heap as free space, not trimmed away (its free bytes: not keepcost, the top
    # chunk's, which is small when the heap could not grow in place and the block came from a region of its own)
    assert int(free_in_heap) >= 4 * (64 << 20)


def test_without_glibc_it_says_so(monkeypatch):
    monkeypatch.setattr(malloc, "_libc", lambda: None)  # (as on macOS)
    assert malloc.keep_freed_memory() is False and malloc.info() is None
