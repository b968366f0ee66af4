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
MADV_DONTNEED = 4  # unmap the pages: a file's come back from the page cache, anonymous ones as zeros

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


def drop_file_pages(suffix: str) -> int:
    """Unmap the resident pages of every read-only mapping of a file whose path ends with suffix
    (a shared library whose code will not run again soon) from this process: they stay in the
    page cache, for this process if the code runs again and for the next process that loads the
    library. A mapping holding a private copy of a page (a library's relocated read-only data)
    is left alone: dropping that copy would bring the file's unrelocated bytes back. Returns how
    many mappings the kernel took the advice for."""
    tail = suffix.encode()
    try:
        with open("/proc/self/smaps", "rb") as f:  # bytes: a mapped file's name may not be UTF-8
            lines = f.read().splitlines()
    except OSError:
        return 0
    spans, span = [], None
    for line in lines:
        if line[:1] in b"0123456789abcdef":  # a mapping's first line; its fields start uppercase
            fields = line.split()
            read_only = len(fields) > 1 and b"w" not in fields[1]
            span = fields[0].decode() if read_only and line.rstrip().endswith(tail) else None
            if span is not None:
                spans.append(span)
        elif span is not None and line.startswith(b"Anonymous:") and int(line.split()[1]) > 0:
            spans.remove(span)
            span = None
    done = 0
    for span in spans:
        start, end = (int(x, 16) for x in span.split("-"))
        done += madvise(start, end, MADV_DONTNEED)
    return done


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
