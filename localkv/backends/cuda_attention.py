"""Paged attention on the GPU: queries attend to K/V read through block tables from the pool
(rows in f16, q8_0 or q4_0, each of K and V in its own: read as stored), with the kernels of
cuda/paged_attention.cu:
- decode (one query token per sequence, batched over sequences): split-K "flash decoding"
  partials over partitions of the context, merged by a reduce kernel;
- prefill (a chunk of T tokens of one sequence): causal within the chunk, attending to every
  cached block;
- attention mass (H2O): the weight each key received, from the lse the other two write.
Head dims without kernels (see KERNEL_HEAD_DIMS), arrays of other dtypes or layouts, extra keys
(h2o's heavy hitters, offload's read-back blocks) and per-kv-head mass take plain CuPy array
code with the CPU backend's algorithm (correct, slower; quantized rows decoded by kv_format).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from localkv import kv_format
from localkv.backends.cpu.quant import fallback
from localkv.backends.cuda_kernels import (
    DECODE_WARPS,
    F16,
    F32,
    GMAX,
    KERNEL_HEAD_DIMS,
    KV_FORMATS,
    KV_PAIRS,
    MASS_WARPS,
    PREFILL_WARPS,
    THREADS,
    dev,
    elem_strides,
    kernel,
    ptr,
    sm_count,
)
from localkv.backends.cuda_kv import gather_kv, pool_layer_ok


def _q_rows(q):
    """q [T, H, hd] as (fp16 array, token stride in elements) that the kernels can read with
    half2 loads: q itself when it already is one (the model's slice of qkv), else a copy."""
    T, H, hd = q.shape
    st = elem_strides(q)
    if q.dtype == F16 and st is not None and st[2] == 1 and st[1] == hd and st[0] % 2 == 0 and ptr(q) % 4 == 0:
        return q, st[0]
    return cp.ascontiguousarray(q, dtype=cp.float16), H * hd


def _kernels_ok(hd, k_layer, v_layer) -> bool:
    return (
        hd in KERNEL_HEAD_DIMS
        and pool_layer_ok(k_layer)
        and pool_layer_ok(v_layer)
        and kv_format.pair_name(kv_format.of(k_layer), kv_format.of(v_layer)) in KV_PAIRS
    )


def _code(layer) -> np.int32:
    """The kernels' kf / vf argument for a pool layer's format."""
    return np.int32(KV_FORMATS[kv_format.of(layer).name])


def head_dim(k_layer) -> int:
    """Values per row of a pool layer [blocks, bs, kvh, row] in its format."""
    return kv_format.of(k_layer).head_dim(k_layer.shape[3])


@dataclass(frozen=True, slots=True)
class Split:
    """How split-K decode partitions a context: `part` tokens a partition (None: the backend's
    choice, _decode_partition) for a GPU of `sm_count` SMs (None: the device's). The backend
    runs the defaults; the emulator tests set them to reach partition counts on short contexts."""

    part: int | None = None
    sm_count: int | None = None


@dataclass(frozen=True, slots=True)
class Contexts:
    """Where decode's B sequences read their K/V: block tables [B, width] (or one table [width])
    int32 on the device, and their lengths: `lens` [B] int32 on the device, or `fixed` > 0 for
    all (then lens is never read); max_ctx bounds them on the host (it sizes the partitions)."""

    tables: object
    lens: object
    fixed: int
    max_ctx: int


@dataclass(frozen=True, slots=True)
class Attended:
    """The attention kernels' outputs: out [rows, H, hd] fp16, lse [rows, H] fp32, and the
    split-K partitions decode ran (1 for prefill)."""

    out: object
    lse: object
    parts: int


def _decode_partition(work_blocks: int, max_ctx: int, sms: int) -> tuple[int, int]:
    """(partition size, partitions) for split-K decode: about 4 thread blocks per SM in all,
    partitions of at least 256 tokens (multiples of 64), one partition for short contexts."""
    want = max(1, -(-4 * sms // max(1, work_blocks)))
    part = max(256, -(-max_ctx // want))
    part = -(-part // 64) * 64
    return part, max(1, -(-max_ctx // part))


def _launch_decode(out, lse, q16, q_stride: int, k_layer, v_layer, ctx: Contexts, scale: float, split: Split) -> int:
    """paged_decode_hd* (and the reduce when it splits) for q16 [B, H, hd]; returns the partitions."""
    B, H, hd = q16.shape
    kvh, bs = k_layer.shape[2], k_layer.shape[1]
    hchunks = -(-(H // kvh) // GMAX[hd])
    if split.part is None:
        sms = split.sm_count or sm_count(cp.cuda.Device().id)
        part, nparts = _decode_partition(B * kvh * hchunks, ctx.max_ctx, sms)
    else:
        part, nparts = split.part, max(1, -(-ctx.max_ctx // split.part))
    if nparts == 1:
        part_acc = part_ml = lse  # never touched by the kernel when num_parts == 1
    else:
        part_acc = cp.empty((B, H, nparts, hd), cp.float32)
        part_ml = cp.empty((B, H, nparts, 2), cp.float32)
    kernel("paged_attention.cu", f"paged_decode_hd{hd}")(
        (kvh * hchunks, B, nparts),
        (DECODE_WARPS * 32,),
        (
            out,
            lse,
            part_acc,
            part_ml,
            q16,
            np.int64(q_stride),
            k_layer,
            v_layer,
            _code(k_layer),
            _code(v_layer),
            ctx.tables,
            np.int32(ctx.tables.shape[-1]),
            ctx.lens,
            np.int32(ctx.fixed),
            np.int32(H),
            np.int32(kvh),
            np.int32(bs),
            np.int32(part),
            np.int32(nparts),
            np.float32(scale),
        ),
    )
    if nparts > 1:
        kernel("paged_attention.cu", "paged_decode_reduce")(
            (H, B),
            (min(THREADS, -(-hd // 32) * 32),),
            (
                out,
                lse,
                part_acc,
                part_ml,
                ctx.lens,
                np.int32(ctx.fixed),
                np.int32(H),
                np.int32(hd),
                np.int32(part),
                np.int32(nparts),
            ),
        )
    return nparts


def _launch_prefill(out, lse, q16, q_stride: int, k_layer, v_layer, bt, n_ctx: int, scale: float) -> None:
    """paged_prefill_hd* for the T query rows of q16 [T, H, hd], the last T of n_ctx."""
    T, H, hd = q16.shape
    kvh = k_layer.shape[2]
    hchunks = -(-(H // kvh) // GMAX[hd])
    kernel("paged_attention.cu", f"paged_prefill_hd{hd}")(
        (-(-T // PREFILL_WARPS), kvh * hchunks),
        (PREFILL_WARPS * 32,),
        (
            out,
            lse,
            q16,
            np.int64(q_stride),
            k_layer,
            v_layer,
            _code(k_layer),
            _code(v_layer),
            bt,
            *_shape_args(q16, k_layer, n_ctx, scale),
        ),
    )


def _shape_args(q16, k_layer, n_ctx: int, scale: float) -> tuple:
    """The arguments the prefill and mass kernels end with: n_ctx, T, H, kv heads, block size, scale."""
    T, H = q16.shape[:2]
    bs, kvh = k_layer.shape[1:3]
    return np.int32(n_ctx), np.int32(T), np.int32(H), np.int32(kvh), np.int32(bs), np.float32(scale)


def attention_kernels(q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, *, split=Split()):
    """paged_attention's kernel path, once its checks have passed (hd in KERNEL_HEAD_DIMS, pool
    layers as the kernels read them): T == 1 the split-K decode, T > 1 the prefill kernel, then
    the attention mass when asked for. Returns Attended."""
    T, H, hd = q.shape
    bt = dev(block_table, np.int32)
    q16, qs = _q_rows(q)
    out = cp.empty((T, H, hd), cp.float16)
    lse = cp.empty((T, H), cp.float32)
    parts = 1
    if T == 1:
        parts = _launch_decode(out, lse, q16, qs, k_layer, v_layer, Contexts(bt, bt, n_ctx, n_ctx), scale, split)
    else:
        _launch_prefill(out, lse, q16, qs, k_layer, v_layer, bt, n_ctx, scale)
    if mass is not None:
        _add_mass(mass, lse, q16, qs, k_layer, bt, n_ctx, scale)
    return Attended(out, lse, parts)


def decode_kernels(q, k_layer, v_layer, tables, lens, scale: float, max_ctx: int, *, out=None, split=Split()):
    """paged_decode's kernel path: q [B, H, hd], tables [B, width] and lens [B] int32 on the
    device, max_ctx a host-side bound on lens. Returns Attended (out: `out` when given)."""
    B, H, hd = q.shape
    q16, qs = _q_rows(q)
    if out is None:
        out = cp.empty((B, H, hd), cp.float16)
    lse = cp.empty((B, H), cp.float32)
    parts = _launch_decode(out, lse, q16, qs, k_layer, v_layer, Contexts(tables, lens, 0, max_ctx), scale, split)
    return Attended(out, lse, parts)


def paged_attention(q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, extra=None):
    """Causal attention of q [T, H, hd] — the last T tokens of an n_ctx context — over the
    K/V found through block_table. Returns [T, H, hd] in q's dtype. If mass is given (numpy
    or CuPy), the attention weight each key received, summed over queries, is added to it:
    [n_ctx] summed over heads (the kernel path), or [kv_heads, n_extra + n_ctx] per kv head
    (the CPU backend's layout; the CuPy fallback). T == 1 runs the split-K decode kernel, T > 1 the
    prefill kernel. extra = (K, V) [kv_heads, n, hd] (h2o's heavy hitters, offload's read-back
    blocks; before the whole table) takes the CuPy fallback path."""
    T, H, hd = q.shape
    nb, bs, kvh = k_layer.shape[:3]
    n_ctx = int(n_ctx)
    if head_dim(k_layer) != hd or head_dim(v_layer) != hd or H % kvh or not 1 <= T <= n_ctx:
        raise ValueError(f"paged_attention: q {q.shape} does not fit K/V {k_layer.shape} with n_ctx {n_ctx}")
    if len(block_table) * bs < n_ctx:
        raise ValueError(f"paged_attention: {len(block_table)} blocks of {bs} cannot hold {n_ctx} tokens")
    if extra is not None or (mass is not None and mass.ndim == 2) or not _kernels_ok(hd, k_layer, v_layer):
        return _paged_attention_xp(q, k_layer, v_layer, block_table, n_ctx, scale, mass, extra)
    out = attention_kernels(q, k_layer, v_layer, block_table, n_ctx, scale, mass).out
    return out if q.dtype == F16 else out.astype(q.dtype)


def _add_mass(mass, lse, q16, q_stride: int, k_layer, bt, n_ctx: int, scale: float) -> None:
    """attention_mass_hd*: the weight each of the n_ctx keys received from q16's rows, added to mass."""
    direct = isinstance(mass, cp.ndarray) and mass.dtype == F32 and mass.flags.c_contiguous and mass.shape == (n_ctx,)
    target = mass if direct else cp.zeros(n_ctx, cp.float32)
    kernel("paged_attention.cu", f"attention_mass_hd{q16.shape[2]}")(
        (-(-n_ctx // MASS_WARPS),),
        (MASS_WARPS * 32,),
        (target, lse, q16, np.int64(q_stride), k_layer, _code(k_layer), bt, *_shape_args(q16, k_layer, n_ctx, scale)),
    )
    if direct:
        return
    if isinstance(mass, cp.ndarray):
        mass += target.astype(mass.dtype)
    else:
        mass += cp.asnumpy(target).astype(mass.dtype, copy=False)


def paged_decode(q, k_layer, v_layer, block_tables, context_lens, scale: float, max_ctx: int | None = None, out=None):
    """Batched decode: one query token per sequence. q [B, H, hd]; block_tables [B, max_blocks]
    int32 and context_lens [B] int32 on the device (each >= 1); returns [B, H, hd] fp16 (into
    `out` when given). max_ctx, a host-side bound on context_lens, sizes the split-K partitions
    (default max_blocks * block_size). No device-to-host reads on the kernel path, so it can be
    captured in a CUDA graph."""
    B, H, hd = q.shape
    kvh, bs = k_layer.shape[2], k_layer.shape[1]
    tables = dev(block_tables, np.int32)
    lens = dev(context_lens, np.int32)
    if tables.ndim != 2 or tables.shape[0] != B or lens.shape != (B,) or H % kvh:
        raise ValueError(f"paged_decode: q {q.shape}, block_tables {tables.shape}, context_lens {lens.shape}")
    if not _kernels_ok(hd, k_layer, v_layer):  # fallback: per sequence, reads the lengths back
        res = cp.stack(
            [
                _paged_attention_xp(q[b : b + 1], k_layer, v_layer, tables[b], int(n), scale)[0]
                for b, n in enumerate(cp.asnumpy(lens))
            ]
        ).astype(cp.float16)
        if out is None:
            return res
        out[...] = res
        return out
    return decode_kernels(q, k_layer, v_layer, tables, lens, scale, int(max_ctx or tables.shape[1] * bs), out=out).out


def _paged_attention_xp(q, k_layer, v_layer, block_table, n_ctx, scale, mass=None, extra=None):
    """The CPU backend's algorithm on CuPy arrays in fp32: any head dim, dtype or layout."""
    T, H, hd = q.shape
    bt = cp.asarray(block_table)
    k = kv_format.decode(gather_kv(k_layer, bt, n_ctx), cp)  # float32, whatever the format
    v = kv_format.decode(gather_kv(v_layer, bt, n_ctx), cp)
    ne = 0
    if extra is not None:  # [kvh, n, row] -> this function's [n, kvh, hd], placed before the table's keys
        ke, ve = (kv_format.decode(cp.asarray(a), cp).transpose(1, 0, 2) for a in extra)
        ne = ke.shape[0]
        k, v = cp.concatenate((ke, k)), cp.concatenate((ve, v))
        n_ctx = n_ctx + ne
    kvh = k.shape[1]
    g = H // kvh
    qg = q.astype(cp.float32).reshape(T, kvh, g, hd).transpose(1, 2, 0, 3).reshape(kvh, g * T, hd)
    if kv_format.of(k_layer).quantized:  # the CPU's integer scores' products (the kernels' too)
        s = cp.matmul(fallback.quantize_activations(qg * np.float32(scale), xp=cp), k.transpose(1, 2, 0))
    else:
        s = cp.matmul(qg, k.transpose(1, 2, 0)) * scale
    if T > 1:
        s = s.reshape(kvh, g, T, n_ctx)
        s += cp.triu(cp.full((T, n_ctx), -cp.inf, cp.float32), k=n_ctx - T + 1)
        s = s.reshape(kvh, g * T, n_ctx)
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    if mass is not None:
        m = s.reshape(kvh, g * T, n_ctx).sum(axis=1) if mass.ndim == 2 else s.sum(axis=(0, 1))[ne:]
        if isinstance(mass, cp.ndarray):
            mass += m.astype(mass.dtype)
        else:
            mass += cp.asnumpy(m).astype(mass.dtype, copy=False)
    o = cp.matmul(s, v.transpose(1, 0, 2))
    return o.reshape(kvh, g, T, hd).transpose(2, 0, 1, 3).reshape(T, H, hd).astype(q.dtype)


class DecodeBatch:
    """Block tables and context lengths of B single-token sequences, on the device, made once
    per forward pass and read by every layer's paged_decode."""

    def __init__(self, tables: list, n_ctx: list[int]):
        width = max(len(t) for t in tables)
        host = np.zeros((len(tables), width), np.int32)
        for b, t in enumerate(tables):
            host[b, : len(t)] = cp.asnumpy(t) if isinstance(t, cp.ndarray) else np.asarray(t)
        self.tables, self.lens = cp.asarray(host), cp.asarray(np.asarray(n_ctx, np.int32))
        self.max_ctx = int(max(n_ctx))
