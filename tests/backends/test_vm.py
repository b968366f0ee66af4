"""backends.vm: large buffers handed out again only once nothing refers to them."""

import numpy as np

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
