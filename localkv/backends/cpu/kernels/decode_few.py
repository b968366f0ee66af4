"""A decode group of few query rows (at most 4: one sequence of a model with up to 4 query heads
per kv head, SmolLM2's 3 and Llama 3.2's 4): the same bits as the 8-row tiles of
kernels/attention, with the lanes on what there is more of.

The tiles of attention._scores put query rows in the lanes and broadcast the keys: with 3 rows,
5 of 8 lanes are padding. Here each chunk's K rows are converted and stored transposed (8 x 8
blocks, simd/transpose), so 16 keys fill a vector and the few rows are the broadcasts: each
score is still the FMAs over the head dimension in order from 0 (fma(k, q, s) is fma(q, k, s)),
so the same score. The softmax step runs per row over the keys in their order, the weights'
sum added key by key as the lanes added it; the weighted values run along hd with V read as
stored (_accumulate_rows). Every value is attention._softmax_step's and _accumulate's.
"""

import llvmlite.binding as llvm
from numba import types
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels.attention import KEYS, exp
from localkv.backends.cpu.kernels.key_scores import ROWS  # the rows of a group this path takes
from localkv.backends.cpu.kernels.pool_rows import block_values, quant_bytes, rload
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import (
    fadd,
    fload,
    fma,
    fmax,
    fsplat,
    fsplat_at,
    fstore,
    fweights,
    fzero,
    lane,
    wload,
    wsplat_at,
)
from localkv.backends.cpu.simd.transpose import tstore8
from localkv.backends.cpu.simd.u8x32 import half
from localkv.backends.cpu.simd.x16 import hload16, load16, q4load16, q8load16, zero16
from localkv.kv_format import QK

# 64 values of hd for 4 rows held in 16 registers: only where AVX-512 has 32 of them (AVX2's 16
# would spill); elsewhere 16 values at a time on 8-lane vectors
WIDE = bool(llvm.get_host_cpu_features().get("avx512f"))


@register_jitable(**NO_NRT)
def _key(pool, offs, n, t, d):
    """Values d .. d + 7 of key t of a chunk as float32; zeros for a key past its n."""
    return rload(pool, offs[t], d) if t < n else fzero()


def rload16(a, row, d):
    """pool_rows.rload's values d .. d + 15 (d a multiple of 16) as an F32x16: the same floats
    (each conversion is exact), 16 at a time."""


@overload(rload16, jit_options={"fastmath": True, **NO_NRT})
def _rload16_impl(a, row, d):
    last, nbytes = a.ndim - 1, quant_bytes(a)
    if nbytes:

        def quantized(a, row, d):
            at = row * a.shape[last] + d // QK * nbytes
            return block_values16(a, at, d % QK, half(a, at))

        return quantized
    if a.dtype == types.uint16:
        return lambda a, row, d: hload16(a, row * a.shape[last] + d)
    return lambda a, row, d: load16(a, row * a.shape[last] + d)


def block_values16(a, at, j, s):
    """pool_rows.block_values' values j .. j + 15 (j 0 or 16) of the block at byte `at`."""


