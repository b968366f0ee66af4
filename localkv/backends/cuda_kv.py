"""The KV pool on the GPU: writing a step's K/V into pool slots, copying blocks (copy-on-write,
recall), reading a sequence's K/V back through its block table.

The pool is [layers, blocks, block_size, kv_heads, row], a row in its kv_format: fp16 values, or
q8_0 / q4_0 blocks (bytes), quantized once as they are written (write_rows_* kernels: the bytes
kv_format.encode gives). The kernels are in cuda/kv_cache.cu. Arrays of other dtypes or layouts
take plain CuPy indexing (same results; a quantized row then is encoded on the host).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from localkv import kv_format
from localkv.backends.cuda_kernels import F16, F32, KV_FORMATS, THREADS, dev, elem_strides, grid1d, kernel, ptr


def layer_format(layer) -> kv_format.KvFormat | None:
    """The kv_format of a pool array, None for a dtype that names none."""
    try:
        return kv_format.of(layer)
    except RuntimeError:
        return None


def pool_layer_ok(layer) -> bool:
    """One layer of the pool as the kernels read it: a format they read (KV_FORMATS),
    C-contiguous, rows aligned for their loads (f16: half2; q8_0 / q4_0: the f16 scales)."""
    fmt = layer_format(layer)
    return (
        fmt is not None
        and fmt.name in KV_FORMATS
        and layer.ndim == 4
        and layer.flags.c_contiguous
        and ptr(layer) % 4 == 0
        and layer.shape[3] % 2 == 0
    )


def _token_rows(a, row: int):
    """a [T, kvh, hd] as (array, token stride in elements) with each token's kvh*hd values
    contiguous: a itself when it already is (a slice of qkv is), else a contiguous copy."""
    st = elem_strides(a)
    if st is not None and st[2] == 1 and st[1] == a.shape[2]:
        return a, st[0]
    return cp.ascontiguousarray(a), row


def write_kv(k_layer, v_layer, slots, k, v):
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool,
    each in its pool's format. Negative slots are skipped (padding rows of a fixed-size batch)."""
    T = k.shape[0]
    if T == 0:
        return
    if k_layer.dtype != F16 or v_layer.dtype != F16:
        _write_rows(k_layer, slots, k)
        _write_rows(v_layer, slots, v)
        return
    fast = (
        pool_layer_ok(k_layer)
        and pool_layer_ok(v_layer)
        and k.dtype in (F16, F32)
        and k.shape == v.shape
        and k.shape[1:] == k_layer.shape[2:]
    )
    if not fast:
        nb, bs = k_layer.shape[:2]
        idx = cp.asarray(slots)
        k_layer.reshape(nb * bs, *k_layer.shape[2:])[idx] = k
        v_layer.reshape(nb * bs, *v_layer.shape[2:])[idx] = v
        return
    row = k.shape[1] * k.shape[2]
    if v.dtype != k.dtype:
        v = v.astype(k.dtype)
    kk, ks = _token_rows(k, row)
    vv, vs = _token_rows(v, row)
    sl = dev(slots, np.int64)
    kern = kernel("kv_cache.cu", "write_kv_f16" if k.dtype == F16 else "write_kv_f32")
    kern(
        grid1d(T * row),
        (THREADS,),
        (k_layer, v_layer, sl, kk, vv, np.int32(T), np.int32(row), np.int64(ks), np.int64(vs)),
    )


def _write_rows(layer, slots, x):
    """x [T, kvh, hd] into one pool layer at the slots >= 0, in the layer's format: a quantized
    one by write_rows_* (quantized on the device), else (or for a layout the kernel does not
    take) by CuPy indexing, a quantized row encoded on the host by kv_format.encode."""
    fmt = kv_format.of(layer)
    nb, bs, kvh, row = layer.shape
    fast = (
        fmt.quantized
        and layer.flags.c_contiguous
        and ptr(layer) % 2 == 0
        and x.dtype in (F16, F32)
        and x.shape[1:] == (kvh, fmt.head_dim(row))
    )
    if fast:
        xx, xs = _token_rows(x, kvh * x.shape[2])
        kern = kernel("kv_cache.cu", f"write_rows_{fmt.name}_{'f16' if x.dtype == F16 else 'f32'}")
        args = (
            layer,
            dev(slots, np.int64),
            xx,
            np.int32(x.shape[0]),
            np.int32(kvh),
            np.int32(x.shape[2]),
            np.int64(xs),
        )
        kern(grid1d(x.shape[0] * kvh * x.shape[2] // kv_format.QK), (THREADS,), args)
        return
    at = cp.asnumpy(dev(slots, np.int64))
    keep = at >= 0
    rows = x[cp.asarray(np.flatnonzero(keep))]
    if fmt.quantized:
        rows = cp.asarray(kv_format.encode(cp.asnumpy(rows).astype(np.float32), fmt))
    layer.reshape(nb * bs, kvh, row)[cp.asarray(at[keep])] = rows


def gather_kv(layer, block_table, n_ctx: int):
    """The first n_ctx tokens of a sequence's K or V [n_ctx, kvh, row] (rows in the pool's
    format), read through its block table."""
    return layer[cp.asarray(block_table)].reshape(-1, *layer.shape[2:])[:n_ctx]


def frozen_table(block_table):
    """A block table on the device as int32, once per forward pass (every layer reads it)."""
    return dev(block_table, np.int32)


def copy_blocks(k_pool, v_pool, src, dst, n_tokens: int | None = None):
    """Copy block src[i] onto block dst[i] in every layer of the pools [layers, blocks, block_size,
    kvh, row], the first n_tokens tokens (default: the whole block): copy-on-write of a shared
    partial block, or recall of a block into a new place; bytes as they are, whatever the format
    (q8_0 / q4_0 rows move as pairs of bytes through the fp16 kernel). Destinations must be
    distinct and not among the sources."""
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    L, nb, bs = k_pool.shape[:3]
    n = bs if n_tokens is None else int(n_tokens)
    if len(src) != len(dst):
        raise ValueError("copy_blocks: src and dst differ in length")
    if not len(src) or n == 0:
        return
    if not 0 <= n <= bs:
        raise ValueError(f"copy_blocks: n_tokens {n} outside [0, {bs}]")
    if src.min() < 0 or dst.min() < 0 or max(src.max(), dst.max()) >= nb:
        raise ValueError(f"copy_blocks: block id outside [0, {nb})")
    if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
        raise ValueError("copy_blocks: destinations must be distinct and not among the sources")
    k16, v16 = _as_halves(k_pool), _as_halves(v_pool)
    if k16 is None or v16 is None or k16.shape != v16.shape:
        si, di = cp.asarray(src), cp.asarray(dst)
        k_pool[:, di, :n] = k_pool[:, si, :n]
        v_pool[:, di, :n] = v_pool[:, si, :n]
        return
    row = k16.shape[3] * k16.shape[4]
    args = (
        k16,
        v16,
        dev(src, np.int32),
        dev(dst, np.int32),
        np.int64(nb * bs * row),
        np.int64(bs * row),
        np.int64(n * row),
    )
    kernel("kv_cache.cu", "copy_blocks_f16")((len(src), L), (THREADS,), args)


def _as_halves(pool):
    """A C-contiguous pool as fp16 elements (a quantized one's bytes in pairs: its rows have an
    even number of bytes), None when it is neither."""
    if not pool.flags.c_contiguous:
        return None
    if pool.dtype == F16:
        return pool
    fmt = layer_format(pool)
    return pool.view(cp.float16) if fmt is not None and fmt.quantized and pool.shape[-1] % 2 == 0 else None
