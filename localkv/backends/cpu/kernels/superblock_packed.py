"""superblock.matmul_rows (Q4_K and Q6_K) on packed weights (formats/packed): 16 weight rows in
the lanes, the same bits for every row.

Why: superblock's row kernel reduces each super-block's integer sums across a vector and steps
its floats one output at a time, and unpacks the 6-bit scales per weight row per step: a
decode row ran at half the memory's speed and a 9-row verify pass cost 6 rows. Here a
super-block of 16 weight rows gives 16 exact integers in the lanes (simd/grouped), and
superblock._step's float ops run once per lane: `acc + float(i) * (d * dx)` and
`low + float(m) * (dmin * dx)` in super-block order, `acc - low` at the end. The integers
are exact, so every lane is the row kernel's output, bit for bit
(tests/backends/test_superblock_packed.py).

A work item is one packed row group (16 weight rows, matmul_few.CHUNK); each activation row
runs over its super-blocks in order, so a pass of a few rows reads the group's bytes from
memory once and from the caches after.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.formats.packed import GROUP, GROUP_BYTES
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import CHUNK, _quantize, chunk, chunks
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fadd, fmul, fstore, fsub, lane, tofloat
from localkv.backends.cpu.simd.grouped import gather32, hload16, q4k_group, q6k_group
from localkv.backends.cpu.simd.u8x32 import at, band, bor, half, prefetch, shl, shr
from localkv.backends.cpu.simd.x16 import splat16, zero16

if GROUP != CHUNK:
    raise ImportError("a packed row group must be one work chunk")
SERIAL_PREP = 4  # up to this many rows the activations are prepared on the calling thread
PREFETCH = 4096  # bytes ahead in the packed weights


def group_bytes(qt):
    """GROUP_BYTES of qt's type, a constant."""


@overload(group_bytes, inline="always")
def _group_bytes(qt):
    k = GROUP_BYTES[qt.qname]
    return lambda qt: k


def sum_pairs(qt):
    """The activations' int16 sum pairs per super-block: Q4_K's 4 (per 32), Q6_K's 8 (per 16)."""


@overload(sum_pairs, inline="always")
def _sum_pairs(qt):
    k = 4 if qt.qname == "Q4_K" else 8
    return lambda qt: k


def ints(qt, p, off, xq, xoffs, xs, xsoffs):
    """simd/grouped's integers of qt's type, for the activation rows of the tuples."""


@overload(ints, inline="always")
def _ints(qt, p, off, xq, xoffs, xs, xsoffs):
    if qt.qname == "Q4_K":
        return lambda qt, p, off, xq, xoffs, xs, xsoffs: q4k_group(p, off, xq, xoffs, xs, xsoffs)
    return lambda qt, p, off, xq, xoffs, xs, xsoffs: q6k_group(p, off, xq, xoffs, xs, xsoffs)


def scales16(qt, p, off, dx):
    """superblock.scales for the 16 rows: (d * dx, dmin * dx) for Q4_K, (d * dx, 32 d * dx) for Q6_K."""


@overload(scales16, inline="always")
def _scales16(qt, p, off, dx):
    if qt.qname == "Q4_K":
        return lambda qt, p, off, dx: (fmul(hload16(p, off + 2304), dx), fmul(hload16(p, off + 2336), dx))

    def q6k(qt, p, off, dx):
        s = fmul(hload16(p, off + 3328), dx)
        return s, fmul(splat16(np.float32(32)), s)

    return q6k


def packed_ints(qt, p, o, n, j):
    """formats.k_ints of row n's group j from the packed super-block at byte o of p: (u, the
    integer scales of its two 16-value halves, the integer factors of their sums)."""


@overload(packed_ints, jit_options=NO_NRT)
def _packed_ints(qt, p, o, n, j):
    if qt.qname == "Q4_K":

        def q4k(qt, p, o, n, j):
            u = band(shr(gather32(p, o + 512 * (j >> 1) + 4 * n, 64), 4 * (j & 1)), 15)
            pair = 32 * (j >> 1) + 2 * n + (j & 1)
            sc, mn = np.int32(at(p, o + 2048 + pair)), np.int32(at(p, o + 2176 + pair))
            return u, sc, sc, mn, mn

        return q4k

    def q6k(qt, p, o, n, j):
        h, r = j >> 2, j & 3
        lo = band(shr(gather32(p, o + 64 * (16 * h + 8 * (r & 1)) + 4 * n, 64), 4 * (r >> 1)), 15)
        hi = band(shr(gather32(p, o + 2048 + 512 * h + 4 * n, 64), 2 * r), 3)
        sa = (np.int32(at(p, o + 3072 + 32 * j + 2 * n)) ^ 128) - 128
        sb = (np.int32(at(p, o + 3073 + 32 * j + 2 * n)) ^ 128) - 128
        return bor(lo, shl(hi, 4)), sa, sb, sa, sb

    return q6k


def row_scales16(qt, p, o, n, dx):
    """superblock.scales of row n of the packed super-block at byte o of p for 16 activation
    rows (dx their scales, F32x16): (d * dx, dmin * dx), Q6_K's (d * dx, 32 d * dx)."""


