"""superblock.matmul_rows (Q4_K and Q6_K) for many activation rows, 16 of them in the lanes of
512-bit vectors: the same bits for every row, several times fewer instructions per row.

Why: matmul_rows multiplies one activation row at a time against a super-block, so each of
its exact integer sums ends in a horizontal reduction and a scalar float step; in a prefill
pass that is most of the time. Here the 16 rows of a block of lanes_inputs(qt, x, 16) share
every instruction: each 4 weights are broadcast and multiplied into the 16 rows at once
(x16.lanes_dot16_7, as matmul_wide), each group's integer scale multiplies 16 integer dots,
and the float step runs on 16 lanes. The integers are exact in any order, and lane r's float
ops are superblock._step's for row r, op by op (a mul then an add, rounded each: no
fastmath), so each row gets matmul_rows' bits (tests/backends/test_superblock_lanes.py).

quant.compiled.every_row gives it a pass's whole blocks of 16 rows where matmul_wide is chosen
(AVX-512 VNNI), the rest to matmul_rows.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import CHUNK, chunk, chunks
from localkv.backends.cpu.quant.formats import geometry, k_ints
from localkv.backends.cpu.simd.f32x8 import fadd, fmul, fsub, lane, tofloat
from localkv.backends.cpu.simd.u8x32 import half, store32
from localkv.backends.cpu.simd.x16 import (
    half_dot16,
    iadd16,
    iload16,
    imadd16,
    isplat16,
    izero16,
    load16,
    splat16,
    zero16,
)

LANES = 16


@njit(**EXACT_PAR)
def lane_sums(xi):
    """The integer sums of each 16 activations of lanes_inputs(qt, x, 16)'s blocks xi: bs
    [blocks, groups * 32] int32, bs[b, 32 g + 16 h + r] = the sum of values 16 h..16 h + 15 of
    group g of row r of block b (what the super-blocks' offsets multiply)."""
    nb, ng = xi.shape[0], xi.shape[1] // 512
    bs = np.zeros((nb, ng * 32), np.int32)
    for b in prange(nb):
        for g in range(ng):
            for h in range(2):
                for k in range(4 * h, 4 * h + 4):
                    for r in range(LANES):
                        o = 512 * g + 64 * k + 4 * r
                        bs[b, 32 * g + 16 * h + r] += xi[b, o] + xi[b, o + 1] + xi[b, o + 2] + xi[b, o + 3]
    return bs


def scales16(qt, w, blk, dx):
    """superblock.scales for 16 rows: (s, t) = the float factors of the integer sums, dx the
    16 rows' activation scales (F32x16)."""


@overload(scales16, inline="always")
def _scales16(qt, w, blk, dx):
    if qt.qname == "Q4_K":
        return lambda qt, w, blk, dx: (fmul(splat16(half(w, blk)), dx), fmul(splat16(half(w, blk + 2)), dx))

    def q6k(qt, w, blk, dx):
        s = fmul(splat16(half(w, blk + 208)), dx)
        return s, fmul(splat16(np.float32(32)), s)

    return q6k


@njit(**EXACT_PAR)
def biased(xi):
    """lanes_inputs' int8 activations plus 128, as uint8 (x ^ 0x80): the unsigned side of the
    products, so that the decoded weights can be the signed side, read from memory."""
    out = np.empty(xi.shape, np.uint8)
    flat, src = out.reshape(-1), xi.reshape(-1)
    for i in prange(len(flat)):
        flat[i] = np.uint8(np.int32(src[i]) + 128)
    return out


@register_jitable(_nrt=False)
def _decode(qt, w, base, nsb, wd, ks, ms, corr):
    """A weight row (from byte base) decoded for the products: its values into wd (one byte
    each, natural order), each 16-value half's integer scale and offset factor into ks and ms,
    and per super-block the integer the activations' +128 adds to the scaled dots, into corr."""
    _, nbytes = geometry(qt)
    for sb in range(nsb):
        blk, c = base + sb * nbytes, 0
        for j in range(8):
            g = 8 * sb + j
            u, ka, kb, ma, mb = k_ints(qt, w, blk, j)
            store32(wd, 32 * g, u)
            ks[2 * g], ks[2 * g + 1], ms[2 * g], ms[2 * g + 1] = ka, kb, ma, mb
            ua, ub = 0, 0
            for i in range(16):
                ua += wd[32 * g + i]
                ub += wd[32 * g + 16 + i]
            c += ka * ua + kb * ub
        corr[sb] = 128 * c


@register_jitable(_nrt=False)
def _group(qt, g, xu, bs, wd, ks, ms, isum, msum):
    """Group g of a decoded weight row into the 16 rows' integer sums."""
    pa, pb = half_dot16(xu, 512 * g, wd, 32 * g), half_dot16(xu, 512 * g + 256, wd, 32 * g + 16)
    sa, sb = iload16(bs, 32 * g), iload16(bs, 32 * g + 16)
    return scaled(qt, isum, msum, pa, pb, sa, sb, ks[2 * g], ks[2 * g + 1], ms[2 * g], ms[2 * g + 1])


def scaled(qt, isum, msum, pa, pb, sa, sb, ka, kb, ma, mb):
    """(isum + pa ka + pb kb, msum + sa ma + sb mb): a group's halves (their dots pa, pb and
    activation sums sa, sb) times their integer factors. Q4_K's halves share theirs: one
    multiply for both (the same integers)."""


@overload(scaled, inline="always")
def _scaled(qt, isum, msum, pa, pb, sa, sb, ka, kb, ma, mb):
    if qt.qname == "Q4_K":
        return lambda qt, isum, msum, pa, pb, sa, sb, ka, kb, ma, mb: (
            imadd16(isum, iadd16(pa, pb), ka, izero16(), 0),
            imadd16(msum, iadd16(sa, sb), ma, izero16(), 0),
        )
    return lambda qt, isum, msum, pa, pb, sa, sb, ka, kb, ma, mb: (
        imadd16(isum, pa, ka, pb, kb),
        imadd16(msum, sa, ma, sb, mb),
    )


@register_jitable(_nrt=False)
def _super(qt, w, blk, sb, xu, bs, dxv, wd, ks, ms, corr, acc, low):
    """Super-block sb of a decoded weight row (its bytes at blk) . the block's 16 rows: exact
    integer sums (the activations' +128 taken back by corr), then superblock._step's float step
    in every lane."""
    g, i, m = 8 * sb, izero16(), izero16()
    for j in range(8):
        i, m = _group(qt, g + j, xu, bs, wd, ks, ms, i, m)
    i = iadd16(i, isplat16(-corr))
    s, t = scales16(qt, w, blk, load16(dxv, 16 * g))
    return fadd(acc, fmul(tofloat(i), s)), fadd(low, fmul(tofloat(m), t))


@njit(**EXACT_PAR)
def matmul_super_lanes(qt, xu, dxv, bs, ws, offs, out):
    """superblock.matmul_rows for lanes_inputs(qt, x, 16)'s blocks, biased (xu) and their
    lane_sums bs (out [16 * blocks, outputs]). Each work chunk's weight rows are decoded once
    into bytes, then pass over every block's activations."""
    nb, ng = xu.shape[0], xu.shape[1] // 512
    nsb = ng // 8
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w = ws[i]
        _, nbytes = geometry(qt)
        wd = np.empty((CHUNK, 32 * ng), np.uint8)
        ks, ms = np.empty((CHUNK, 2 * ng), np.int32), np.empty((CHUNK, 2 * ng), np.int32)
        corr = np.empty((CHUNK, nsb), np.int32)
        for n in range(n0, n1):
            _decode(qt, w, n * w.shape[1], nsb, wd[n - n0], ks[n - n0], ms[n - n0], corr[n - n0])
        for b in range(nb):
            for n in range(n0, n1):
                k = n - n0
                acc, low = zero16(), zero16()
                for sb in range(nsb):
                    blk = n * w.shape[1] + sb * nbytes
                    acc, low = _super(qt, w, blk, sb, xu[b], bs[b], dxv[b], wd[k], ks[k], ms[k], corr[k, sb], acc, low)
                v = fsub(acc, low)
                for r in range(LANES):
                    out[b * LANES + r, col + n] = lane(v, r)
