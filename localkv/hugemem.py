"""Large zeroed arrays backed by transparent huge pages where the OS offers them.

The KV pool is written block by block as sequences grow, and every first write to a
fresh 4 KiB page costs a page fault that zero-fills it. On the VMs we measure on that
is about 8 µs a page (under 0.5 GB/s): filling the pool for one 2,000-token prompt took
longer than the arithmetic. Anonymous memory aligned to 2 MiB and marked MADV_HUGEPAGE
faults a 2 MiB page at a time instead (about 10 GB/s here). The memory is still mapped
lazily, so a large pool costs RAM only as it fills, and the OS may ignore the advice
(THP off): then this is the same as np.zeros.
"""

import mmap

import numpy as np

HUGE = 2 << 20


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), 2 MiB aligned in anonymous memory advised for huge pages."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or nbytes < HUGE:
        return np.zeros(shape, dtype)
    try:
        raw = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return np.zeros(shape, dtype)
    buf = np.frombuffer(raw, np.uint8)  # keeps the mapping alive as long as any view of it
    off = (-buf.ctypes.data) % HUGE
    try:
        raw.madvise(advise, off, nbytes)
    except OSError:
        pass  # THP unavailable: ordinary pages, still lazily zeroed
    return buf[off:off + nbytes].view(dtype).reshape(shape)
