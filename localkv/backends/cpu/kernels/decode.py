"""The numba kernels behind cpu_kernels (imported only when numba is there)."""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload, register_jitable

from localkv.backends._attention_kernels import QT, QT_SHORT, exp, paged_causal, paged_prefix, vload  # noqa: F401 (for cpu_kernels)
from localkv.backends.quant._simd_f32 import fadd, fload, fma, fsplat, fsplat_at, fstore, hsum

_OPTS = dict(parallel=True, fastmath=True, boundscheck=False, cache=True, nogil=True)


@register_jitable
def _attend(q, k, v, h, table, n, scale, s, out, mx, sm):
    """Unnormalised attention of q [g, hd] (kv head h's group of query heads, times scale; hd
    a multiple of 8) over the first n >= 1 tokens of one block table, K/V read from the pool
    layers k/v [blocks, block_size, kv_heads, hd] (C-contiguous; float32, or uint16 holding
    half floats): out [g, hd], row max mx and row sum sm [g]; s [g, >= n] is scratch. Each
    dot product runs on vectors of 8 along hd, one horizontal sum at its end; the weighted
    sum keeps 8 of hd in a register over all the keys."""
    bs, kvh = k.shape[1], k.shape[2]
    g, hd = q.shape
    rows = np.empty(n + 3, np.int64)  # flat offset of each token's row: one division per token
    for t in range(n):
        rows[t] = ((table[t // bs] * bs + t % bs) * kvh + h) * hd
    rows[n : n + 3] = rows[0]  # the last group of 4 keys reads valid rows past n (not kept)
    for t in range(0, n, 4):  # 4 keys at a time: 4 independent FMA chains, not one
        for j in range(g):
            qj = q[j]
            a0 = a1 = a2 = a3 = fsplat(np.float32(0))
            for c in range(0, hd, 8):
                x = fload(qj, c)
                a0 = fma(x, vload(k, rows[t] + c), a0)
                a1 = fma(x, vload(k, rows[t + 1] + c), a1)
                a2 = fma(x, vload(k, rows[t + 2] + c), a2)
                a3 = fma(x, vload(k, rows[t + 3] + c), a3)
            s[j, t] = hsum(a0) * scale
            if t + 1 < n:
                s[j, t + 1] = hsum(a1) * scale
            if t + 2 < n:
                s[j, t + 2] = hsum(a2) * scale
            if t + 3 < n:
                s[j, t + 3] = hsum(a3) * scale
    for j in range(g):
        m = s[j, 0]
        for t in range(1, n):
            m = max(m, s[j, t])
        total = np.float32(0)
        for t in range(n):
            e = exp(s[j, t] - m)
            s[j, t] = e
            total += e
        mx[j], sm[j] = m, total
        sj, oj = s[j], out[j]
        for c in range(0, hd, 8):
            a0 = a1 = a2 = a3 = fsplat(np.float32(0))
            for t in range(0, n - 3, 4):
                a0 = fma(fsplat_at(sj, t), vload(v, rows[t] + c), a0)
                a1 = fma(fsplat_at(sj, t + 1), vload(v, rows[t + 1] + c), a1)
                a2 = fma(fsplat_at(sj, t + 2), vload(v, rows[t + 2] + c), a2)
                a3 = fma(fsplat_at(sj, t + 3), vload(v, rows[t + 3] + c), a3)
            for t in range(n - n % 4, n):
                a0 = fma(fsplat_at(sj, t), vload(v, rows[t] + c), a0)
            fstore(oj, c, fadd(fadd(a0, a1), fadd(a2, a3)))


@njit(**_OPTS)
def paged_tails(q, k, v, tables, lens, out, mx, sm):
    """Unnormalised attention of each sequence's own few tokens (after a prefix shared with the
    others): q [kvh, B, g, hd] (scaled) of sequence b over the first lens[b] (>= 1) tokens of
    its table tables[b], pool layers k/v as _attend's; out [kvh, B, g, hd], row max mx and row
    sum sm [kvh, B, g, 1]. Parallel over (sequence, kv head); the tails are short."""
    kvh, B, g, hd = q.shape
    for job in prange(B * kvh):
        b, h = job // kvh, job % kvh
        s = np.empty((g, lens[b]), np.float32)
        _attend(q[h, b], k, v, h, tables[b], lens[b], np.float32(1), s, out[h, b], mx[h, b, :, 0], sm[h, b, :, 0])


# Single-threaded fused element-wise kernels: one pass where numpy makes several (and
# temporaries), for prefill's memory-bound steps. No parallel workers: no interplay with BLAS.
_SERIAL = dict(fastmath=True, boundscheck=False, cache=True, nogil=True)


@njit(**_SERIAL)
def rmsnorm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, row by row."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        r = np.float32(1.0 / np.sqrt(ss / D + eps))
        for d in range(D):
            out[t, d] = x[t, d] * r * w[d]


@njit(**_SERIAL, error_model="numpy")  # a float division that raises on zero does not vectorise
def silu_mul(gu, f, out, by_rows):
    """out = silu(gate) * up, one pass where numpy makes five. gu (C-contiguous) holds gate then
    up: along its rows when by_rows (a prefill pass's transposed [2f, T] matmul output; out
    [f, T]), else along each row ([T, 2f]; out [T, f]). sigmoid from exp(-|gate|): the
    vectorising exp takes x <= 0."""
    dr, dc = (f, 0) if by_rows else (0, f)  # up's offset from gate: the C-contiguous array is
    R, C = out.shape  # indexed as it is, so the inner loop runs on vectors
    one = np.float32(1)
    for r in range(R):
        for c in range(C):
            a = gu[r, c]
            e = exp(-abs(a))
            s = one / (one + e)
            out[r, c] = a * (s if a >= 0 else e * s) * gu[r + dr, c + dc]


@register_jitable
def _rotate(x, t, j, i0, i1, c, s):
    a, b = x[t, j, i0], x[t, j, i1]
    x[t, j, i0] = a * c - b * s
    x[t, j, i1] = b * c + a * s


@register_jitable
def _rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the halves (i, i + hd/2) (NEOX)
    or the adjacent pairs (2i, 2i+1) (llama.cpp's "normal" order). x may be a view of a
    prefill pass's transposed matmul output, tokens adjacent in memory: the loops then run
    along the tokens (along the head dimension, every element was a cache line of its own)."""
    T, n_heads, hd = x.shape
    half = hd // 2
    if x.strides[0] < x.strides[2]:
        for j in range(n_heads):
            for i in range(half):
                i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                for t in range(T):
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])
    else:
        for t in range(T):
            for j in range(n_heads):
                for i in range(half):
                    i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])


@njit(**_SERIAL)
def rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the adjacent pairs (2i, 2i+1)
    (llama.cpp's "normal" order) when pairs, else the halves (NEOX order). One kernel for both
    orders: each compiled kernel costs a start its own cache load."""
    _rope(x, cos, sin, pairs)


@njit(**_SERIAL)
def causal_max(s, tq, first, window):
    """Scores s [kvh, g*tq, n] of a causal query block, rows ordered (group, query): query i sees
    keys 0 .. first+i, and with window > 0 only the last `window` of those (a sliding window).
    Subtracts each row's maximum over the keys it sees and sets the rest to -inf (exp gives 0),
    in one pass instead of numpy's mask add, max and subtract."""
    kvh, rows, n = s.shape
    ninf = np.float32(-np.inf)
    for h in range(kvh):
        for row in range(rows):
            end = min(n, first + row % tq + 1)
            lo = max(0, end - window) if window > 0 else 0
            m = ninf
            for j in range(lo, end):
                m = max(m, s[h, row, j])
            for j in range(lo, end):
                s[h, row, j] -= m
            for j in range(lo):
                s[h, row, j] = ninf
            for j in range(end, n):
                s[h, row, j] = ninf


# ---------------------------------------------------------------- decode attention


@intrinsic
def _half_to_float(typingctx, bits):
    """An IEEE half float, given as its uint16 bits, as float32 (numba has no float16 on the
    CPU; LLVM turns a loop of these into F16C conversions)."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _f32(x):
    """A K/V element as float32: float32 as is, uint16 as the bits of a half float."""


@overload(_f32, jit_options={"fastmath": True})
def _f32_impl(x):
    if isinstance(x, types.Integer):
        return lambda x: _half_to_float(x)
    return lambda x: np.float32(x)


def _decode_attention(q, k, v, tables, lens, scale, out, scores):
    """Attention of one query token per sequence: q [B, H, hd] over the first lens[b] tokens
    of sequence b's K/V, read through its block table tables[b] from the pool layers k, v
    (as _attend's); out [B, H, hd]. scores [B * kv_heads, H / kv_heads, >= max(lens)] is
    scratch. Over (sequence, kv head), in parallel or not (two builds below)."""
    B, H, hd = q.shape
    kvh = k.shape[2]
    g = H // kvh
    for job in prange(B * kvh):
        b, h = job // kvh, job % kvh
        mx, sm = np.empty(g, np.float32), np.empty(g, np.float32)
        rows = out[b, h * g : (h + 1) * g]
        _attend(q[b, h * g : (h + 1) * g], k, v, h, tables[b], lens[b], scale, scores[job], rows, mx, sm)
        for j in range(g):
            inv = np.float32(1) / sm[j]
            for d in range(hd):
                rows[j, d] *= inv


# A parallel region costs more than a short context's attention: both builds, chosen by size.
decode_attention = njit(**_OPTS)(_decode_attention)
decode_attention_serial = njit(**_SERIAL)(_decode_attention)