@overload(row_scales16, inline="always")
def _row_scales16(qt, p, o, n, dx):
    if qt.qname == "Q4_K":
        return lambda qt, p, o, n, dx: (
            fmul(splat16(half(p, o + 2304 + 2 * n)), dx),
            fmul(splat16(half(p, o + 2336 + 2 * n)), dx),
        )

    def q6k(qt, p, o, n, dx):
        s = fmul(splat16(half(p, o + 3328 + 2 * n)), dx)
        return s, fmul(splat16(np.float32(32)), s)

    return q6k


@register_jitable(**NO_NRT)
def _prepare(qt, x, xq, dx, xs16, xs, r):
    """Row r's int8 activations (superblock's, per 256) and their sum pairs per group into xs."""
    _quantize(x[r : r + 1], xq[r : r + 1], dx[r : r + 1], xs16[r : r + 1], 256)
    n = 256 // (2 * sum_pairs(qt))  # values per summed group
    for q in range(xs.shape[1]):
        lo, hi = 0, 0
        for i in range(n):
            lo += xq[r, 2 * n * q + i]
            hi += xq[r, 2 * n * q + n + i]
        xs[r, q] = (lo & 0xFFFF) | (hi << 16)


@register_jitable(**NO_NRT)
def _row(qt, p, base, nb, xq, xs, dx, r):
    """One activation row against the group at byte base of p: 16 outputs."""
    gb, pairs, K = group_bytes(qt), sum_pairs(qt), xq.shape[1]
    acc, low = zero16(), zero16()
    for b in range(nb):
        o = base + b * gb
        for k in range(0, gb, 64):
            prefetch(p, o + PREFETCH + k)
        i, m = ints(qt, p, o, xq, (r * K + 256 * b,), xs, (r * xs.shape[1] + pairs * b,))
        acc, low = _step(qt, p, o, dx[r, 8 * b], i, m, acc, low)
    return fsub(acc, low)


@register_jitable(**NO_NRT)
def _step(qt, p, o, dx, i, m, acc, low):
    """superblock._step for the 16 lanes: two float32 sums, op by op."""
    s, t = scales16(qt, p, o, splat16(dx))
    return fadd(acc, fmul(tofloat(i), s)), fadd(low, fmul(tofloat(m), t))


@register_jitable(**NO_NRT)
def _rows4(qt, p, base, nb, xq, xs, dx, r):
    """_row for activation rows r..r+3, each super-block's weights unpacked once for the four."""
    gb, pairs, K, S = group_bytes(qt), sum_pairs(qt), xq.shape[1], xs.shape[1]
    a0, a1, a2, a3 = zero16(), zero16(), zero16(), zero16()
    l0, l1, l2, l3 = zero16(), zero16(), zero16(), zero16()
    for b in range(nb):
        o = base + b * gb
        for k in range(0, gb, 64):
            prefetch(p, o + PREFETCH + k)
        xo, so = 256 * b, pairs * b
        i0, m0, i1, m1, i2, m2, i3, m3 = ints(
            qt, p, o, xq, (r * K + xo, (r + 1) * K + xo, (r + 2) * K + xo, (r + 3) * K + xo),
            xs, (r * S + so, (r + 1) * S + so, (r + 2) * S + so, (r + 3) * S + so),
        )  # fmt: skip
        a0, l0 = _step(qt, p, o, dx[r, 8 * b], i0, m0, a0, l0)
        a1, l1 = _step(qt, p, o, dx[r + 1, 8 * b], i1, m1, a1, l1)
        a2, l2 = _step(qt, p, o, dx[r + 2, 8 * b], i2, m2, a2, l2)
        a3, l3 = _step(qt, p, o, dx[r + 3, 8 * b], i3, m3, a3, l3)
    return fsub(a0, l0), fsub(a1, l1), fsub(a2, l2), fsub(a3, l3)


@register_jitable(**NO_NRT)
def _store(out, r, col, n0, n1, v):
    if n1 - n0 == GROUP:
        fstore(out, r * out.shape[1] + col + n0, v)
    else:
        for n in range(n1 - n0):
            out[r, col + n0 + n] = lane(v, n)


@njit(**EXACT_PAR)
def matmul_packed(qt, x, ws, packs, offs, out):
    """superblock.matmul_rows(qt, x, ws, offs, out) with each weight of ws read from its packed
    form in packs (formats/packed.pack; a [0, 1] array for unused slots)."""
    R, K = x.shape
    nb = K // 256
    xq = np.empty((R, K), np.int8)
    dx, xs16 = np.empty((R, K // 32), np.float32), np.empty((R, K // 16), np.float32)
    xs = np.empty((R, nb * sum_pairs(qt)), np.int32)
    if R <= SERIAL_PREP:
        for r in range(R):
            _prepare(qt, x, xq, dx, xs16, xs, r)
    else:
        for r in prange(R):
            _prepare(qt, x, xq, dx, xs16, xs, r)
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        p = packs[i]
        base = (n0 // GROUP) * p.shape[1]
        for r in range(0, R - R % 4, 4):
            v0, v1, v2, v3 = _rows4(qt, p, base, nb, xq, xs, dx, r)
            _store(out, r, col, n0, n1, v0)
            _store(out, r + 1, col, n0, n1, v1)
            _store(out, r + 2, col, n0, n1, v2)
            _store(out, r + 3, col, n0, n1, v3)
        for r in range(R - R % 4, R):
            _store(out, r, col, n0, n1, _row(qt, p, base, nb, xq, xs, dx, r))
