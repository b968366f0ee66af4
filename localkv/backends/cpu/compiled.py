"""Compiled CPU kernels (numba): the forks' shared prefix scores and fused one-pass versions of
prefill's memory-bound steps. The weight matmuls' kernels are in backends/quant, loaded after
these (quant.load needs this module's switch and threading layer).

Why: with few activation rows (one token per sequence) a matmul reads a whole weight matrix for
very little arithmetic. OpenBLAS's gemm first copies ("packs") the weights, so a few rows cost
nearly as much as many; the kernels read each weight row once for several activation rows, on
all threads.

Threads: numba's OpenMP layer starts a kernel in microseconds (its workers spin between kernels);
the sleeping "workqueue" layer takes a hundred times longer, which over ~200 kernels a step costs
more than it saves, so only "omp" is used. Spinning workers and OpenBLAS's own spinning workers
must not run at once on a small machine (a kernel start then waits for a time slice), so while
kernels run the model keeps BLAS on one thread (see CpuBackend.begin_forward), and
localkv/__init__ shortens OpenBLAS's spin after a call (OPENBLAS_THREAD_TIMEOUT) and that of
numba's OpenMP workers (GOMP_SPINCOUNT).

LOCALKV_CPU_KERNELS=0 turns the kernels off (numpy/BLAS only); so does a missing numba or a
missing OpenMP runtime (libgomp). Compiled code is cached beside this file (numba's cache).
"""

import contextlib
import os
import sys
import threading
import time

import numpy as np

from localkv.backends.jit_cache import tables_deferred
from localkv.backends.vm import drop_file_pages, reused_empty
from localkv.errors import first_line

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


def attends(head_dim: int) -> bool:
    """The attention kernels can run on heads of this size: they load 8 values of the head
    dimension at a time (numpy serves other sizes)."""
    return head_dim % 8 == 0 and active()


def release_compiler() -> bool:
    """Drop numba's compiler from this process's resident memory once the kernels have loaded.
    Loading them runs LLVM (libllvmlite.so), which leaves tens of MB of its code resident; it
    runs again only if a kernel of a new signature compiles, and its pages then come back from
    the page cache. A run that never compiles more holds that much less. True when the kernel
    took the advice."""
    return active() and drop_file_pages("/libllvmlite.so") > 0


_threads = threading.local()  # this thread's count for large kernels (set_threads)


def set_threads(threads: int, large: int | None = None):
    """Worker threads for kernels started from this thread (numba's setting is per thread);
    large: for kernels of PARALLEL_CAUSAL multiply-adds or more (a prefill pass's causal
    attention), default threads."""
    import numba

    top = numba.config.NUMBA_NUM_THREADS
    threads = max(1, min(threads, top))
    _threads.large = max(1, min(large if large is not None else threads, top))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


@contextlib.contextmanager
def _large_kernel(work: int):
    """Within the block, this thread's kernels run on its count for large kernels when `work`
    multiply-adds reach PARALLEL_CAUSAL."""
    import numba

    now, large = numba.get_num_threads(), getattr(_threads, "large", None)
    if large is None or large <= now or work < PARALLEL_CAUSAL:
        yield
        return
    numba.set_num_threads(large)
    try:
        yield
    finally:
        numba.set_num_threads(now)


def why_not() -> str | None:
    return _state.get("why")


