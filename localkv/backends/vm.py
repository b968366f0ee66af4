"""This process's memory: advice to the kernel (Linux madvise; best effort: elsewhere, or on a
kernel without the advice, each call does nothing and says so), and large buffers reused
rather than mapped afresh."""

import ctypes
import mmap
import sys
import threading

import numpy as np

# glibc serves allocations below this from its heap (backends.tune_malloc sets it; 32 MiB is the
# most glibc takes), larger ones from a fresh mmap each time
MMAP_THRESHOLD = 32 << 20
KEPT = 4  # large buffers each thread keeps for reuse (reused_empty)
MADV_NOHUGEPAGE = 15  # <sys/mman.h>
MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages now (clean file pages are simply dropped)

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


def page_out_file(suffix: str) -> int:
    """Reclaim the resident pages of every mapping of a file whose path ends with suffix (a
    shared library whose code will not run again soon): they come back from the file if it
    does. Returns how many mappings the kernel paged out."""
    tail = suffix.encode()
    try:
        with open("/proc/self/maps", "rb") as f:  # bytes: a mapped file's name may not be UTF-8
            spans = [line.split()[0].decode() for line in f if line.rstrip().endswith(tail)]
    except OSError:
        return 0
    done = 0
    for span in spans:
        start, end = (int(x, 16) for x in span.split("-"))
        done += madvise(start, end, MADV_PAGEOUT)
    return done


_kept = threading.local()


def reused_empty(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype), but at or past MMAP_THRESHOLD a buffer of the same size that this
    thread allocated before and that nothing references any more (no array or view of it) is
    handed out again. A fresh mmap is page-faulted in by whatever first writes it: a prefill
    matmul writing a new 32 MiB output ran at half OpenBLAS's speed (189 against 375 GFLOPS)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
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
