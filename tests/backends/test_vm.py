"""backends.vm: large buffers handed out again only once nothing refers to them."""

import ctypes
import mmap
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


def _mapping(addr: int) -> dict[str, int]:
    """smaps fields (kB) of the mapping that holds addr."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line[:1] in "0123456789abcdef":
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= addr < hi
        elif inside and line.split()[-1] == "kB":
            fields[line.split(":")[0]] = int(line.split()[1])
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")
def test_dropping_a_files_pages_unmaps_clean_ones_and_keeps_private_copies(tmp_path):
    """A read-only mapping's pages leave the process and read back from the file; a read-only
    mapping that holds a private copy (a library's relocated data) is left as it is."""
    path = tmp_path / "lib-under-test.so"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    clean = np.memmap(path, np.uint8, mode="r")
    assert int(clean.astype(np.int64).sum()) == 255 * 128 * 4096  # every page read
    with open(path, "r+b") as f:
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    private[0] = 77  # a private copy of the first page, then made read-only as ld.so does
    addr = ctypes.addressof(ctypes.c_char.from_buffer(private))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(addr, len(private), mmap.PROT_READ) == 0
    assert _mapping(clean.ctypes.data)["Rss"] == 1024 and _mapping(addr)["Anonymous"] > 0

    assert vm.drop_file_pages("/lib-under-test.so") == 1
    assert _mapping(clean.ctypes.data)["Rss"] == 0
    assert _mapping(addr)["Anonymous"] > 0 and private[0] == 77 and private[1] == 1
    assert clean[0] == 0 and clean[-1] == 255  # back from the page cache
