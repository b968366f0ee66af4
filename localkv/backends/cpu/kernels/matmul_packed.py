"""matmul_out (a decode step's few activation rows) for Q4_0, Q4_1 and Q8_0 read from their
packed form (formats/packed: 16 weight rows interleaved per block): matmul_lanes' bits for
each row, with 16 weight rows in the lanes.

Why: matmul_out decodes each weight row's groups one by one and sums each dot across its 8
lanes (quad_sums, halves) before a group's float step, so a decode step ran compute-bound
well under the memory's speed (BENCHMARKS.md, "One scale per 32-value group"). Packed, one
64-byte load holds 4 weights of 16 rows, one vpdpbusd multiplies them with 4 broadcast
activations (simd/packed16), and a group's 16 integer dots come out in the lanes with no
sum across them; the scales of the 16 rows are one load. Then matmul_few.group_step's float
ops per lane, in walk's order: lane n gets the sums matmul_out's lane for weight row n gets,
so the same bits (tests/backends/test_matmul_packed.py).
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.formats.blocks import OFFSET
from localkv.backends.cpu.formats.packed import GROUP
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import PREFETCH, chunk, chunks, one_scale_step, quantized, walk_from
from localkv.backends.cpu.kernels.superblock_packed import _store, group_bytes
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fadd, fmul
from localkv.backends.cpu.simd.packed16 import q4_dots16, q8_dots16
from localkv.backends.cpu.simd.u8x32 import prefetch
from localkv.backends.cpu.simd.x16 import hload16, splat16, zero16

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def block(qt, p, o, xq, xoffs):
    """(the integer dots of the packed block at byte o . xq[x:] for each x of xoffs, its 16
    rows' d, m): Q4_0's and Q8_0's m is formats.blocks.OFFSET times d, as scales8 makes it."""


@overload(block, inline="always")
def _block(qt, p, o, xq, xoffs):
    if qt.qname == "Q4_1":
        return lambda qt, p, o, xq, xoffs: (q4_dots16(p, o, xq, xoffs), hload16(p, o + 256), hload16(p, o + 288))
    k = np.float32(OFFSET[qt.qname])
    dots, at = (q4_dots16, 256) if qt.qname == "Q4_0" else (q8_dots16, 512)

    def offset_min(qt, p, o, xq, xoffs):
        d = hload16(p, o + at)
        return dots(p, o, xq, xoffs), d, fmul(splat16(k), d)

    return offset_min


@register_jitable(**NO_NRT)
def _row_step(i, d, mn, dx, xs16, r, g, a, m):
    """group_step of activation row r for group g's 16 dots i."""
    return one_scale_step(i, d, mn, splat16(dx[r, g]), splat16(xs16[r, 2 * g]), a, m)


@register_jitable(**NO_NRT)
def _step1(qt, p, blk, j, g, inp, a, m):
    """matmul_few.walk_from's step for activation row r (inp: the row group's byte base,
    quantized()'s xq, dx, xs16, and r; blk, j: the file's, unused): group g of the row
    group into the 1-tuples a and m."""
    base, xq, dx, xs16, r = inp
    o = base + g * group_bytes(qt)
    prefetch(p, o + PREFETCH)
    (i0,), d, mn = block(qt, p, o, xq, (r * xq.shape[1] + 32 * g,))
    a0, m0 = _row_step(i0, d, mn, dx, xs16, r, g, a[0], m[0])
    return (a0,), (m0,)


@register_jitable(**NO_NRT)
def _step4(qt, p, blk, j, g, inp, a, m):
    """_step1 for activation rows r .. r + 3, each block unpacked once for the four."""
    base, xq, dx, xs16, r = inp
    o = base + g * group_bytes(qt)
    prefetch(p, o + PREFETCH)
    K = xq.shape[1]
    x0 = r * K + 32 * g
    (i0, i1, i2, i3), d, mn = block(qt, p, o, xq, (x0, x0 + K, x0 + 2 * K, x0 + 3 * K))
    a0, m0 = _row_step(i0, d, mn, dx, xs16, r, g, a[0], m[0])
    a1, m1 = _row_step(i1, d, mn, dx, xs16, r + 1, g, a[1], m[1])
    a2, m2 = _row_step(i2, d, mn, dx, xs16, r + 2, g, a[2], m[2])
    a3, m3 = _row_step(i3, d, mn, dx, xs16, r + 3, g, a[3], m[3])
    return (a0, a1, a2, a3), (m0, m1, m2, m3)


@register_jitable(**NO_NRT)
def _rows(step, qt, p, base, xq, dx, xs16, r, z, out, col, n0, n1):
    """Activation rows r .. r + len(z) - 1 (step's: 1 or 4) against the row group at byte base
    of p, in walk's order (walk_from); each row's 16 outputs stored."""
    a0, a1, m0, m1 = walk_from(step, qt, p, 0, (base, xq, dx, xs16, r), dx.shape[1], z)
    for k in range(len(z)):
        _store(out, r + k, col, n0, n1, fadd(fadd(a0[k], a1[k]), fadd(m0[k], m1[k])))


@njit(**EXACT_PAR)
def matmul_packed(qt, x, ws, packs, offs, out):
    """matmul_out(qt, x, ws, offs, out) with each weight of ws read from its packed form in
    packs (formats/packed.pack; a [0, 1] array for unused slots): a work chunk's 16 rows are
    one row group, walked by 4 activation rows at a time (each block unpacked once for them),
    then by the rest one at a time (in L1 by then)."""
    xq, dx, xs16 = quantized(x, 32)
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        p = packs[i]
        base = (n0 // GROUP) * p.shape[1]
        R = x.shape[0]
        z = zero16()
        for r in range(0, R - R % 4, 4):
            _rows(_step4, qt, p, base, xq, dx, xs16, r, (z, z, z, z), out, col, n0, n1)
        for r in range(R - R % 4, R):
            _rows(_step1, qt, p, base, xq, dx, xs16, r, (z,), out, col, n0, n1)
