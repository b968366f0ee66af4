"""The compiled attention and element-wise kernels (kernels/attention, decode, elementwise),
called on numpy arrays: the layouts and dtypes they were compiled for, the serial or the
parallel build by size, and the threads a kernel started from this thread runs on. Call them
only when build.active() (attends(head_dim) for attention); the weight matmuls' entry points
are in quant.

Why kernels: with few activation rows (one token per sequence) a matmul reads a whole weight
matrix for very little arithmetic. OpenBLAS's gemm first copies ("packs") the weights, so a
few rows cost nearly as much as many; the kernels read each weight row once for several
activation rows, on all threads. The attention and element-wise steps are fused into one pass
each where numpy makes several.
"""

import contextlib
import functools
import threading

import numpy as np

from localkv.backends.cpu.build import active, state
from localkv.backends.vm import reused_empty


def attends(head_dim: int) -> bool:
    """The attention kernels can run on heads of this size: they load 8 values of the head
    dimension at a time (numpy serves other sizes)."""
    return head_dim % 8 == 0 and active()


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


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the rows of x [T, D] times w, in one kernel (a new array). Call only when active()."""
    out = np.empty(x.shape, np.float32)
    state.elementwise.rmsnorm(x, w, eps, out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox"):
    """RoPE in place on x [T, heads, hd]: "neox" halves or "normal" pairs. Call only when active()."""
    state.elementwise.rope(x, cos, sin, style != "neox")


def silu_mul(gu: np.ndarray) -> np.ndarray:
    """silu(gate) * up for gu = [gate | up] (float32 [T, 2f], C- or F-contiguous: a decode step's
    or a prefill pass's matmul output), in the same order. Call only when active()."""
    f = gu.shape[1] // 2
    if gu.flags.c_contiguous:
        out = reused_empty((len(gu), f))
        state.elementwise.silu_mul(gu, f, out, False)
    else:
        out = reused_empty((f, len(gu))).T  # F-ordered, as gu
        state.elementwise.silu_mul(np.asfortranarray(gu).T, f, out.T, True)
    return out


PARALLEL_ATTENTION = 1 << 20  # multiply-adds from which decode attention runs on all threads
# multiply-adds from which a prefill pass's causal attention takes the engine's threads from
# BLAS (idle meanwhile); a smaller one is over before the second thread pays for its start
# and for the spin of both pools of workers after their work (localkv/__init__)
PARALLEL_CAUSAL = 1 << 22


def decode_attention(q, k_layer, v_layer, tables, lens, scale: float, scores, work: int) -> np.ndarray:
    """See kernels/decode.decode_attention (an f16 pool is passed as its bits); work: its
    multiply-adds, which choose the parallel or the serial build. Call only when attends(hd)."""
    out = np.empty(q.shape, np.float32)
    if k_layer.dtype == np.float16:
        k_layer, v_layer = k_layer.view(np.uint16), v_layer.view(np.uint16)
    kernel = state.decode.decode_attention if work >= PARALLEL_ATTENTION else state.decode.decode_attention_serial
    q = np.ascontiguousarray(q)  # one build per pool dtype, not two: the copy is a few hundred values
    kernel(q, k_layer, v_layer, tables, lens, np.float32(scale), out, scores)
    return out


def decode_rows(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, tables, lens, scale: float) -> np.ndarray:
    """See kernels/decode_rows.paged_decode: attention of B sequences' last tokens q [B, H, hd]
    over int64 tables [B, blocks] and lens [B] (read-only), normalised [B, H, hd]: each row
    the bits causal_attention gives it. Call only when attends(hd)."""
    import numba

    B, H, hd = q.shape
    kvh = k_layer.shape[2]
    g = H // kvh
    qt = np.empty((kvh, hd, B, g), np.float32)
    np.multiply(q.reshape(B, kvh, g, hd).transpose(1, 3, 0, 2), np.float32(scale), out=qt)
    out = np.empty((kvh, B * g, hd), np.float32)
    spans = -(-int(lens.max()) // state.attention.SPAN)  # jobs per kv head and part of the sequences
    parts = min(B, -(-2 * numba.get_num_threads() // (kvh * spans)))  # enough jobs to keep every thread busy
    state.decode_rows.paged_decode(qt.reshape(kvh, hd, B * g), _bits(k_layer), _bits(v_layer), tables, lens, parts, out)
    return out.reshape(kvh, B, g, hd).transpose(1, 0, 2, 3).reshape(B, H, hd)


def causal_max(s: np.ndarray, tq: int, first: int, window: int = 0):
    """See kernels/elementwise.causal_max. Call only when active()."""
    state.elementwise.causal_max(s, tq, first, window)


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
    state.attention.paged_prefix(qt, _bits(k_layer), _bits(v_layer), _table(table), n, out, mx, sm)
    return out[:, :R], mx[:, :R, None], sm[:, :R, None]


def causal_attention(
    q: np.ndarray,
    k_layer: np.ndarray,
    v_layer: np.ndarray,
    tables: np.ndarray,
    n_ctx: int,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    extra: tuple[np.ndarray, np.ndarray] | None = None,
):
    """Causal attention of q [T, H, hd] (the last T of n_ctx positions) over the pool layers k/v
    [blocks, bs, kvh, row] (rows in their kv_format), normalised: [T, H, hd]. tables: a block table (every kv head) or
    int64 [kvh, n_blocks] per kv head, whose entries may also be sequence.HOLE (keys absent) or
    -2 - i for block i of extra = (K, V) [kvh, nx, bs, row] in the pool's formats (blocks
    recalled from an offload tier). softcap > 0: Gemma 2's soft-capped scores; window > 0: a
    query sees its `window` newest keys. Call only when attends(hd)."""
    T, H, hd = q.shape
    nb, bs, kvh, _ = k_layer.shape
    kernels = state.attention
    g = H // kvh
    QT = kernels.QT if T > kernels.QT else min(T, kernels.QT_SHORT)  # query tokens per tile
    tiles, full, RT = -(-T // QT), T // QT, -(-QT * g // 8) * 8
    # [kvh, tiles, hd, RT]: a tile's rows ordered (token, head), transposed, scaled, zero rows
    # after QT * g; one strided pass over q (a zero-padded copy only for a last tile not full)
    make = np.empty if QT * g == RT else np.zeros
    qt = make((kvh, tiles, hd, RT), np.float32)
    rows = qt[..., : QT * g].reshape(kvh, tiles, hd, QT, g)
    src, scale = q.reshape(T, kvh, g, hd), np.float32(scale)
    np.multiply(src[: full * QT].reshape(full, QT, kvh, g, hd).transpose(2, 0, 4, 1, 3), scale, out=rows[:, :full])
    if full < tiles:
        last = np.zeros((QT, kvh, g, hd), np.float32)
        last[: T - full * QT] = src[full * QT :]
        np.multiply(last.transpose(1, 3, 0, 2), scale, out=rows[:, full])
    if tables.ndim == 1:
        tables = np.broadcast_to(tables, (kvh, len(tables)))
    if extra is None:
        xk, xv = (
            _no_extra(k_layer.dtype, kvh, bs, k_layer.shape[3]),
            _no_extra(v_layer.dtype, kvh, bs, v_layer.shape[3]),
        )
    else:
        xk, xv = (np.ascontiguousarray(a) for a in extra)
    out = np.empty((kvh, tiles, RT, hd), np.float32)
    args = (qt, _bits(k_layer), _bits(v_layer), _table(tables), _bits(xk), _bits(xv), n_ctx - T, T, QT, g)
    work = T * (n_ctx - T // 2) * H * hd  # the scores' multiply-adds, causal
    if work < PARALLEL_CAUSAL:
        kernels.paged_causal(*args, np.float32(softcap), window, out)
    else:
        with _large_kernel(work):
            kernels.paged_causal(*args, np.float32(softcap), window, out)
    out = out[:, :, : QT * g].reshape(kvh, tiles, QT, g, hd).transpose(1, 2, 0, 3, 4)
    return out.reshape(tiles * QT, H, hd)[:T]


@functools.lru_cache(maxsize=16)
def _no_extra(dtype, kvh: int, bs: int, row: int) -> np.ndarray:
    """causal_attention's extra blocks of K or V when there are none: empty, in the pool's
    dtype (and writable, as recalled blocks are: one build of the kernel for both)."""
    return np.empty((kvh, 0, bs, row), dtype)


def paged_tails(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, tables: np.ndarray, lens: np.ndarray):
    """Unnormalised attention of q [kvh, B, g, hd] (scaled), sequence b's queries over the
    first lens[b] tokens of its block table tables[b] (int64 [B, blocks], padded):
    (out [kvh, B, g, hd], row max, row sum [kvh, B, g, 1]), K/V read from the pool as stored.
    Call only when attends(hd)."""
    out = np.empty(q.shape, np.float32)
    mx, sm = np.empty((*q.shape[:3], 1), np.float32), np.empty((*q.shape[:3], 1), np.float32)
    state.decode.paged_tails(
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
