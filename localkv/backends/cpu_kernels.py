"""Compiled CPU kernels (numba): the matmuls of a few rows (decode steps), the forks' shared
prefix scores, and fused one-pass versions of prefill's memory-bound steps.

Why: with few activation rows (one token per sequence) a weight matmul reads the whole weight
matrix for very little arithmetic. OpenBLAS's gemm first copies ("packs") the weights, so a few
rows cost nearly as much as many; its gemv streams them, but once per row. `rowdot` reads each
weight row once for up to 8 activation rows, straight from the [out, in] layout the weights are
stored in (GGUF's own), on all threads.

Threads: numba's OpenMP layer starts a kernel in microseconds (its workers spin between kernels);
the sleeping "workqueue" layer takes a hundred times longer, which over ~200 kernels a step costs
more than it saves, so only "omp" is used. Spinning workers and OpenBLAS's own spinning workers
must not run at once on a small machine (a kernel start then waits for a time slice), so while
kernels run the model keeps BLAS on one thread (see CpuBackend.begin_forward), and
localkv/__init__ shortens OpenBLAS's spin after a call (OPENBLAS_THREAD_TIMEOUT).

LOCALKV_CPU_KERNELS=0 turns the kernels off (numpy/BLAS only); so does a missing numba or a
missing OpenMP runtime (libgomp). Compiled code is cached beside this file (numba's cache).
"""

import os
import sys
import threading
import time

import numpy as np

from localkv.errors import first_line

MAX_ROWS = 8  # forward passes of up to this many rows run their matmuls here (more: BLAS is as fast)

_state: dict = {}
_lock = threading.Lock()


def load(progress: bool = False) -> bool:
    """Import numba, pin its threading layer to OpenMP and compile (or load from cache) the
    kernels. True when the kernels can run; the reason they cannot is kept in `why_not()`. Safe
    to call again. With progress, a first compile (seconds; cached for later runs) is reported
    on stderr."""
    with _lock:
        if "ok" not in _state:
            t0 = time.perf_counter()
            _state["ok"], _state["why"] = _load()
            took = time.perf_counter() - t0
            if progress and _state["ok"] and took > 1.0:
                print(f"compiled the CPU decode kernels in {took:.1f}s (cached for later runs)", file=sys.stderr)
        return _state["ok"]


def active() -> bool:
    """The kernels loaded and can run."""
    return _state.get("ok", False)


def set_threads(threads: int):
    """Worker threads for kernels started from this thread (numba's setting is per thread)."""
    import numba

    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def why_not() -> str | None:
    return _state.get("why")


def _load() -> tuple[bool, str | None]:
    if os.environ.get("LOCALKV_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False, "LOCALKV_CPU_KERNELS=0"
    try:
        import numba
    except ImportError as e:
        return False, f"numba not installed ({e})"
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "omp"
    try:
        from localkv.backends import _cpu_kernels_impl as impl

        if not (_check_matmuls(impl) and _check_elementwise(impl)):
            return False, "kernel self-check failed"
        if numba.threading_layer() != "omp":
            return False, f"numba threading layer {numba.threading_layer()!r}, not 'omp'"
    except Exception as e:  # no OpenMP runtime, a numba/numpy mismatch, an unwritable cache...
        return False, f"numba kernels unavailable ({type(e).__name__}: {first_line(e)})"
    _state["impl"] = impl
    return True, None


def _check_matmuls(impl) -> bool:
    """Compile (or load) the matmul kernels now, not inside a timed step, for writable and
    read-only weights (the safetensors cache maps them read-only), and check their results."""
    x, w = np.ones((8, 4), np.float32), np.ones((3, 4), np.float32)
    w_ro = w.copy()
    w_ro.flags.writeable = False
    ok = True
    for rows, kernel in ((1, impl.rowdot_1), (4, impl.rowdot_4n), (8, impl.rowdot_4n)):
        for weights in (w, w_ro):
            out = np.empty((rows, 3), np.float32)
            kernel(x[:rows], weights, out)
            ok = ok and bool((out == 4.0).all())
    sc = np.empty((2, 8, 3), np.float32)
    impl.scores_8(np.ones((2, 8, 4), np.float32), np.ones((3, 8), np.float32), sc)
    return ok and bool((sc == 4.0).all())


def _check_elementwise(impl) -> bool:
    """Compile (or load) the element-wise kernels for the array kinds the model passes (a
    read-only norm weight, a strided qkv view) and check them against numpy."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    w.flags.writeable = False
    out = np.empty_like(x)
    impl.rmsnorm(x, w, 1e-5, out)
    ok = np.allclose(out, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * w, rtol=1e-4, atol=1e-5)
    qkv = rng.standard_normal((2, 3, 4), dtype=np.float32)
    cos, sin = np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)
    want = qkv.copy()
    impl.rope(qkv[:, :2], cos, sin)  # angle 0: unchanged
    s = np.zeros((1, 4, 3), np.float32)
    impl.causal_max(s, 2, 1)  # query 0 sees keys 0-1, query 1 keys 0-2
    return ok and np.array_equal(qkv, want) and bool(np.isneginf(s[0, [0, 2], 2]).all()) and not s[0, 1].any()


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the rows of x [T, D] times w, in one kernel (a new array). Call only when active()."""
    out = np.empty(x.shape, np.float32)
    _state["impl"].rmsnorm(x, w, eps, out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
    """RoPE in place on x [T, heads, hd] (NEOX halves). Call only when active()."""
    _state["impl"].rope(x, cos, sin)


def causal_max(s: np.ndarray, tq: int, first: int):
    """See _cpu_kernels_impl.causal_max. Call only when active()."""
    _state["impl"].causal_max(s, tq, first)


def rowdot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [R, in] @ w.T for w [out, in] C-contiguous float32: [R, out], reading w once. Two to
    three rows are padded with zero rows to 4 (and so on to a multiple of 4): 4 rows cost what 1
    does, the weights' memory traffic bounds them. Call only when active()."""
    impl = _state["impl"]
    R = len(x)
    if R == 1:
        out = np.empty((1, w.shape[0]), np.float32)
        impl.rowdot_1(np.ascontiguousarray(x, dtype=np.float32), w, out)
        return out
    xp = np.zeros((-(-R // 4) * 4, x.shape[1]), np.float32)
    xp[:R] = x
    out = np.empty((len(xp), w.shape[0]), np.float32)
    impl.rowdot_4n(xp, w, out)
    return out[:R]


def scores(q: np.ndarray, kf: np.ndarray) -> np.ndarray:
    """Attention scores [kvh, R, n] of q [kvh, R, hd] against the keys kf [n, kvh*hd] (tokens
    as rows, kv heads side by side: a contiguous run of pool blocks reshaped). Faster than
    OpenBLAS's batched gemm over the strided per-head views, whose packing of the transposed
    keys dominates. Call only when active()."""
    kvh, R, hd = q.shape
    R8 = -(-R // 8) * 8
    qp = np.zeros((kvh, R8, hd), np.float32)
    qp[:, :R] = q
    out = np.empty((kvh, R8, len(kf)), np.float32)
    _state["impl"].scores_8(qp, kf, out)
    return out[:, :R]
