"""numba kernels on GGUF blocks: the block types' matmul with activation rows in the 8 lanes
of the vectors (matmul_lanes, and the activations it reads: lanes_inputs), the pieces the other
lanes kernels share with it (the work chunks, walk), and the dequantization of weight rows to
float32 (embedding lookups, the numpy path's tiles).

Integer products on int8 activations, not float FMAs on unpacked weights. The activations are
quantized like llama.cpp's Q8_0 (per 32 values, scale amax/127; per 256 for the K-quants, as
Q8_K); a group of 32 weights then costs one packed unsigned x signed byte multiply-add
(`u8x32.dot`: vpdpbusd with VNNI, vpmaddubsw + vpmaddwd on AVX2) and one float FMA for its
scale, where a float path needs the 32 weights widened to float (four conversions) and four
FMAs per activation row. Results differ from float math by the int8 rounding of the
activations only (the weights' own values are exact).

Activation rows sit in the 8 lanes, so a decoded group (`formats/blocks.group`) is multiplied
into all 8 rows with 8 packed multiply-adds (`u8x32.lanes_dot`) instead of being multiplied 8
times, and a lane's float ops are those of its row alone (walk's order), whatever rows share
its block. Work is split over weight rows with prange (numba's OpenMP layer; see build for the
thread rules). A call takes up to three matrices of one type (`ws`, sharing the activations: q,
k and v; gate and up), so a pass makes fewer kernel calls, each of which costs numba's dispatch
and OpenMP's start.

Dequantization is serial.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.formats.blocks import act_group, geometry, group, lanes_product
from localkv.backends.cpu.formats.types import activation_group
from localkv.backends.cpu.kernels import EXACT_PAR, SER
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import (
    expand,
    fadd,
    fload,
    float_of_bits,
    fma,
    fmul,
    fsplat,
    fzero,
    iadd,
    lane,
    tofloat,
)
from localkv.backends.cpu.simd.u8x32 import prefetch
from localkv.backends.cpu.simd.x16 import absmax16, quant16

LANES = 8  # activation rows per block
CHUNK = 16  # weight rows per work item
# bytes ahead in the weights: the hardware prefetcher alone left the loads waiting, and a decode
# row (matmul_out) streaming from memory still waited at 4096 (BENCHMARKS.md, "Decode rows")
PREFETCH = 16384


@register_jitable(fastmath=False)
def group_scale(bits, o, gs):
    """(d, 1 / d) of values o .. o + gs - 1 of a row (bits: its float32 values' bits): d = amax
    / 127; (nan, 0) for a group holding inf or nan, (0, 0) for one of zeros. amax is the
    largest of the values' bits without the sign (an integer max: bits past +inf's are inf or
    nan)."""
    top = np.uint32(0)
    for i in range(0, gs, 16):
        top = absmax16(bits, o + i, top)
    if top >= np.uint32(0x7F800000):
        return np.float32(np.nan), np.float32(0)
    d = float_of_bits(top) / np.float32(127)
    return d, np.float32(1) / d if top > 0 else np.float32(0)


@register_jitable(fastmath=False)
def offset_sums(d, sa, sb, gs):
    """What the weights' offsets of a 32-value group multiply (the group's q sums sa, sb, of
    values 0-15 and 16-31, and its scale d): for groups of 32 (the types of group_step's one
    scale) d * (sa + sb) and 0, else d * sa and d * sb."""
    if gs == 32:
        return d * np.float32(sa + sb), np.float32(0)
    return d * np.float32(sa), d * np.float32(sb)


@register_jitable(fastmath=False)
def _quantize(x, xq, dx, xs16, gs):
    """x [R, K] float32 (rows contiguous) -> xq int8 [R, K], per gs values (32, or 256 for the
    K-quants) q = rint(x * (1 / d)) with d = amax / 127 (group_scale), d stored once per 32 values
    (dx [R, K/32]); xs16 [R, K/16] = what the offsets multiply (offset_sums: gs 32, one value per
    group then a zero; gs 256, d * the sum of each 16 q). A
    group holding inf or nan gets q = 0 and d = nan, so its outputs are nan as in float math
    (without fastmath here: it would assume there are none). 16 values a step (x16.quant16),
    the same values as one at a time."""
    R, K = x.shape
    bits = x.view(np.uint32)
    for r in range(R):
        xr, qr = x[r], xq[r]
        for g in range(K // gs):
            o = gs * g
            d, inv = group_scale(bits[r], o, gs)
            for k in range(0, gs // 16, 2):
                sa = sb = 0
                if inv > 0:
                    sa = quant16(xr, o + 16 * k, inv, qr, o + 16 * k)
                    sb = quant16(xr, o + 16 * k + 16, inv, qr, o + 16 * k + 16)
                else:
                    qr[o + 16 * k : o + 16 * k + 32] = 0
                i = gs // 16 * g + k
                xs16[r, i], xs16[r, i + 1] = offset_sums(d, sa, sb, gs)
            for k in range(gs // 32):
                dx[r, gs // 32 * g + k] = d


@register_jitable
def quantized(x, gs):
    """x [R, K] as the decode kernels multiply it: _quantize's (xq, dx, xs16), freshly made."""
    R, K = x.shape
    xq = np.empty((R, K), np.int8)
    dx = np.empty((R, K // 32), np.float32)
    xs16 = np.empty((R, K // 16), np.float32)
    _quantize(x, xq, dx, xs16, gs)
    return xq, dx, xs16


@register_jitable(**NO_NRT)
def chunks(ws):
    """Work items over the stacked matrices: chunks of CHUNK rows, none spanning two matrices
    (a kernel then takes its matrix out of the tuple once per chunk, not once per row)."""
    return (
        (ws[0].shape[0] + CHUNK - 1) // CHUNK,
        (ws[1].shape[0] + CHUNK - 1) // CHUNK,
        (ws[2].shape[0] + CHUNK - 1) // CHUNK,
    )


@register_jitable(**NO_NRT)
def chunk(ws, offs, counts, c):
    """(matrix index, first row, end row, output column of row 0) of chunk c."""
    c = np.int64(c)  # prange's index may be unsigned; unsigned - signed is a float in numba
    i = int(c >= counts[0]) + int(c >= counts[0] + counts[1])
    c -= counts[0] * (i > 0) + counts[1] * (i > 1)
    return i, c * CHUNK, min((c + 1) * CHUNK, ws[i].shape[0]), offs[i]


@register_jitable(**NO_NRT)
def _lanes_step(qt, w, blk, j, g, inp, a, m):
    """Group j of the block at blk (group g of the row) . 8 activation rows, into a and m
    (inp: lanes_inputs' xi, dxv, xsa, xsb of one block)."""
    xi, dxv, xsa, xsb = inp
    prefetch(w, blk + PREFETCH)
    u, sa, sb, ma, mb = group(qt, w, blk, j)
    pa, pb = lanes_product(qt, u, xi, 256 * g)
    scales = (fsplat(sa), fsplat(sb), fsplat(ma), fsplat(mb))
    return group_step(qt, pa, pb, scales, fload(dxv, 8 * g), fload(xsa, 8 * g), fload(xsb, 8 * g), a, m)


def group_step(qt, pa, pb, scales, dx, xsa, xsb, a, m):
    """A group's float step of the one arithmetic (docs/CPU.md), lane by lane (8 or 16 lanes):
    pa, pb the integer dots of its values 0-15 and 16-31, scales the weight row's (sa, sb, ma,
    mb), dx the activations' scale, xsa, xsb their offset_sums; (a, m) -> the new (a, m). The
    types of activation group 32 have one scale and offset per group (sa = sb, ma = mb):
    a = fma(float(pa + pb) * sa, dx, a), m = fma(ma, xsa, m); the others scale each half:
    a = fma(fma(float(pa), sa, float(pb) * sb), dx, a), m += fma(ma, xsa, mb * xsb)."""


@overload(group_step, inline="always")
def _group_step(qt, pa, pb, scales, dx, xsa, xsb, a, m):
    if activation_group(qt.qname) == 32:

        def one(qt, pa, pb, scales, dx, xsa, xsb, a, m):
            return one_scale_step(iadd(pa, pb), scales[0], scales[2], dx, xsa, a, m)

        return one

    def two(qt, pa, pb, scales, dx, xsa, xsb, a, m):
        sa, sb, ma, mb = scales
        a = fma(fma(tofloat(pa), sa, fmul(tofloat(pb), sb)), dx, a)
        return a, fadd(m, fma(ma, xsa, fmul(mb, xsb)))

    return two


@register_jitable(**NO_NRT)
def one_scale_step(p, s, ms, dx, xs, a, m):
    """group_step of a one-scale type for the group's whole integer dot p."""
    return fma(fmul(tofloat(p), s), dx, a), fma(ms, xs, m)


@register_jitable(**NO_NRT)
def walk(step, qt, w, base, inp, ng):
    """The groups of one weight row (from byte base) through step(qt, w, blk, j, g, inp, a, m),
    8 lanes at a time, in the order that fixes the lanes' sums: group g into accumulator
    g % 2, in order of g (two accumulators, so that FMA latency does not bound the loop; a
    K-quant block's 8 groups written out, so that each group's shifts and scale unpacking are
    constants). The lanes kernels (lanes: rows in the lanes, 8 or 16 of them: walk_from;
    matmul_out: outputs in the lanes) share it, so that a lane's float ops are one sequence
    whichever kernel runs it."""
    a0, a1, m0, m1 = walk_from(step, qt, w, base, inp, ng, fzero())
    return fadd(fadd(a0, a1), fadd(m0, m1))


@register_jitable(**NO_NRT)
def walk_from(step, qt, w, base, inp, ng, z):
    """walk's four accumulators (a0, a1, m0, m1: its result is (a0 + a1) + (m0 + m1)), each
    starting at z (F32x8, F32x16, or a tuple of them when step runs several weight rows)."""
    groups, nbytes = geometry(qt)
    a0, a1, m0, m1 = z, z, z, z
    if groups == 1:
        for g in range(0, ng - 1, 2):
            a0, m0 = step(qt, w, base + g * nbytes, 0, g, inp, a0, m0)
            a1, m1 = step(qt, w, base + (g + 1) * nbytes, 0, g + 1, inp, a1, m1)
        if ng % 2:
            a0, m0 = step(qt, w, base + (ng - 1) * nbytes, 0, ng - 1, inp, a0, m0)
    else:
        for b in range(ng // 8):
            blk, g = base + b * nbytes, 8 * b
            a0, m0 = step(qt, w, blk, 0, g, inp, a0, m0)
            a1, m1 = step(qt, w, blk, 1, g + 1, inp, a1, m1)
            a0, m0 = step(qt, w, blk, 2, g + 2, inp, a0, m0)
            a1, m1 = step(qt, w, blk, 3, g + 3, inp, a1, m1)
            a0, m0 = step(qt, w, blk, 4, g + 4, inp, a0, m0)
            a1, m1 = step(qt, w, blk, 5, g + 5, inp, a1, m1)
            a0, m0 = step(qt, w, blk, 6, g + 6, inp, a0, m0)
            a1, m1 = step(qt, w, blk, 7, g + 7, inp, a1, m1)
    return a0, a1, m0, m1


@register_jitable(fastmath=False)
def _lanes_block(x, r0, r1, gs, q, xi, dxv, xsa, xsb):
    """Rows r0 .. r1 - 1 of x [R, K] quantized as _quantize does (the same values) straight into
    one block of the L-lane layout, L = len(dxv) / (K / 32): xi [g][dword][L rows][4 bytes],
    dxv (d), xsa, xsb (offset_sums) [g][L]; zeros in the
    lanes of rows past r1, which compute nothing. q: 32 bytes of scratch, written a 4-byte word
    at a time (a row's bytes of a block in xi are 4 apart, L words in between)."""
    K = x.shape[1]
    L = dxv.shape[0] // (K // 32)
    bits, words, qw = x.view(np.uint32), xi.view(np.uint32), q.view(np.uint32)
    for r in range(L):
        row = r0 + r
        for o in range(0, K, gs):
            d, inv = group_scale(bits[row], o, gs) if row < r1 else (np.float32(0), np.float32(0))
            for g in range(o // 32, (o + gs) // 32):
                sa = sb = 0
                if inv > 0:
                    sa = quant16(x[row], 32 * g, inv, q, 0)
                    sb = quant16(x[row], 32 * g + 16, inv, q, 16)
                else:
                    q[:] = 0
                if row < r1:
                    dxv[L * g + r] = d
                    xsa[L * g + r], xsb[L * g + r] = offset_sums(d, sa, sb, gs)
                else:
                    dxv[L * g + r], xsa[L * g + r], xsb[L * g + r] = 0, 0, 0
                for k in range(8):
                    words[8 * L * g + L * k + r] = qw[k]


@njit(**EXACT_PAR)
def lanes_inputs(qt, x, L):
    """x [R, K] quantized (_quantize's values) and interleaved per block of L rows (8 for
    matmul_lanes, 16 for matmul_wide): (xi [blocks, K * L] int8, dxv, xsa, xsb [blocks,
    K * L / 32] float32). Parallel over the blocks (a row's values are its own: the same bits
    on any split); one block (a decode or verify pass) on the calling thread, as a parallel
    launch costs more than its work."""
    R, K = x.shape
    ng, nb = K // 32, (R + L - 1) // L
    # np.empty: in a parallel function each np.zeros is a parallel loop of its own (numba's
    # parfors), four thread launches that cost more than a decode pass's quantization
    xi, dxv = np.empty((nb, ng * 32 * L), np.int8), np.empty((nb, ng * L), np.float32)
    xsa, xsb = np.empty((nb, ng * L), np.float32), np.empty((nb, ng * L), np.float32)
    if nb == 1:
        _lanes_block(x, 0, R, act_group(qt), np.empty(32, np.int8), xi[0], dxv[0], xsa[0], xsb[0])
        return xi, dxv, xsa, xsb
    for b in prange(nb):
        q = np.empty(32, np.int8)
        _lanes_block(x, b * L, min(R, (b + 1) * L), act_group(qt), q, xi[b], dxv[b], xsa[b], xsb[b])
    return xi, dxv, xsa, xsb


@njit(**EXACT_PAR)
def matmul_lanes(qt, xi, dxv, xsa, xsb, ws, offs, out):
    """out[:, offs[i] + n] = x @ row n of ws[i] for the three matrices ws (same type, same
    columns; a zero-row array for unused ones), x given as lanes_inputs' blocks of 8 (out [8 *
    blocks, outputs]): a row's outputs are one lane of its block whatever the row count, so a
    token row gets the same bits in a pass of 1 row or of 512 (docs/CPU.md, one arithmetic). A
    block's activations stay in L1 while a work chunk's weight rows pass over them (weight row
    by block, the other way round, read every block from L2 for each row: 1.2x slower)."""
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        lanes_chunk(qt, ws[i], n0, n1, col, xi, dxv, xsa, xsb, out)


@register_jitable(**NO_NRT)
def lanes_chunk(qt, w, n0, n1, col, xi, dxv, xsa, xsb, out):
    """matmul_lanes' work on weight rows n0 .. n1 - 1 of w (a work chunk): every block of 8
    rows of (xi, dxv, xsa, xsb) (none when they hold no block)."""
    nb, ng = xi.shape[0], xi.shape[1] // 256
    for b in range(nb):
        for n in range(n0, n1):
            v = walk(_lanes_step, qt, w, n * w.shape[1], (xi[b], dxv[b], xsa[b], xsb[b]), ng)
            for r in range(LANES):
                out[b * LANES + r, col + n] = lane(v, r)


@njit(**SER)
def dequantize(qt, w, rows, out):
    """out[i] = weight row rows[i] of w as float32 (out [len(rows), K] C-contiguous)."""
    K = out.shape[1]
    for i in range(len(rows)):
        base = rows[i] * w.shape[1]
        groups, nbytes = geometry(qt)
        for g in range(K // 32):
            u, sa, sb, ma, mb = group(qt, w, base + (g // groups) * nbytes, g % groups)
            expand(out, i * K + 32 * g, u, sa, sb, ma, mb)
