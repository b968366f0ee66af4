"""The compiled attention and element-wise kernels (kernels/attention, decode_rows,
elementwise), called on numpy arrays: the layouts and dtypes they were compiled for, and the
threads a kernel started from this thread runs on. Call them only when build.active()
(attends(head_dim) for attention); the weight matmuls' entry points are in quant.

Why kernels: with few activation rows (one token per sequence) a matmul reads a whole weight
matrix for very little arithmetic. OpenBLAS's gemm first copies ("packs") the weights, so a
few rows cost nearly as much as many; the kernels read each weight row once for several
activation rows, on all threads. The attention and element-wise steps are fused into one pass
each where numpy makes several.
"""

import functools

import numpy as np

from localkv import kv_format
from localkv.backends.cpu.build import active, state
from localkv.backends.vm import reused_empty

FEW_ROWS = 64  # rows (tokens x heads) rotated or quantized on the calling thread: a decode step's


def attends(head_dim: int) -> bool:
    """The attention kernels can run on heads of this size: they load 8 values of the head
    dimension at a time (numpy serves other sizes)."""
    return head_dim % 8 == 0 and active()


def set_threads(threads: int):
    """Worker threads for kernels started from this thread (numba's setting is per thread)."""
    import numba

    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the rows of x [T, D] times w, in one kernel (a new array). Call only when active()."""
    out = np.empty(x.shape, np.float32)
    state.elementwise.rmsnorm(x, w, eps, out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox"):
    """RoPE in place on x [T, heads, hd]: "neox" halves or "normal" pairs. Call only when active()."""
    state.elementwise.rope(x, cos, sin, style != "neox")


def hadamard(x: np.ndarray, rotation, undo: bool) -> np.ndarray:
    """kv/rotation's M x (undo: M^T x) of rows x [T, heads, hd] (a view is fine), a new array,
    in one kernel. Call only when active(). A view (some of the qkv heads: a pool with only K
    or only V quantized) is copied first: one build of each kernel, not one per layout (a
    first run compiles each for seconds)."""
    x = np.ascontiguousarray(x)
    out = np.empty(x.shape, np.float32)
    kernel = state.elementwise.hadamard_few if x.shape[0] * x.shape[1] <= FEW_ROWS else state.elementwise.hadamard_rows
    kernel(x, rotation.signs, rotation.block, rotation.scale, undo, out)
    return out


def rope_turn_store(qkv: np.ndarray, cos, sin, style: str, rotation, k_layer, v_layer, slots) -> bool:
    """RoPE on qkv [T, H + 2 kvh, hd]'s q and k heads, the rotation's heads turned (none when
    it is None), K and V written to the pool layers at slots, in one kernel with the bits of
    rope, hadamard and encode_rows one after the other. True when done; False, with nothing
    done, where it does not apply: more rows than FEW_ROWS (a prefill pass's: its kernels run
    in parallel), a pool with a float side, a qkv that is not C-contiguous."""
    T, heads, hd = qkv.shape
    kvh = k_layer.shape[2]
    if T * heads > FEW_ROWS or not qkv.flags.c_contiguous or qkv.dtype != np.float32:
        return False
    if not (kv_format.of(k_layer).quantized and kv_format.of(v_layer).quantized):
        return False
    if rotation is None:
        t0 = t1 = 0
        signs, block, scale = _no_signs(hd), 1, np.float32(1)
    else:
        t0, t1 = rotation.heads(heads - 2 * kvh, kvh)
        signs, block, scale = rotation.signs, rotation.block, rotation.scale
    state.elementwise.rope_turn_store(
        qkv, cos, sin, style != "neox", kvh, signs, block, scale, t0, t1, np.asarray(slots, np.int64),
        _rows(k_layer), _rows(v_layer), k_layer.dtype == np.uint8, v_layer.dtype == np.uint8,
    )  # fmt: skip
    return True


@functools.lru_cache(maxsize=4)
def _no_signs(hd: int) -> np.ndarray:
    return np.ones(hd, np.float32)


def _rows(layer: np.ndarray) -> np.ndarray:
    """A quantized pool layer [blocks, bs, kvh, row bytes] as uint8 rows, one per slot and kv head."""
    if not layer.flags.c_contiguous:  # a reshape would write into a copy
        raise ValueError("the pool layer must be C-contiguous")
    return layer.view(np.uint8).reshape(-1, layer.shape[3])


def encode_rows(layer: np.ndarray, slots: np.ndarray, x: np.ndarray):
    """kv_format.encode(x [T, kvh, hd]) into a quantized pool layer [blocks, bs, kvh, row] at
    the flat slots (block * bs + offset): the same bytes, written in place."""
    rows, kvh = _rows(layer), layer.shape[2]
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, np.float32)
    kernels = state.elementwise
    kernel = kernels.encode_rows if len(x) * kvh <= FEW_ROWS else kernels.encode_rows_par
    kernel(x, np.asarray(slots, np.int64), rows, layer.dtype == np.uint8)


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


def decode_rows(
    q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, tables, lens, scale: float, split=None
) -> np.ndarray:
    """See kernels/decode_rows.paged_decode: attention of B sequences' last tokens q [B, H, hd]
    over int64 tables [B, blocks] and lens [B] (read-only), normalised [B, H, hd]: each row
    the bits causal_attention gives it. split: decode_split's answer for these sequences and
    heads, when the caller keeps it for every layer of a pass. Call only when attends(hd)."""
    parts, threads = split or decode_split(len(q), k_layer.shape[2], int(lens.max()))
    out = np.empty(q.shape, np.float32)
    if q.dtype != np.float32 or not q.flags.c_contiguous:
        q = np.ascontiguousarray(q, dtype=np.float32)
    state.decode_rows.paged_decode(
        q, np.float32(scale), _bits(k_layer), _bits(v_layer), tables, lens, parts, threads, out
    )
    return out


def decode_split(rows: int, kvh: int, most: int) -> tuple[int, int]:
    """(parts, threads) of decode_rows for `rows` sequences of up to `most` tokens and kvh kv
    heads: enough jobs (kv head x span x part of the sequences) to keep every thread busy.
    Worked out once a pass: a decode step's Python runs with caches the weights' stream has
    just emptied, where each call costs several times its time in a loop."""
    import numba

    spans = -(-most // state.attention.SPAN)
    threads = numba.get_num_threads()
    return min(rows, -(-2 * threads // (kvh * spans))), threads


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
    import numba

    T, H, hd = q.shape
    nb, bs, kvh, _ = k_layer.shape
    kernels = state.attention
    g = H // kvh
    tiles = -(-T // kernels.QT)  # at most QT query tokens each, as even as they go: no tile mostly padding
    QT = -(-T // tiles)
    full, RT = T // QT, -(-QT * g // 8) * 8  # (tiles = ceil(T / QT) holds for QT = 32)
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
    split = kvh * tiles < 2 * numba.get_num_threads() and n_ctx > kernels.SPAN  # else every thread has tiles
    kernels.paged_causal(*args, np.float32(softcap), window, split, out)
    out = out[:, :, : QT * g].reshape(kvh, tiles, QT, g, hd).transpose(1, 2, 0, 3, 4)
    return out.reshape(tiles * QT, H, hd)[:T]


@functools.lru_cache(maxsize=16)
def _no_extra(dtype, kvh: int, bs: int, row: int) -> np.ndarray:
    """causal_attention's extra blocks of K or V when there are none: empty, in the pool's
    dtype (and writable, as recalled blocks are: one build of the kernel for both)."""
    return np.empty((kvh, 0, bs, row), dtype)


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
