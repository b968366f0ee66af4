"""The kernel of Q4_K and Q6_K weights, a super-block of 256 weights at a time (`simd/wide`), as
llama.cpp's K-quant dots: the sub-block scales multiply in integers and a super-block costs one
float step, where the generic kernel (`matmul_few.matmul_lanes`) pays a float conversion and
scale FMAs for every 32 weights. The activations are those of every K-quant kernel: int8 per
256 values (llama.cpp's Q8_K).

matmul_rows (quant.matmul_rows) takes any number of rows: each super-block's integers reduced
exactly, then float32 sums in super-block order written op by op, so a row's outputs do not
depend on the rows beside it or on the thread split.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.formats.blocks import geometry
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import _quantize, chunk, chunks
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.u8x32 import at, half, prefetch
from localkv.backends.cpu.simd.wide import q4k_sums, q6k_sums

TYPES = ("Q4_K", "Q6_K")  # the types with a super-block kernel
TILE = 32  # activation rows matmul_rows multiplies with a chunk of weight rows while it is in L2
SERIAL_PREP = 4  # up to this many rows the activations are prepared on the calling thread
PREFETCH = 2048  # bytes ahead in the weights, on top of the hardware prefetcher


def sums(qt, w, blk, xa, bs, sbs):
    """The super-block's two exact integers for each activation super-block of the tuple sbs
    (wide.q4k_sums / q6k_sums)."""


@overload(sums, inline="always")
def _sums_ov(qt, w, blk, xa, bs, sbs):
    if qt.qname == "Q4_K":
        return lambda qt, w, blk, xa, bs, sbs: q4k_sums(w, blk, xa, bs, sbs)
    return lambda qt, w, blk, xa, bs, sbs: q6k_sums(w, blk, xa, bs, sbs)


def scales(qt, w, blk, dx):
    """(the float32 factor of the super-block's product sum, that of its offset sum), dx the
    activations' scale: Q4_K's d and dmin, Q6_K's d and 32 d."""


@overload(scales, inline="always")
def _scales_ov(qt, w, blk, dx):
    if qt.qname == "Q4_K":
        return lambda qt, w, blk, dx: (half(w, blk) * dx, half(w, blk + 2) * dx)

    def q6k(qt, w, blk, dx):
        s = half(w, blk + 208) * dx
        return s, np.float32(32) * s

    return q6k


def arrange(qt, xq, xa, bs, r):
    """Row r of the quantized activations xq as the type's block product reads them: into xa
    (Q4_K's nibble order; Q6_K reads xq itself) and bs (int16 sums per 32 / per 16)."""


@overload(arrange, inline="always")
def _arrange_ov(qt, xq, xa, bs, r):
    n = 32 if qt.qname == "Q4_K" else 16

    def by_sums(qt, xq, xa, bs, r):
        K = xq.shape[1]
        if n == 32:
            for b in range(K // 128):
                for i in range(32):
                    o = 128 * b + i
                    xa[r, o], xa[r, o + 32] = xq[r, o], xq[r, o + 64]
                    xa[r, o + 64], xa[r, o + 96] = xq[r, o + 32], xq[r, o + 96]
        for g in range(K // n):
            s = 0
            for i in range(n):
                s += xq[r, n * g + i]
            bs[r, g] = s

    return by_sums


def buffers(qt, xq):
    """(xa, bs) for arrange: fresh arrays for Q4_K, xq itself and the per-16 sums for Q6_K."""


@overload(buffers, inline="always")
def _buffers_ov(qt, xq):
    if qt.qname == "Q4_K":
        return lambda qt, xq: (np.empty(xq.shape, np.int8), np.empty((xq.shape[0], xq.shape[1] // 32), np.int16))
    return lambda qt, xq: (xq, np.empty((xq.shape[0], xq.shape[1] // 16), np.int16))


@register_jitable
def _prepare(qt, x, xq, dx, xs16, xa, bs, r):
    _quantize(x[r : r + 1], xq[r : r + 1], dx[r : r + 1], xs16[r : r + 1], 256)
    arrange(qt, xq, xa, bs, r)


@register_jitable(**NO_NRT)
def _step(qt, w, blk, dx, sb, i, m, acc, low):
    """The float step of one row's super-block sb: two float32 sums, op by op (no fastmath: one
    sequence of roundings whichever kernel runs it)."""
    s, t = scales(qt, w, blk, at(dx, sb * 8))
    return acc + np.float32(i) * s, low + np.float32(m) * t


@register_jitable(**NO_NRT)
def _exact_row(qt, w, base, xa, bs, dx, r, nb):
    """One weight row . activation row r: each super-block's integers exact, then two float32
    sums in super-block order, written out op by op (no fastmath: one sequence of roundings)."""
    _, nbytes = geometry(qt)
    acc, low = np.float32(0), np.float32(0)
    for b in range(nb):
        blk = base + b * nbytes
        for k in range(0, nbytes, 64):
            prefetch(w, blk + PREFETCH + k)
        i, m = sums(qt, w, blk, xa, bs, (r * nb + b,))
        acc, low = _step(qt, w, blk, dx, r * nb + b, i, m, acc, low)
    return acc - low


@register_jitable(**NO_NRT)
def _exact_rows4(qt, w, base, xa, bs, dx, r, nb):
    """_exact_row for activation rows r..r+3, each weight super-block decoded once for the four:
    the same integers and float steps per row, so the same bits."""
    _, nbytes = geometry(qt)
    a0, a1, a2, a3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
    l0, l1, l2, l3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
    for b in range(nb):
        blk = base + b * nbytes
        s0, s1, s2, s3 = r * nb + b, (r + 1) * nb + b, (r + 2) * nb + b, (r + 3) * nb + b
        i0, m0, i1, m1, i2, m2, i3, m3 = sums(qt, w, blk, xa, bs, (s0, s1, s2, s3))
        a0, l0 = _step(qt, w, blk, dx, s0, i0, m0, a0, l0)
        a1, l1 = _step(qt, w, blk, dx, s1, i1, m1, a1, l1)
        a2, l2 = _step(qt, w, blk, dx, s2, i2, m2, a2, l2)
        a3, l3 = _step(qt, w, blk, dx, s3, i3, m3, a3, l3)
    return a0 - l0, a1 - l1, a2 - l2, a3 - l3


@njit(**EXACT_PAR)
def matmul_rows(qt, x, ws, offs, out):
    """out[r, offs[i] + n] = x[r] @ row n of ws[i] (the three matrices ws of one type, a zero-row
    array for unused ones) for any number of rows, each
    output one arithmetic whatever the row count or the thread split (the one-answer rule):
    integer super-block sums, exact in any order, then _exact_row's float steps. A work chunk
    of weight rows is multiplied into TILE activation rows at a time (the weights are read from
    memory once per call), each weight super-block decoded once per 4 rows."""
    R, K = x.shape
    nb = K // 256
    xq = np.empty((R, K), np.int8)
    dx, xs16 = np.empty((R, K // 32), np.float32), np.empty((R, K // 16), np.float32)
    xa, bs = buffers(qt, xq)
    if R <= SERIAL_PREP:
        for r in range(R):
            _prepare(qt, x, xq, dx, xs16, xa, bs, r)
    else:
        for r in prange(R):
            _prepare(qt, x, xq, dx, xs16, xa, bs, r)
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w = ws[i]
        for r0 in range(0, R, TILE):
            r1 = min(R, r0 + TILE)
            for n in range(n0, n1):
                base = n * w.shape[1]
                for r in range(r0, r1 - 3, 4):
                    o0, o1, o2, o3 = _exact_rows4(qt, w, base, xa, bs, dx, r, nb)
                    out[r, col + n], out[r + 1, col + n], out[r + 2, col + n], out[r + 3, col + n] = o0, o1, o2, o3
                for r in range(r1 - (r1 - r0) % 4, r1):
                    out[r, col + n] = _exact_row(qt, w, base, xa, bs, dx, r, nb)
