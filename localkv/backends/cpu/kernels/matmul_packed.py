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

from localkv.backends.cpu.formats.packed import GROUP, GROUP_BYTES
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import PREFETCH, chunk, chunks, one_scale_step, quantized
from localkv.backends.cpu.kernels.superblock_packed import _store
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fadd, fmul
from localkv.backends.cpu.simd.packed16 import q4_dot16, q4_dot16x4, q8_dot16, q8_dot16x4
from localkv.backends.cpu.simd.u8x32 import prefetch
from localkv.backends.cpu.simd.x16 import hload16, splat16, zero16

TYPES = ("Q4_0", "Q4_1", "Q8_0")
_OFFSET = {"Q4_0": -8.0, "Q8_0": -128.0}  # their m = this times d (formats.blocks: exact)


def block(qt, p, o, xq, xo):
    """(the integer dot of the packed block at byte o . xq[xo:], its 16 rows' d, m)."""


@overload(block, inline="always")
def _block(qt, p, o, xq, xo):
    if qt.qname == "Q4_1":
        return lambda qt, p, o, xq, xo: (q4_dot16(p, o, xq, xo), hload16(p, o + 256), hload16(p, o + 288))
    k = np.float32(_OFFSET[qt.qname])
    if qt.qname == "Q4_0":

        def q4_0(qt, p, o, xq, xo):
            d = hload16(p, o + 256)
            return q4_dot16(p, o, xq, xo), d, fmul(splat16(k), d)

        return q4_0

    def q8_0(qt, p, o, xq, xo):
        d = hload16(p, o + 512)
        return q8_dot16(p, o, xq, xo), d, fmul(splat16(k), d)

    return q8_0


def block4(qt, p, o, xq, xo):
    """block for 4 activation rows (xo: their 4 offsets): the weights unpacked once."""


@overload(block4, inline="always")
def _block4(qt, p, o, xq, xo):
    if qt.qname == "Q4_1":
        return lambda qt, p, o, xq, xo: (q4_dot16x4(p, o, xq, *xo), hload16(p, o + 256), hload16(p, o + 288))
    k = np.float32(_OFFSET[qt.qname])
    dot, at = (q4_dot16x4, 256) if qt.qname == "Q4_0" else (q8_dot16x4, 512)

    def offset_min(qt, p, o, xq, xo):
        d = hload16(p, o + at)
        return dot(p, o, xq, *xo), d, fmul(splat16(k), d)

    return offset_min


def group_bytes(qt):
    """GROUP_BYTES of qt's type, a constant."""


@overload(group_bytes, inline="always")
def _group_bytes(qt):
    n = GROUP_BYTES[qt.qname]
    return lambda qt: n


@register_jitable(**NO_NRT)
def _step(qt, p, base, g, xq, dx, xs16, r, a, m):
    o = base + g * group_bytes(qt)
    prefetch(p, o + PREFETCH)
    i, d, mn = block(qt, p, o, xq, r * xq.shape[1] + 32 * g)
    return one_scale_step(i, d, mn, splat16(dx[r, g]), splat16(xs16[r, 2 * g]), a, m)


@register_jitable(**NO_NRT)
def _row(qt, p, base, xq, dx, xs16, r):
    """Activation row r against the row group at byte base of p: its 16 outputs, walk's order
    (group g into accumulator g % 2)."""
    ng = dx.shape[1]
    a0, a1, m0, m1 = zero16(), zero16(), zero16(), zero16()
    for g in range(0, ng - 1, 2):
        a0, m0 = _step(qt, p, base, g, xq, dx, xs16, r, a0, m0)
        a1, m1 = _step(qt, p, base, g + 1, xq, dx, xs16, r, a1, m1)
    if ng % 2:
        a0, m0 = _step(qt, p, base, ng - 1, xq, dx, xs16, r, a0, m0)
    return fadd(fadd(a0, a1), fadd(m0, m1))


@register_jitable(**NO_NRT)
def _step4(qt, p, base, g, xq, dx, xs16, r, acc):
    o = base + g * group_bytes(qt)
    prefetch(p, o + PREFETCH)
    K = xq.shape[1]
    x0 = r * K + 32 * g
    (i0, i1, i2, i3), d, mn = block4(qt, p, o, xq, (x0, x0 + K, x0 + 2 * K, x0 + 3 * K))
    a0, m0, a1, m1, a2, m2, a3, m3 = acc
    a0, m0 = one_scale_step(i0, d, mn, splat16(dx[r, g]), splat16(xs16[r, 2 * g]), a0, m0)
    a1, m1 = one_scale_step(i1, d, mn, splat16(dx[r + 1, g]), splat16(xs16[r + 1, 2 * g]), a1, m1)
    a2, m2 = one_scale_step(i2, d, mn, splat16(dx[r + 2, g]), splat16(xs16[r + 2, 2 * g]), a2, m2)
    a3, m3 = one_scale_step(i3, d, mn, splat16(dx[r + 3, g]), splat16(xs16[r + 3, 2 * g]), a3, m3)
    return a0, m0, a1, m1, a2, m2, a3, m3


@register_jitable(**NO_NRT)
def _rows4(qt, p, base, xq, dx, xs16, r, out, col, n0, n1):
    """_row for activation rows r..r+3, each block's weights unpacked once for the four."""
    ng = dx.shape[1]
    z = zero16()
    e, o = (z, z, z, z, z, z, z, z), (z, z, z, z, z, z, z, z)  # even, odd groups' (a, m) per row
    for g in range(0, ng - 1, 2):
        e = _step4(qt, p, base, g, xq, dx, xs16, r, e)
        o = _step4(qt, p, base, g + 1, xq, dx, xs16, r, o)
    if ng % 2:
        e = _step4(qt, p, base, ng - 1, xq, dx, xs16, r, e)
    _store(out, r, col, n0, n1, fadd(fadd(e[0], o[0]), fadd(e[1], o[1])))
    _store(out, r + 1, col, n0, n1, fadd(fadd(e[2], o[2]), fadd(e[3], o[3])))
    _store(out, r + 2, col, n0, n1, fadd(fadd(e[4], o[4]), fadd(e[5], o[5])))
    _store(out, r + 3, col, n0, n1, fadd(fadd(e[6], o[6]), fadd(e[7], o[7])))


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
        for r in range(0, R - R % 4, 4):
            _rows4(qt, p, base, xq, dx, xs16, r, out, col, n0, n1)
        for r in range(R - R % 4, R):
            _store(out, r, col, n0, n1, _row(qt, p, base, xq, dx, xs16, r))
