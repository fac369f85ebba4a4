"""The process's C allocator, for the CPU path at many experts (`--moe-keep-freed-memory`).

Why: a training step frees and allocates again the experts' weight gradients (fairseq's zero_grad sets every
.grad to None) and the optimizer's temporaries of the same shapes. With E experts these are E x d x f blocks
(512 MB at E = 128, d = 512, f = 2048, fp32), while glibc maps every block above 32 MB anew (mmap) and unmaps it
when freed: the kernel then zeroes fresh pages for each of them at every step. benchmarks/bench_layer.py measured
12 s of a 73 s run at E = 128 in the kernel, and the layer's ratio over its dense equivalent varying from 1.18
to 1.50 between runs; fairseq-train at E = 32 got 1.13x and 1.18x its tokens/s in two runs
(benchmarks/bench_fairseq_train.py).

keep_freed_memory() has glibc serve every block from its heaps and never trim the main heap's top back to the
kernel, as jemalloc and tcmalloc keep freed memory: freed pages are reused without the kernel (it still faults
in pages the first time the heap grows, and may still unmap whole heaps of other threads' arenas). The cost:
the process's resident memory does not shrink after a peak, and fragmentation can keep it above the peak in use.
Process-wide, for every later allocation of every thread; blocks allocated before it keep their own way. So
fairseq-train sets it when its Trainer is built (fairseq_moe/hooks/trainer.py), not where a model is built.
"""
import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.lru_cache(maxsize=None)
def _libc():
    """The C library this process runs on (its symbols, as dlopen(NULL) sees them), or None without mallopt."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory():
    """Set glibc's malloc, for this process, to map no block of its own (M_MMAP_MAX = 0) and to return no freed
    memory to the kernel (M_TRIM_THRESHOLD = -1, read as the largest size). -> True if the C library took both
    settings; False elsewhere (no mallopt, as on macOS, or one that takes neither, as musl's)."""
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (>= 2.33): ten size_t fields, in malloc.h's order."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def info():
    """glibc's mallinfo2() now, or None without it. hblkhd: bytes in blocks mapped one by one (none are made after
    keep_freed_memory()); uordblks: bytes handed out from the heaps."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()
