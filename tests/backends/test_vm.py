"""backends.vm: large buffers handed out again only once nothing refers to them; pages mapped
ahead of a loader."""

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from localkv.backends import vm

BIG = (vm.MMAP_THRESHOLD // 4 // 512, 512)  # float32: exactly the threshold


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_large_buffer_is_reused_once_nothing_refers_to_it():
    a = vm.reused_empty(BIG)
    first = _addr(a)
    b = vm.reused_empty(BIG)
    assert _addr(b) != first  # a is alive
    view = a.T[:10]  # a view keeps the buffer in use after the array itself is gone
    del a
    c = vm.reused_empty(BIG)
    assert _addr(c) not in (first, _addr(b))
    del view
    d = vm.reused_empty(BIG)
    assert _addr(d) == first and d.shape == BIG and d.dtype == np.float32
    d[:] = 1.0
    assert not np.shares_memory(d, b) and not np.shares_memory(d, c)


def test_small_or_other_sized_requests_are_plain_arrays():
    a = vm.reused_empty(BIG)
    addr = _addr(a)
    del a
    other = vm.reused_empty((BIG[0] + 1, BIG[1]))  # another size: a new buffer
    assert _addr(other) != addr
    small = vm.reused_empty((4, 4), np.float64)
    assert small.base is None and small.dtype == np.float64


def test_each_thread_keeps_its_own_buffers():
    import threading

    a = vm.reused_empty(BIG)
    addr = _addr(a)
    del a
    seen = []
    t = threading.Thread(target=lambda: seen.append(_addr(vm.reused_empty(BIG))))
    t.start()
    t.join()
    assert seen[0] != addr  # another thread's free buffer is not this one's to hand out


def _resident(start: int, end: int) -> np.ndarray:
    """Which pages of [start, end) (page-aligned) are in memory: mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    vec = np.zeros((end - start) // mmap.PAGESIZE, np.uint8)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, end - start, vec.ctypes.data) == 0, os.strerror(ctypes.get_errno())
    return vec & 1 == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_prefault_maps_the_pages_of_its_spans_and_writes_nothing():
    page = mmap.PAGESIZE
    probe = mmap.mmap(-1, page)
    at = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    if not vm.madvise(at, at + page, vm.MADV_POPULATE_WRITE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 on)")
    m = mmap.mmap(-1, 64 * page)  # anonymous: no page mapped until touched
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    m[5 * page + 7] = 9  # a page already there keeps its bytes
    spans = [(base + 3 * page + 100, base + 8 * page - 50), (base + 20 * page, base + 21 * page + 1)]
    assert not _resident(base, base + 64 * page)[20:22].any()
    t = vm.prefault(spans)
    t.join()
    held = _resident(base, base + 64 * page)
    want = np.zeros(64, bool)
    want[3:8] = want[20:22] = True
    assert (held == want).all(), "the pages the spans touch, no other"
    assert m[5 * page + 7] == 9 and bytes(m).count(0) == 64 * page - 1, "contents untouched"
    assert vm.prefault([]) is None
