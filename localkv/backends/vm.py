"""This process's memory: advice to the kernel (Linux madvise; best effort: elsewhere, or on a
kernel without the advice, each call does nothing and says so), large buffers reused rather
than mapped afresh, and Python's cyclic collector paused while a start allocates."""

import contextlib
import ctypes
import gc
import math
import mmap
import sys
import threading

import numpy as np

# glibc serves allocations below this from its heap (backends.tune_malloc sets it; 32 MiB is the
# most glibc takes), larger ones from a fresh mmap each time
MMAP_THRESHOLD = 32 << 20
KEPT = 4  # large buffers each thread keeps for reuse (reused_empty)
MADV_NOHUGEPAGE = 15  # <sys/mman.h>
MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux 5.14 on

_madvise = None


def madvise(start: int, end: int, advice: int) -> bool:
    """madvise over the whole pages inside [start, end). True when the kernel took it."""
    global _madvise
    if not sys.platform.startswith("linux"):
        return False
    if _madvise is None:
        try:
            _madvise = ctypes.CDLL(None).madvise
        except (OSError, AttributeError):
            return False
        _madvise.argtypes, _madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    page = mmap.PAGESIZE
    start, end = -(-start // page) * page, end // page * page
    return end > start and _madvise(start, end - start, advice) == 0


def prefault(spans: list[tuple[int, int]]) -> threading.Thread | None:
    """Map every page touching the [start, end) address spans, writable, on a thread of its
    own while the caller goes on: a fresh mapping takes a fault per 4 KiB page on its first
    write, and a warm start copying its blocks into a fresh pool spent half its load in them.
    madvise releases the GIL, so the caller keeps the interpreter (one call per span: a call per
    page would pass the GIL back and forth). The contents are untouched. The thread, to join;
    None where there is nothing to do."""
    if not spans or not sys.platform.startswith("linux"):
        return None
    page = mmap.PAGESIZE
    whole = [(start // page * page, -(-end // page) * page) for start, end in spans]

    def fill():
        for start, end in whole:
            if not madvise(start, end, MADV_POPULATE_WRITE):
                return  # an older kernel: the copies fault the pages in themselves

    t = threading.Thread(target=fill, name="localkv-prefault", daemon=True)
    t.start()
    return t


_kept = threading.local()


def reused_empty(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype), but at or past MMAP_THRESHOLD a buffer of the same size that this
    thread allocated before and that nothing references any more (no array or view of it) is
    handed out again. A fresh mmap is page-faulted in by whatever first writes it: a prefill
    matmul writing a new 32 MiB output ran far below OpenBLAS's speed on a reused one."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MMAP_THRESHOLD:
        return np.empty(shape, dtype)
    kept = _kept.__dict__.setdefault("buffers", [])
    for buf in kept:
        # every view of an array refers to its owner, the buffer: the list, this loop and the
        # call's argument are the only references of one nothing uses
        if buf.nbytes == nbytes and sys.getrefcount(buf) == 3:
            return buf.view(dtype).reshape(shape)
    buf = np.empty(nbytes, np.uint8)
    kept.insert(0, buf)
    del kept[KEPT:]
    return buf.view(dtype).reshape(shape)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off within the block (or as a decorator), as it was
    after. An engine start allocates hundreds of thousands of objects that live as long as the
    process (numba's kernels, the tokenizer's tables), and each collection the allocations
    trigger walks all of them again: a tenth of a start. Reference counting still frees what
    the block drops; a cycle it leaves waits for the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
