"""Advice to the kernel about this process's memory (Linux madvise), best effort: elsewhere, or
on a kernel without the advice, each call does nothing and says so."""

import ctypes
import mmap
import sys

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
