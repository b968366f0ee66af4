"""The KV pool on the GPU: writing a step's K/V into pool slots, copying blocks (copy-on-write,
recall), reading a sequence's K/V back through its block table.

The pool is fp16 [layers, blocks, block_size, kv_heads, head_dim]; the kernels are in
cuda/kv_cache.cu. Arrays of other dtypes or layouts take plain CuPy indexing (same results).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from localkv.backends.cuda_kernels import F16, F32, THREADS, dev, elem_strides, grid1d, kernel, ptr


def pool_layer_ok(layer) -> bool:
    """One layer of the pool as the kernels read it: fp16, C-contiguous, half2-aligned rows."""
    return (
        layer.dtype == F16
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
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool.
    Negative slots are skipped (padding rows of a fixed-size batch)."""
    T = k.shape[0]
    if T == 0:
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


def gather_kv(layer, block_table, n_ctx: int):
    """The first n_ctx tokens of a sequence's K or V [n_ctx, kvh, hd], read through its block table."""
    return layer[cp.asarray(block_table)].reshape(-1, *layer.shape[2:])[:n_ctx]


def frozen_table(block_table):
    """A block table on the device as int32, once per forward pass (every layer reads it)."""
    return dev(block_table, np.int32)


def copy_blocks(k_pool, v_pool, src, dst, n_tokens: int | None = None):
    """Copy block src[i] onto block dst[i] in every layer of the pools [layers, blocks, block_size,
    kvh, hd] (fp16), the first n_tokens tokens (default: the whole block): copy-on-write of a
    shared partial block, or recall of a block into a new place. Destinations must be distinct
    and not among the sources."""
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
    if not (k_pool.dtype == F16 == v_pool.dtype and k_pool.flags.c_contiguous and v_pool.flags.c_contiguous):
        si, di = cp.asarray(src), cp.asarray(dst)
        k_pool[:, di, :n] = k_pool[:, si, :n]
        v_pool[:, di, :n] = v_pool[:, si, :n]
        return
    row = k_pool.shape[3] * k_pool.shape[4]
    args = (
        k_pool,
        v_pool,
        dev(src, np.int32),
        dev(dst, np.int32),
        np.int64(nb * bs * row),
        np.int64(bs * row),
        np.int64(n * row),
    )
    kernel("kv_cache.cu", "copy_blocks_f16")((len(src), L), (THREADS,), args)
