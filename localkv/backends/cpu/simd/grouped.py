"""The integer work of one super-block of 16 packed weight rows (formats/packed) against one
activation row, for kernels/superblock_packed: the outputs in the 16 lanes.

Each 64-byte load holds 4 unsigned weight values of each of the 16 rows; one vpdpbusd
(x16.dot16_builder: two 256-bit products without AVX-512 VNNI) multiplies them with the matching 4
activations, broadcast, into an accumulator per scale group (Q4_K's 32 values, Q6_K's 16).
The accumulators times the unpacked integer scales (vpmulld) sum to the super-block's
product integer per row; the offsets' integer is the scales or mins, as int16 pairs, times
the activations' sums per group, as int16 pairs (vpdpwssd). Both are exact, so they equal
simd/wide's q4k_sums / q6k_sums of the same rows: kernels/superblock's float step then gives
the same bits. Offsets in elements of the arrays given (C-contiguous, nothing bounds-checked).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import (
    I8,
    I16,
    I32,
    V16F32,
    V16I32,
    F32x16,
    I32x16,
    U8x32,
    features,
    function,
    ptr,
    splat,
)
from localkv.backends.cpu.simd.x16 import dot16_builder, summed_dots16

_V64I8, _V32I8, _V32I16 = ir.VectorType(I8, 64), ir.VectorType(I8, 32), ir.VectorType(I16, 32)
_V16H = ir.VectorType(ir.HalfType(), 16)


def _at(builder, off, k):
    return builder.add(off, ir.Constant(off.type, k))


def _bytes(builder, vec_type, k):
    return ir.Constant(vec_type, [k] * vec_type.count)


def _load(context, builder, arrty, arr, off, vec_type):
    return builder.load(ptr(context, builder, arrty, arr, off, vec_type), align=1)


def _bcast(context, builder, arrty, arr, off):
    """The 4 bytes at arr[off] in every dword of a 64-byte vector."""
    word = builder.load(ptr(context, builder, arrty, arr, off, I32), align=1)
    return builder.bitcast(splat(builder, word, V16I32), _V64I8)


def _pairs16(context, builder, arrty, arr, off, signed):
    """32 bytes at arr[off] widened to int16, as 16 dwords of two int16 (vpdpwssd's operand)."""
    raw = _load(context, builder, arrty, arr, off, _V32I8)
    wide = builder.sext(raw, _V32I16) if signed else builder.zext(raw, _V32I16)
    return builder.bitcast(wide, V16I32)


def _split(builder, pairs):
    """(the low int16, the high int16) of each dword, as int32 lanes (both sign-extended)."""
    k16 = ir.Constant(V16I32, [16] * 16)
    return builder.ashr(builder.shl(pairs, k16), k16), builder.ashr(pairs, k16)


def _pairs_dot(context, builder, acc, a, word):
    """acc + per lane the dot of a's two int16 with word's (vpdpwssd, word broadcast)."""
    wv = splat(builder, word, V16I32)
    if "+avx512vnni" in features(context):
        fn = function(builder, "llvm.x86.avx512.vpdpwssd.512", V16I32, [V16I32] * 3)
        return builder.call(fn, [acc, a, wv])
    wide = ir.VectorType(I32, 32)
    x = builder.sext(builder.bitcast(a, _V32I16), wide)
    y = builder.sext(builder.bitcast(wv, _V32I16), wide)
    p = builder.mul(x, y)
    even = builder.shuffle_vector(p, p, ir.Constant(V16I32, list(range(0, 32, 2))))
    odd = builder.shuffle_vector(p, p, ir.Constant(V16I32, list(range(1, 32, 2))))
    return builder.add(acc, builder.add(even, odd))


def _scale_pair(context, builder, arrty, p, at, signed):
    """The scales of groups 2q, 2q+1 for the 16 rows, stored as pairs at p[at], as int32 lanes."""
    return _split(builder, _pairs16(context, builder, arrty, p, at, signed))


def _offsets(context, builder, arrty, p, at, signed, sty, xs, xsoff, n):
    """sum over pairs q < n of the factor pair at p[at + 32 q] . the activations' sum pair xs[xsoff + q]."""
    m = ir.Constant(V16I32, [0] * 16)
    for q in range(n):
        word = builder.load(ptr(context, builder, sty, xs, _at(builder, xsoff, q)), align=4)
        factors = _pairs16(context, builder, arrty, p, _at(builder, at, 32 * q), signed)
        m = _pairs_dot(context, builder, m, factors, word)
    return m


def _q4k(context, builder, tys, p, off, xq, xoffs, xs, xsoffs):
    """Per row of xoffs: (product integers, offset integers). A 64-value chunk c at a time (two
    scale groups): its weight bytes unpacked once for every row, each row's two accumulators
    scaled into its total as the chunk ends."""
    pty, xty, sty = tys
    product = dot16_builder(context, True)  # every weight value < 128
    summed = summed_dots16(context)  # no VNNI: a group's 8 products' words summed (8 x 2 x 15 x 128 < 32768)
    zero = ir.Constant(V16I32, [0] * 16)
    totals = [zero] * len(xoffs)
    for c in range(4):
        accs = [[zero, zero] for _ in xoffs]
        products = [[[], []] for _ in xoffs]
        for j in range(8):
            v = _load(context, builder, pty, p, _at(builder, off, 64 * (8 * c + j)), _V64I8)
            us = (builder.and_(v, _bytes(builder, _V64I8, 15)), builder.lshr(v, _bytes(builder, _V64I8, 4)))
            for r, xoff in enumerate(xoffs):
                for h, u in enumerate(us):
                    x = _bcast(context, builder, xty, xq, _at(builder, xoff, 64 * c + 32 * h + 4 * j))
                    if summed is None:
                        accs[r][h] = product(builder, accs[r][h], u, x)
                    else:
                        products[r][h].append((u, x))
        if summed is not None:
            accs = [[summed(builder, zero, ps) for ps in row] for row in products]
        lo, hi = _scale_pair(context, builder, pty, p, _at(builder, off, 2048 + 32 * c), False)
        for r in range(len(xoffs)):
            totals[r] = builder.add(totals[r], builder.add(builder.mul(accs[r][0], lo), builder.mul(accs[r][1], hi)))
    at = _at(builder, off, 2176)
    return [(totals[r], _offsets(context, builder, pty, p, at, False, sty, xs, so, 4)) for r, so in enumerate(xsoffs)]


def _shift(builder, v, k):
    """v's bytes shifted left by k (right by -k)."""
    if k > 0:
        return builder.shl(v, _bytes(builder, v.type, k))
    return builder.lshr(v, _bytes(builder, v.type, -k)) if k else v


def _q6k(context, builder, tys, p, off, xq, xoffs, xs, xsoffs):
    """As _q4k: per half h and quarter kk, the four scale groups 8 h + 2 s + kk (s < 4) of 16
    values each, their weight values unpacked once for every row."""
    pty, xty, sty = tys
    product = dot16_builder(context, True)
    summed = summed_dots16(context)  # no VNNI: two products' words summed (2 x 2 x 63 x 128 < 32768)
    zero = ir.Constant(V16I32, [0] * 16)
    totals = [zero] * len(xoffs)
    c = lambda k: _bytes(builder, _V64I8, k)  # noqa: E731
    for h in range(2):
        for kk in range(2):
            accs = [[zero] * 4 for _ in xoffs]
            pending = [[None] * 4 for _ in xoffs]  # summed's: an even k's product, widened with the next
            for k in range(4 * kk, 4 * kk + 4):
                qh = _load(context, builder, pty, p, _at(builder, off, 2048 + 64 * (8 * h + k)), _V64I8)
                qa = _load(context, builder, pty, p, _at(builder, off, 64 * (16 * h + k)), _V64I8)
                qb = _load(context, builder, pty, p, _at(builder, off, 64 * (16 * h + 8 + k)), _V64I8)
                # bits 2s, 2s + 1 of qh moved to 4, 5: one shift and one mask (x86 shifts words)
                high = [builder.and_(_shift(builder, qh, 4 - 2 * s), c(48)) for s in range(4)]
                lows = (builder.and_(qa, c(15)), builder.and_(qb, c(15)))
                lows += (builder.lshr(qa, c(4)), builder.lshr(qb, c(4)))
                us = [builder.or_(lo, hi) for lo, hi in zip(lows, high)]
                for r, xoff in enumerate(xoffs):
                    for s, u in enumerate(us):  # values 128 h + 32 s + 4 k..: scale group 8 h + 2 s + kk
                        x = _bcast(context, builder, xty, xq, _at(builder, xoff, 128 * h + 32 * s + 4 * k))
                        if summed is None:
                            accs[r][s] = product(builder, accs[r][s], u, x)
                        elif k % 2 == 0:
                            pending[r][s] = (u, x)
                        else:
                            accs[r][s] = summed(builder, accs[r][s], [pending[r][s], (u, x)])
            for s in range(4):  # group 8 h + 2 s + kk: member kk of the scale pair 4 h + s
                pair = _scale_pair(context, builder, pty, p, _at(builder, off, 3072 + 32 * (4 * h + s)), True)
                for r in range(len(xoffs)):
                    totals[r] = builder.add(totals[r], builder.mul(accs[r][s], pair[kk]))
    at = _at(builder, off, 3072)
    return [(totals[r], _offsets(context, builder, pty, p, at, True, sty, xs, xsoffs[r], 8)) for r in range(len(xoffs))]


def _ints_typer(ints):
    def typer(typingctx, p, off, xq, xoffs, xs, xsoffs):
        def codegen(context, builder, sig, args):
            p, off, xq, xoffs, xs, xsoffs = args
            tys = (sig.args[0], sig.args[2], sig.args[4])
            xo = cgutils.unpack_tuple(builder, xoffs)
            so = cgutils.unpack_tuple(builder, xsoffs)
            pairs = ints(context, builder, tys, p, off, xq, xo, xs, so)
            return context.make_tuple(builder, sig.return_type, [v for pair in pairs for v in pair])

        return types.UniTuple(I32x16, 2 * xoffs.count)(p, off, xq, xoffs, xs, xsoffs), codegen

    return typer


# per activation row of a tuple, (product integers, offset integers), flat, of the super-block
# at byte off of the packed weights p (uint8) against the activation super-blocks at xq[xoffs]
# (int8, natural order), the activations' per-group sums as int16 pairs at xs[xsoffs] (int32:
# Q4_K's 4 pairs of 32-value sums, Q6_K's 8 pairs of 16-value sums): the weights unpacked once
# for all the rows
q4k_group = intrinsic(_ints_typer(_q4k))
q6k_group = intrinsic(_ints_typer(_q6k))


@intrinsic
def gather32(typingctx, arr, off, stride):
    """32 bytes: the 8 dwords at arr[off + t * stride] (t < 8), in order (a U8x32): one row's
    32 bytes of a packed group, whose dwords lie 64 bytes apart."""

    def codegen(context, builder, sig, args):
        arr, off, stride = args
        v = ir.Constant(ir.VectorType(I32, 8), ir.Undefined)
        for t in range(8):
            at = builder.add(off, builder.mul(stride, ir.Constant(stride.type, t)))
            word = builder.load(ptr(context, builder, sig.args[0], arr, at, I32), align=1)
            v = builder.insert_element(v, word, ir.Constant(I32, t))
        return builder.bitcast(v, _V32I8)

    return U8x32(arr, off, stride), codegen


@intrinsic
def hload16(typingctx, arr, off):
    """The 16 fp16 at byte off of a uint8 array, as float32 lanes (exact)."""

    def codegen(context, builder, sig, args):
        h = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], _V16H), align=1)
        return builder.fpext(h, V16F32)

    return F32x16(arr, off), codegen