def _load() -> tuple[bool, str | None]:
    if os.environ.get("LOCALKV_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False, "LOCALKV_CPU_KERNELS=0"
    try:
        with _absent(*_UNUSED_BY_NUMBA):
            import numba
    except ImportError as e:
        return False, f"numba not installed ({e})"
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "omp"
    try:
        with _absent("scipy.linalg"), tables_deferred():
            import localkv.backends._cpu_kernels_impl as impl

            if not (_check_paged_attention(impl) and _check_elementwise(impl) and _check_decode(impl)):
                return False, "kernel self-check failed"
        if numba.threading_layer() != "omp":
            return False, f"numba threading layer {numba.threading_layer()!r}, not 'omp'"
    except Exception as e:  # no OpenMP runtime, a numba/numpy mismatch, an unwritable cache...
        return False, f"numba kernels unavailable ({type(e).__name__}: {first_line(e)})"
    _state["impl"] = impl
    return True, None


# What numba imports at its own import and never uses for these kernels: scipy for a version
# check, yaml to read a .numba_config.yaml (imported when the working directory has one)
_UNUSED_BY_NUMBA = ("scipy",) if os.path.exists(".numba_config.yaml") else ("scipy", "yaml")


@contextlib.contextmanager
def _absent(*names: str):
    """Modules that read as absent while numba imports or loads the kernels, unless already
    imported: importing one (or a submodule) raises ImportError, which numba takes as "not
    installed". Afterwards they import normally.

    The first kernel numba loads makes it import its numpy registries, and with them
    scipy.linalg, to find a BLAS for np.dot and np.linalg in jitted code: no kernel here uses
    either, and the import costs a start about 0.2 s and 50 MB (scipy.linalg and its own
    OpenBLAS); numba then marks its BLAS support off for this process. Numba's own import
    imports scipy (a version check) and yaml (for a config file): 16 ms of a start."""
    names = [n for n in names if n not in sys.modules]
    for name in names:
        sys.modules[name] = None  # importing it (or a submodule) raises ImportError
    try:
        yield
    finally:
        for name in names:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _check_paged_attention(impl) -> bool:
    """Compile (or load) the shared-prefix, tail and causal kernels for an f16 pool now, with the
    array kinds the model passes, not inside a timed step, and check them: equal keys weigh
    every value alike, so each unnormalised output is the values' sum (normalised: a value)."""
    k = np.ones((1, 4, 2, 8), np.float16).view(np.uint16)  # [blocks, block size, kv heads, head dim]
    table, out = _table(np.zeros(1)), np.empty((2, 8, 8), np.float32)
    mx, sm = np.empty((2, 8), np.float32), np.empty((2, 8), np.float32)
    impl.paged_prefix(np.ones((2, 8, 8), np.float32), k, k, table, 3, out, mx, sm)
    ok = bool((mx == 8.0).all() and (sm == 3.0).all() and (out == 3.0).all())
    tout, tmx, tsm = (
        np.empty((2, 1, 3, 8), np.float32),
        np.empty((2, 1, 3, 1), np.float32),
        np.empty((2, 1, 3, 1), np.float32),
    )
    impl.paged_tails(np.ones((2, 1, 3, 8), np.float32), k, k, _table(table[None]), _table([2]), tout, tmx, tsm)
    ok = ok and bool((tmx == 8.0).all() and (tsm == 2.0).all() and (tout == 2.0).all())
    cout = np.empty((2, 1, impl.QT, 8), np.float32)  # the causal kernel, one tile of one head each
    impl.paged_causal(np.ones((2, 1, 8, impl.QT), np.float32), k, k, table, 0, 3, impl.QT, cout)
    return ok and bool((cout[:, :, :3] == 1.0).all())


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
    for x in (qkv[:, :2], qkv[:1, :2]):  # many rows: a strided view; one (a decode step): contiguous
        for pairs in (False, True):
            impl.rope(x, cos[: len(x)], sin[: len(x)], pairs)  # angle 0: unchanged
    gu = rng.standard_normal((3, 16), dtype=np.float32) * 20  # past exp's range both ways
    g, u = gu[:, :8].astype(np.float64), gu[:, 8:]
    act = g / (1 + np.exp(-g)) * u
    for order in "CF":  # a decode step's and a prefill pass's layouts
        ok = ok and np.allclose(silu_mul(np.asarray(gu, order=order), impl), act, rtol=1e-5, atol=1e-6)
    return ok and np.array_equal(qkv, want)


def _check_decode(impl) -> bool:
    """Compile (or load) decode attention for an f16 pool (the CPU's default; an f32 pool's
    build loads on its first use) and check it against numpy."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 8), dtype=np.float32)
    kv = rng.standard_normal((2, 3, 2, 2, 8), dtype=np.float32)  # K/V, 3 blocks of 2 tokens, 2 kv heads
    tables, lens = np.array([[2, 0], [1, 2]], np.int32), np.array([3, 4], np.int32)
    want = np.empty(q.shape, np.float32)
    for b in range(2):
        k, v = (a[tables[b]].reshape(4, 2, 8)[: lens[b]] for a in kv)
        s = np.einsum("hgd,nhd->hgn", q[b].reshape(2, 2, 8), k) * 0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        want[b] = np.einsum("hgn,nhd->hgd", p / p.sum(-1, keepdims=True), v).reshape(4, 8)
    ok = True
    for kernel in (impl.decode_attention, impl.decode_attention_serial):
        pool = kv.astype(np.float16).view(np.uint16)
        out = np.empty(q.shape, np.float32)
        kernel(q, pool[0], pool[1], tables, lens, np.float32(0.5), out, np.empty((4, 2, 4), np.float32))
        ok = ok and np.allclose(out, want, rtol=1e-2, atol=1e-2)
    return ok


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the rows of x [T, D] times w, in one kernel (a new array). Call only when active()."""
    out = np.empty(x.shape, np.float32)
    _state["impl"].rmsnorm(x, w, eps, out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox"):
    """RoPE in place on x [T, heads, hd]: "neox" halves or "normal" pairs. Call only when active()."""
    _state["impl"].rope(x, cos, sin, style != "neox")


def silu_mul(gu: np.ndarray, impl=None) -> np.ndarray:
    """silu(gate) * up for gu = [gate | up] (float32 [T, 2f], C- or F-contiguous: a decode step's
    or a prefill pass's matmul output), in the same order. Call only when active()."""
    impl = impl or _state["impl"]
    f = gu.shape[1] // 2
    if gu.flags.c_contiguous:
        out = reused_empty((len(gu), f))
        impl.silu_mul(gu, f, out, False)
    else:
        out = reused_empty((f, len(gu))).T  # F-ordered, as gu
        impl.silu_mul(np.asfortranarray(gu).T, f, out.T, True)
    return out


PARALLEL_ATTENTION = 1 << 20  # multiply-adds from which decode attention runs on all threads
# multiply-adds from which a prefill pass's causal attention takes the engine's threads from
# BLAS (idle meanwhile); a smaller one is over before the second thread pays for its start
# and for the spin of both pools of workers after their work (localkv/__init__)
PARALLEL_CAUSAL = 1 << 22


def decode_attention(q, k_layer, v_layer, tables, lens, scale: float, scores, work: int) -> np.ndarray:
    """See _cpu_kernels_impl.decode_attention (an f16 pool is passed as its bits); work: its
    multiply-adds, which choose the parallel or the serial build. Call only when attends(hd)."""
    out = np.empty(q.shape, np.float32)
    if k_layer.dtype == np.float16:
        k_layer, v_layer = k_layer.view(np.uint16), v_layer.view(np.uint16)
    impl = _state["impl"]
    kernel = impl.decode_attention if work >= PARALLEL_ATTENTION else impl.decode_attention_serial
    q = np.ascontiguousarray(q)  # one build per pool dtype, not two: the copy is a few hundred values
    kernel(q, k_layer, v_layer, tables, lens, np.float32(scale), out, scores)
    return out


def causal_max(s: np.ndarray, tq: int, first: int, window: int = 0):
    """See _cpu_kernels_impl.causal_max. Call only when active()."""
    _state["impl"].causal_max(s, tq, first, window)


def paged_partial(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, table: np.ndarray, n: int):
    """Unnormalised attention of q [kvh, R, hd] (already scaled) over the first n tokens of the
    pool layers k/v [blocks, bs, kvh, hd] read through a block table: (out [kvh, R, hd], row
    max, row sum [kvh, R, 1]). An f16 pool is read as it is (no float32 copy of its K/V). Call
    only when attends(hd)."""
    kvh, R, hd = q.shape
    R8 = -(-R // 8) * 8
    qt = np.zeros((kvh, hd, R8), np.float32)  # the queries transposed: a vector holds 8 of them
    qt[:, :, :R] = q.transpose(0, 2, 1)
    out = np.empty((kvh, R8, hd), np.float32)
    mx, sm = np.empty((kvh, R8), np.float32), np.empty((kvh, R8), np.float32)  # as compiled at load
    _state["impl"].paged_prefix(qt, _bits(k_layer), _bits(v_layer), _table(table), n, out, mx, sm)
    return out[:, :R], mx[:, :R, None], sm[:, :R, None]


def causal_attention(
    q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, table: np.ndarray, n_ctx: int, scale: float
):
    """Causal attention of q [T, H, hd] (the last T of n_ctx tokens) over the pool layers k/v
    [blocks, bs, kvh, hd] read through a block table, normalised: [T, H, hd]. Call only when
    attends(hd)."""
    T, H, hd = q.shape
    kvh = k_layer.shape[2]
    impl = _state["impl"]
    g, QT = H // kvh, impl.QT if T > impl.QT else impl.QT_SHORT  # query tokens per tile
    tiles, full = -(-T // QT), T // QT
    # [kvh, tiles, hd, QT * g]: a tile's rows ordered (token, head), transposed, scaled; one
    # strided pass over q (a zero-padded copy only for a last tile that is not full)
    qt = np.empty((kvh, tiles, hd, QT, g), np.float32)
    src, scale = q.reshape(T, kvh, g, hd), np.float32(scale)
    np.multiply(src[: full * QT].reshape(full, QT, kvh, g, hd).transpose(2, 0, 4, 1, 3), scale, out=qt[:, :full])
    if full < tiles:
        last = np.zeros((QT, kvh, g, hd), np.float32)
        last[: T - full * QT] = src[full * QT :]
        np.multiply(last.transpose(1, 3, 0, 2), scale, out=qt[:, full])
    qt = qt.reshape(kvh, tiles, hd, QT * g)
    out = np.empty((kvh, tiles, QT * g, hd), np.float32)
    with _large_kernel(T * (n_ctx - T // 2) * H * hd):  # the scores' multiply-adds, causal
        impl.paged_causal(qt, _bits(k_layer), _bits(v_layer), _table(table), n_ctx - T, T, QT, out)
    return out.reshape(kvh, tiles * QT, g, hd).transpose(1, 0, 2, 3).reshape(tiles * QT, H, hd)[:T]


def paged_tails(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, tables: np.ndarray, lens: np.ndarray):
    """Unnormalised attention of q [kvh, B, g, hd] (scaled), sequence b's queries over the
    first lens[b] tokens of its block table tables[b] (int64 [B, blocks], padded):
    (out [kvh, B, g, hd], row max, row sum [kvh, B, g, 1]), K/V read from the pool as stored.
    Call only when attends(hd)."""
    out = np.empty(q.shape, np.float32)
    mx, sm = np.empty((*q.shape[:3], 1), np.float32), np.empty((*q.shape[:3], 1), np.float32)
    _state["impl"].paged_tails(
        np.ascontiguousarray(q), _bits(k_layer), _bits(v_layer), _table(tables), _table(lens), out, mx, sm
    )
    return out, mx, sm


def _table(a) -> np.ndarray:
    """Block tables and lengths as the kernels were compiled for them: int64, C-contiguous and
    read-only (numba compiles, and a start loads, one build per writability)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _bits(a: np.ndarray) -> np.ndarray:
    """An f16 array as its uint16 bits (the kernels convert them as they read), else itself."""
    return a.view(np.uint16) if a.dtype == np.float16 else a
