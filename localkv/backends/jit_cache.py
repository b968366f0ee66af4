"""Loading kernels from numba's cache without loading numba's compiler tables.

Each load from numba's cache first "refreshes" its CPU target: it imports numba's whole library
of typing and lowering implementations (numpy, dicts, strings, random, ...) and installs them in
its tables, about as long as loading every kernel of a start. A cached kernel does not need
them: it is machine code, linked against numba's runtime (NRT, which is still initialised here)
and its C helpers and threading layer, which register themselves when they are imported. The
tables serve only to type and lower Python code, so a kernel that misses the cache and compiles
is unaffected: the compiler refreshes the target itself, as it always does.

The one thing a cached kernel could link that the tables provide is Python's hash secret (used
by jitted dicts, sets and string hashing); the kernels here use none of those, and each load is
followed by the kernel's self-check against numpy.
"""

import contextlib
import threading

_lock = threading.RLock()  # nested blocks (quant.load loads cpu_kernels first) restore in order


@contextlib.contextmanager
def tables_deferred():
    """Within this block, kernels found in numba's cache load without the refresh. Process-wide
    (numba's cache is); a numba without the methods this replaces loads as it always does."""
    try:
        from numba.core.caching import Cache
        from numba.core.runtime import rtsys
    except ImportError:
        yield
        return
    if not all(hasattr(Cache, a) for a in ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")):
        yield
        return

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)  # the runtime a cached kernel links against; idempotent
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
        return None  # the guard swallowed an I/O error: a miss, as numba's own method reports it

    with _lock:
        full = Cache.__dict__["load_overload"]
        Cache.load_overload = load_overload
        try:
            yield
        finally:
            Cache.load_overload = full