@overload(block_values16, inline="always")
def _block_values16_impl(a, at, j, s):
    if a.dtype == types.int8:
        return lambda a, at, j, s: q8load16(a, at + 2 + j, s)
    # values 0-15 of a q4_0 block are its 16 bytes' low nibbles, 16-31 their high ones
    return lambda a, at, j, s: q4load16(a, at + 2, j // 16 * 4, s)


def rows_t(pool, offs, n, kt, hd):
    """kt [hd * KEYS] = the pool rows offs[:n] as float32, transposed (kt[d * KEYS + t] is value
    d of key t); zeros for the keys after them."""


@overload(rows_t, jit_options={"fastmath": True, **NO_NRT})
def _rows_t_impl(pool, offs, n, kt, hd):
    last, nbytes = pool.ndim - 1, quant_bytes(pool)
    if not nbytes:

        def floats(pool, offs, n, kt, hd):
            for t in range(0, KEYS, 8):
                if t + 8 > n:
                    _tail_t(pool, offs, n, kt, hd, t)
                    continue
                for d in range(0, hd, 8):
                    tstore8(
                        kt, d * KEYS + t, KEYS,
                        rload(pool, offs[t], d), rload(pool, offs[t + 1], d),
                        rload(pool, offs[t + 2], d), rload(pool, offs[t + 3], d),
                        rload(pool, offs[t + 4], d), rload(pool, offs[t + 5], d),
                        rload(pool, offs[t + 6], d), rload(pool, offs[t + 7], d),
                    )  # fmt: skip

        return floats

    def quantized(pool, offs, n, kt, hd):  # each block's 8 scales read once, not once per 8 values
        row = pool.shape[last]
        for t in range(0, KEYS, 8):
            if t + 8 > n:
                _tail_t(pool, offs, n, kt, hd, t)
                continue
            for b in range(hd // QK):
                a0, a1, a2, a3 = offs[t] * row, offs[t + 1] * row, offs[t + 2] * row, offs[t + 3] * row
                a4, a5, a6, a7 = offs[t + 4] * row, offs[t + 5] * row, offs[t + 6] * row, offs[t + 7] * row
                a0, a1, a2, a3 = a0 + b * nbytes, a1 + b * nbytes, a2 + b * nbytes, a3 + b * nbytes
                a4, a5, a6, a7 = a4 + b * nbytes, a5 + b * nbytes, a6 + b * nbytes, a7 + b * nbytes
                s0, s1, s2, s3 = half(pool, a0), half(pool, a1), half(pool, a2), half(pool, a3)
                s4, s5, s6, s7 = half(pool, a4), half(pool, a5), half(pool, a6), half(pool, a7)
                for j in range(0, QK, 8):
                    tstore8(
                        kt, (b * QK + j) * KEYS + t, KEYS,
                        block_values(pool, a0, j, s0), block_values(pool, a1, j, s1),
                        block_values(pool, a2, j, s2), block_values(pool, a3, j, s3),
                        block_values(pool, a4, j, s4), block_values(pool, a5, j, s5),
                        block_values(pool, a6, j, s6), block_values(pool, a7, j, s7),
                    )  # fmt: skip

    return quantized


@register_jitable(**NO_NRT)
def _tail_t(pool, offs, n, kt, hd, t):
    """rows_t's 8 keys from t, where the chunk's n keys end among them."""
    for d in range(0, hd, 8):
        tstore8(
            kt, d * KEYS + t, KEYS,
            _key(pool, offs, n, t, d), _key(pool, offs, n, t + 1, d),
            _key(pool, offs, n, t + 2, d), _key(pool, offs, n, t + 3, d),
            _key(pool, offs, n, t + 4, d), _key(pool, offs, n, t + 5, d),
            _key(pool, offs, n, t + 6, d), _key(pool, offs, n, t + 7, d),
        )  # fmt: skip


@register_jitable(**NO_NRT)
def scores_t(kt, gq, r8, st, hd):
    """st [ROWS * KEYS]: the scores of query rows 0-3 of gq [hd, r8] (queries transposed,
    scaled) for the chunk's keys kt (rows_t), st[r * KEYS + t] for key t: 32 keys x 4 rows in
    registers, one FMA per key lane and row per value of hd."""
    z = zero16()
    for t in range(0, KEYS, 32):
        a0 = a1 = b0 = b1 = c0 = c1 = e0 = e1 = z
        for d in range(hd):
            x0, x1, w = wload(kt, d * KEYS + t, z), wload(kt, d * KEYS + t + 16, z), d * r8
            wa, wb, wc, we = (
                wsplat_at(gq, w, z),
                wsplat_at(gq, w + 1, z),
                wsplat_at(gq, w + 2, z),
                wsplat_at(gq, w + 3, z),
            )
            a0, a1, b0, b1 = fma(x0, wa, a0), fma(x1, wa, a1), fma(x0, wb, b0), fma(x1, wb, b1)
            c0, c1, e0, e1 = fma(x0, wc, c0), fma(x1, wc, c1), fma(x0, we, e0), fma(x1, we, e1)
        for r, (lo, hi) in enumerate(((a0, a1), (b0, b1), (c0, c1), (e0, e1))):
            fstore(st, r * KEYS + t, lo)
            fstore(st, r * KEYS + t + 16, hi)


@register_jitable(**NO_NRT)
def softmax_t(st, n, o, m, total, rows):
    """attention._softmax_step on st [ROWS * KEYS] (keys in lanes) for the first `rows` rows:
    the row maximum of the n keys, the rescale where it grows, the weights (fweights) and their
    sum in key order; weights 0 past n and in the padding rows. The maximum is the same value
    whichever order the keys are compared in; the 4 rows' sums run side by side, each still
    adding its keys one by one in order."""
    for r in range(ROWS):
        base = r * KEYS
        if r >= rows:
            for t in range(KEYS):
                st[base + t] = 0
            continue
        top = _top(st, base, n)
        if top > m[r]:
            a = exp(m[r] - top)
            for d in range(o.shape[1]):
                o[r, d] *= a
            total[r] *= a
            m[r] = top
        m8 = fsplat(m[r])
        for t in range(0, KEYS, 8):
            fstore(st, base + t, fweights(fload(st, base + t), m8))
        for t in range(n, KEYS):
            st[base + t] = 0
    s0, s1, s2, s3 = total[0], total[1], total[2], total[3]
    for t in range(n):
        s0 += st[t]
        s1 += st[KEYS + t]
        s2 += st[2 * KEYS + t]
        s3 += st[3 * KEYS + t]
    for r, s in enumerate((s0, s1, s2, s3)):
        if r < rows:
            total[r] = s


@register_jitable(**NO_NRT)
def _top(st, base, n):
    """The largest of st[base : base + n] (n >= 1): 8 keys a lane, then the lanes and the rest."""
    whole = n // 8 * 8
    top = st[base]
    if whole:
        t8 = fload(st, base)
        for t in range(8, whole, 8):
            t8 = fmax(t8, fload(st, base + t))
        for i in range(8):
            if lane(t8, i) > top:
                top = lane(t8, i)
    for t in range(whole, n):
        if st[base + t] > top:
            top = st[base + t]
    return top


@register_jitable(**NO_NRT)
def accumulate_rows(st, ts, rs, v, offs, n, o, rows):
    """attention._accumulate's sums for the first `rows` rows of o [r8, hd] (rows <= r8 / 2),
    the weight of key t for row r at st[t * ts + r * rs], with 64 (WIDE) or 16 of hd for 4 rows
    in registers and V read from the pool as stored, each of its values converted once for the
    4: each value still gains its n weighted values in key order, so its bits are _accumulate's
    (which adds the chunk's padding keys as + 0: so does _store, which only makes a -0 +0).
    Rows past `rows` up to a multiple of 4 are padding rows of o, summed and unread."""
    hd = o.shape[1]
    pad = n < KEYS
    for r in range(0, rows, 4):
        d = 0
        if WIDE:
            while d + 64 <= hd:
                _accumulate64(st, ts, rs, v, offs, n, o, r * hd + d, d, r * rs, pad)
                d += 64
        while d + 16 <= hd:
            _accumulate16(st, ts, rs, v, offs, n, o, r * hd + d, d, r * rs, pad)
            d += 16
        if d < hd:  # the last 8 of a head size that is an odd multiple of 8
            for j in range(r, r + 4):
                a = fload(o, j * hd + d)
                for t in range(n):
                    a = fma(fsplat_at(st, t * ts + j * rs), rload(v, offs[t], d), a)
                _store(o, j * hd + d, a, pad, fzero())


@register_jitable(**NO_NRT)
def _accumulate64(st, ts, rs, v, offs, n, o, at, d, w0, pad):
    """accumulate_rows' values d .. d + 63 of 4 rows (o's from flat offset at, one row every
    hd) on 16-lane vectors: 16 accumulators, each key's 64 values and 4 weights loaded once."""
    hd, z = o.shape[1], zero16()
    a0, a1, a2, a3 = wload(o, at, z), wload(o, at + 16, z), wload(o, at + 32, z), wload(o, at + 48, z)
    at1 = at + hd
    b0, b1, b2, b3 = wload(o, at1, z), wload(o, at1 + 16, z), wload(o, at1 + 32, z), wload(o, at1 + 48, z)
    at2 = at1 + hd
    c0, c1, c2, c3 = wload(o, at2, z), wload(o, at2 + 16, z), wload(o, at2 + 32, z), wload(o, at2 + 48, z)
    at3 = at2 + hd
    e0, e1, e2, e3 = wload(o, at3, z), wload(o, at3 + 16, z), wload(o, at3 + 32, z), wload(o, at3 + 48, z)
    for t in range(n):
        row, w = offs[t], t * ts + w0
        x0, x1, x2, x3 = rload16(v, row, d), rload16(v, row, d + 16), rload16(v, row, d + 32), rload16(v, row, d + 48)
        wa, wb = wsplat_at(st, w, z), wsplat_at(st, w + rs, z)
        wc, we = wsplat_at(st, w + 2 * rs, z), wsplat_at(st, w + 3 * rs, z)
        a0, a1, a2, a3 = fma(wa, x0, a0), fma(wa, x1, a1), fma(wa, x2, a2), fma(wa, x3, a3)
        b0, b1, b2, b3 = fma(wb, x0, b0), fma(wb, x1, b1), fma(wb, x2, b2), fma(wb, x3, b3)
        c0, c1, c2, c3 = fma(wc, x0, c0), fma(wc, x1, c1), fma(wc, x2, c2), fma(wc, x3, c3)
        e0, e1, e2, e3 = fma(we, x0, e0), fma(we, x1, e1), fma(we, x2, e2), fma(we, x3, e3)
    for j, x in enumerate(((a0, a1, a2, a3), (b0, b1, b2, b3), (c0, c1, c2, c3), (e0, e1, e2, e3))):
        for i in range(4):
            _store(o, at + j * hd + 16 * i, x[i], pad, z)


@register_jitable(**NO_NRT)
def _accumulate16(st, ts, rs, v, offs, n, o, at, d, w0, pad):
    """accumulate_rows' values d .. d + 15 of 4 rows on 8-lane vectors."""
    hd = o.shape[1]
    a0, a1, b0, b1 = fload(o, at), fload(o, at + 8), fload(o, at + hd), fload(o, at + hd + 8)
    c0, c1 = fload(o, at + 2 * hd), fload(o, at + 2 * hd + 8)
    e0, e1 = fload(o, at + 3 * hd), fload(o, at + 3 * hd + 8)
    for t in range(n):
        x0, x1, w = rload(v, offs[t], d), rload(v, offs[t], d + 8), t * ts + w0
        wa, wb = fsplat_at(st, w), fsplat_at(st, w + rs)
        wc, we = fsplat_at(st, w + 2 * rs), fsplat_at(st, w + 3 * rs)
        a0, a1, b0, b1 = fma(wa, x0, a0), fma(wa, x1, a1), fma(wb, x0, b0), fma(wb, x1, b1)
        c0, c1, e0, e1 = fma(wc, x0, c0), fma(wc, x1, c1), fma(we, x0, e0), fma(we, x1, e1)
    for j, (x0, x1) in enumerate(((a0, a1), (b0, b1), (c0, c1), (e0, e1))):
        _store(o, at + j * hd, x0, pad, fzero())
        _store(o, at + j * hd + 8, x1, pad, fzero())


@register_jitable(**NO_NRT)
def _store(o, at, a, pad, z):
    """o[at:] = a (8 or 16 lanes, as the zero z), plus 0 after a chunk of fewer than KEYS keys
    (accumulate_rows)."""
    fstore(o, at, fadd(a, z) if pad else a)
