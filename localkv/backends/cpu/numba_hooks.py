"""Every place localkv reaches into numba's or llvmlite's private parts, each kept for a
measurement in BENCHMARKS.md ("Engine start": the start's kernel loads); numba is bounded to the
versions tested (pyproject.toml), and each hook falls back to numba's own behaviour when the
private name it needs is missing.

- tables_deferred: loading kernels from numba's cache without loading its compiler tables
  (0.125 s of a start), and without numba's "llvm_lock" events (a third of each LLVM call);
- absent: modules numba imports and never uses for these kernels read as absent (scipy.linalg:
  about 0.2 s and 50 MB; numba's own scipy and yaml imports: 16 ms);
- NO_NRT: the kernels' inner functions compiled without numba's reference counting (a 9-row
  Q4_0 pass 1.80 -> 1.22 ms, 64 rows of Q8_0 8.03 -> 6.76 ms: "numba's private hooks"; a
  decode step's attention of 17 keys 27 -> 9 us, two thirds of it atomic counts: "Decode rows").

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

Within the same block numba's "llvm_lock" events are not sent: numba wraps each of the thousands
of LLVM calls a load makes in two of them (for its compile-time statistics, which a load from
the cache does not record), a good share of each call's cost.
"""

import contextlib
import os
import sys
import threading

_lock = threading.RLock()  # nested blocks restore in order


@contextlib.contextmanager
def tables_deferred():
    """Within this block, kernels found in numba's cache load without the refresh. Process-wide
    (numba's cache is); a numba without the methods this replaces loads as it always does."""
    try:
        from llvmlite.binding import ffi
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
        events = _llvm_lock_events()
        try:
            yield
        finally:
            Cache.load_overload = full
            for callbacks in events:
                ffi.register_lock_callback(*callbacks)


def _llvm_lock_events() -> list:
    """Take the callbacks off llvmlite's lock (numba's events) and return them, to register
    again; none when this llvmlite keeps them elsewhere."""
    from llvmlite.binding import ffi

    taken = list(getattr(getattr(ffi.lib, "_lock", None), "_cblist", ()))
    for callbacks in taken:
        ffi.unregister_lock_callback(*callbacks)
    return taken


# What numba imports at its own import and never uses for these kernels: scipy for a version
# check, yaml to read a .numba_config.yaml (imported when the working directory has one)
UNUSED_BY_NUMBA = ("scipy",) if os.path.exists(".numba_config.yaml") else ("scipy", "yaml")


@contextlib.contextmanager
def absent(*names: str):
    """Modules that read as absent while numba imports or loads the kernels, unless already
    imported: importing one (or a submodule) raises ImportError, which numba takes as "not
    installed". Afterwards they import normally.

    The first kernel numba loads makes it import its numpy registries, and with them
    scipy.linalg, to find a BLAS for np.dot and np.linalg in jitted code: no kernel here uses
    either, and the import costs a start time and memory (scipy.linalg and its own
    OpenBLAS); numba then marks its BLAS support off for this process. Numba's own import
    imports scipy (a version check) and yaml (for a config file)."""
    names = [n for n in names if n not in sys.modules]
    for name in names:
        sys.modules[name] = None  # importing it (or a submodule) raises ImportError
    try:
        yield
    finally:
        for name in names:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


# numba's private jit option `_nrt`: False compiles a function without its reference-counting
# runtime (NRT). The kernels' small per-super-block helpers (register_jitable, overloads) take
# array arguments; compiled with NRT, each call would count a reference to each array up and
# down, which the block-type kernels feel (the module's docstring has the figures).
NO_NRT = {"_nrt": False}
