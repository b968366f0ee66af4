"""The K-quant super-block products (Q4_K, Q6_K) as LLVM IR on 64-byte vectors, for
kernels/superblock.

One call multiplies a whole 256-value super-block of weights with int8 activations in integers,
the way llama.cpp's K-quant dots do: the unsigned weight bytes times the activation bytes in
pairs (vpmaddubsw, exact: u < 64 keeps every pair inside int16), those pairs times the integer
sub-block scales and summed in pairs (vpmaddwd, fused into vpdpwssd with AVX-512 VNNI), all
into one vector of 16 int32 lanes, returned as one exact integer per super-block. The offsets
(Q4_K's mins, Q6_K's -32) multiply the activations' sums per 32 / per 16 values, given
precomputed as int16, by the integer mins or scales (vpmaddwd), returned as one integer per
super-block. The caller's float step by the super-block's scales (weight d times activation d)
is the only float work per 256 values.

With AVX-512 BW the vectors are zmm registers; with AVX2 each 64-byte operation runs as two
256-bit ones; elsewhere plain widening IR that LLVM lowers. Offsets as in vec (elements of
the arrays given, C-contiguous, nothing bounds-checked).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import I8, I16, I32, features, function, ptr

_V64I8, _V32I8, _V16I8 = ir.VectorType(I8, 64), ir.VectorType(I8, 32), ir.VectorType(I8, 16)
_V32I16, _V16I16, _V8I16 = ir.VectorType(I16, 32), ir.VectorType(I16, 16), ir.VectorType(I16, 8)
_V16I32 = ir.VectorType(I32, 16)


def _mask(values):
    return ir.Constant(ir.VectorType(I32, len(values)), list(values))


def _halves(builder, v):
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, _mask(range(n))), builder.shuffle_vector(v, v, _mask(range(n, 2 * n)))


def _join(builder, a, b):
    return builder.shuffle_vector(a, b, _mask(range(2 * a.type.count)))


def _pairs_add(builder, v, wide):
    """Lane i = v[2i] + v[2i+1], widened to the vector type `wide`."""
    n = v.type.count
    ev = builder.shuffle_vector(v, v, _mask(range(0, n, 2)))
    od = builder.shuffle_vector(v, v, _mask(range(1, n, 2)))
    return builder.add(builder.sext(ev, wide), builder.sext(od, wide))


def _maddubs(context, builder, u, s):
    """<64 x i8> unsigned u, signed s -> <32 x i16>: u[2i] s[2i] + u[2i+1] s[2i+1] (callers keep
    these sums inside int16: vpmaddubsw saturates)."""
    f = features(context)
    if "+avx512bw" in f:
        return builder.call(function(builder, "llvm.x86.avx512.pmaddubs.w.512", _V32I16, [_V64I8] * 2), [u, s])
    if "+avx2" in f:
        fn = function(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8] * 2)
        (ua, ub), (sa, sb) = _halves(builder, u), _halves(builder, s)
        return _join(builder, builder.call(fn, [ua, sa]), builder.call(fn, [ub, sb]))
    v = ir.VectorType(I16, 64)
    p = builder.mul(builder.zext(u, v), builder.sext(s, v), flags=("nsw",))
    return _pairs_add(builder, p, _V32I16)


def _madd(context, builder, a, b):
    """int16 vectors a, b (32, 16 or 8 lanes) -> int32 lanes a[2i] b[2i] + a[2i+1] b[2i+1]."""
    n, f = a.type.count, features(context)
    out = ir.VectorType(I32, n // 2)
    if n == 32 and "+avx512bw" in f:
        return builder.call(function(builder, "llvm.x86.avx512.pmaddw.d.512", out, [a.type] * 2), [a, b])
    if n == 32 and "+avx2" in f:
        (aa, ab), (ba, bb) = _halves(builder, a), _halves(builder, b)
        return _join(builder, _madd(context, builder, aa, ba), _madd(context, builder, ab, bb))
    if n == 16 and "+avx2" in f:
        return builder.call(function(builder, "llvm.x86.avx2.pmadd.wd", out, [a.type] * 2), [a, b])
    if n == 8 and "+sse2" in f:
        return builder.call(function(builder, "llvm.x86.sse2.pmadd.wd", out, [a.type] * 2), [a, b])
    wide = ir.VectorType(I32, n)
    return _pairs_add(builder, builder.mul(builder.sext(a, wide), builder.sext(b, wide), flags=("nsw",)), out)


def _load(context, builder, arrty, arr, off, vec_type):
    return builder.load(ptr(context, builder, arrty, arr, off, vec_type), align=1)


def _at(builder, off, k):
    return builder.add(off, ir.Constant(off.type, k))


def _bytesplat(builder, vec_type, k):
    return ir.Constant(vec_type, [k] * vec_type.count)


def _spread(builder, scales, picks, width):
    """<32 x i16>: scales[picks[0]] in the first `width` lanes, scales[picks[1]] in the next..."""
    return builder.shuffle_vector(scales, scales, _mask([p for p in picks for _ in range(width)]))


def _q4k_scales(context, builder, arrty, w, blk):
    """The 12 packed bytes at blk + 4 -> <16 x i16>: the 8 six-bit scales, then the 8 mins."""
    u = [builder.load(builder.bitcast(ptr(context, builder, arrty, w, _at(builder, blk, 4 + 4 * i)),
                                      I32.as_pointer()), align=1) for i in range(3)]  # fmt: skip
    k1, k2, k3 = (ir.Constant(I32, k) for k in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    sh = lambda v, k: builder.lshr(v, ir.Constant(I32, k))  # noqa: E731
    hi = lambda v: builder.shl(builder.and_(sh(v, 6), k3), ir.Constant(I32, 4))  # noqa: E731
    words = [builder.and_(u[0], k1), builder.or_(builder.and_(u[2], k2), hi(u[0])),
             builder.and_(u[1], k1), builder.or_(builder.and_(sh(u[2], 4), k2), hi(u[1]))]  # fmt: skip
    v = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for i, word in enumerate(words):
        v = builder.insert_element(v, word, ir.Constant(I32, i))
    return builder.zext(builder.bitcast(v, _V16I8), _V16I16)


def _q4k_ints(context, builder, tys, w, blk, xp, bs, sbs):
    """Q4_K's integer work on one super-block, against each activation super-block in sbs (the
    weights decoded once for all): per sb (the 16 int32 lanes of scale_j * u . x, the 4 lanes
    of min_j * the sums of group j's activations). tys: the types of w, xp and bs."""
    wty, xty, sty = tys
    sm = _q4k_scales(context, builder, wty, w, blk)
    sm32 = builder.shuffle_vector(sm, sm, _mask(list(range(16)) * 2))
    mins = builder.shuffle_vector(sm, sm, _mask(range(8, 16)))
    xos = [builder.mul(sb, ir.Constant(sb.type, 256)) for sb in sbs]
    isums = [ir.Constant(_V16I32, [0] * 16) for _ in sbs]
    for h in range(2):
        v = _load(context, builder, wty, w, _at(builder, blk, 16 + 64 * h), _V64I8)
        lo = builder.and_(v, _bytesplat(builder, _V64I8, 15))
        hi = builder.lshr(v, _bytesplat(builder, _V64I8, 4))
        for k, u in enumerate((lo, hi)):
            sc = _spread(builder, sm32, (4 * h + k, 4 * h + k + 2), 16)
            _multiply_into(context, builder, isums, u, sc, xty, xp, xos, 128 * h + 64 * k)
    return _with_offsets(context, builder, isums, mins, sty, bs, sbs, _V8I16)


def _q6k_ints(context, builder, tys, w, blk, xq, bs, sbs):
    """Q6_K's integer work on one super-block against each activation super-block in sbs: per
    sb (the 16 int32 lanes of scale_k * u . x, the 8 lanes of scale_k * the sums of the 16
    activations of k), u = the unsigned 6-bit values. tys: the types of w, xq and bs."""
    wty, xty, sty = tys
    raw = _load(context, builder, wty, w, _at(builder, blk, 192), _V16I8)
    sc = builder.sext(raw, _V16I16)
    sc32 = builder.shuffle_vector(sc, sc, _mask(list(range(16)) * 2))
    xos = [builder.mul(sb, ir.Constant(sb.type, 256)) for sb in sbs]
    isums = [ir.Constant(_V16I32, [0] * 16) for _ in sbs]
    c = lambda k: _bytesplat(builder, _V64I8, k)  # noqa: E731
    for h in range(2):
        ql = _load(context, builder, wty, w, _at(builder, blk, 64 * h), _V64I8)
        qh = _load(context, builder, wty, w, _at(builder, blk, 128 + 32 * h), _V32I8)
        qh = _join(builder, qh, builder.lshr(qh, _bytesplat(builder, _V32I8, 2)))  # bits 0-1 | 2-3
        u01 = builder.or_(builder.and_(ql, c(15)), builder.shl(builder.and_(qh, c(3)), c(4)))
        u23 = builder.or_(builder.lshr(ql, c(4)), builder.shl(builder.and_(builder.lshr(qh, c(4)), c(3)), c(4)))
        for k, u in enumerate((u01, u23)):
            s = _spread(builder, sc32, [8 * h + 4 * k + i for i in range(4)], 8)
            _multiply_into(context, builder, isums, u, s, xty, xq, xos, 128 * h + 64 * k)
    return _with_offsets(context, builder, isums, sc, sty, bs, sbs, _V16I16)


def _multiply_into(context, builder, isums, u, scales, xty, xs, xos, at):
    """isums[r] += the scaled pair products of the weight bytes u with the 64 activations at
    xos[r] + at (each activation super-block of a call)."""
    for r, xo in enumerate(xos):
        x = _load(context, builder, xty, xs, _at(builder, xo, at), _V64I8)
        isums[r] = builder.add(isums[r], _madd(context, builder, _maddubs(context, builder, u, x), scales))


def _with_offsets(context, builder, isums, factors, sty, bs, sbs, sums_type):
    """(isum, factors . the activation sums of sb) per activation super-block sb: the offsets
    term (Q4_K's mins, Q6_K's scales), bs holding sums_type.count sums per super-block."""
    n = sums_type.count
    out = []
    for isum, sb in zip(isums, sbs):
        sums = _load(context, builder, sty, bs, builder.mul(sb, ir.Constant(sb.type, n)), sums_type)
        out.append((isum, _madd(context, builder, factors, sums)))
    return out


def _reduced(builder, v):
    """The sum of an int32 vector's lanes, as int64 (exact: integer adds in any order)."""
    reduce = function(builder, "llvm.vector.reduce.add.v" + str(v.type.count) + "i32", I32, [v.type])
    return builder.sext(builder.call(reduce, [v]), ir.IntType(64))


def _sums_codegen(ints):
    """The codegen of q4k_sums / q6k_sums over their integer work `ints` (_q4k_ints, _q6k_ints)."""

    def codegen(context, builder, sig, args):
        sbs = cgutils.unpack_tuple(builder, args[4])
        pairs = ints(context, builder, (sig.args[0], sig.args[2], sig.args[3]), *args[:4], sbs)
        flat = [_reduced(builder, v) for pair in pairs for v in pair]
        return context.make_tuple(builder, sig.return_type, flat)

    return codegen


@intrinsic
def q4k_sums(typingctx, w, blk, xp, bs, sbs):
    """One Q4_K super-block (at byte blk of w) . each activation super-block in the tuple sbs
    (the weights decoded once for them all), as two exact integers per sb, in a flat tuple:
    the sum of scale_j * u . x, and the sum of min_j * the sum of group j's activations; the
    caller writes out the float step. xp holds each super-block's activations in the order the
    nibbles come: values 0-31, 64-95, 32-63, 96-127, then the same from 128; bs their per-32
    sums (int16)."""
    return types.UniTuple(types.int64, 2 * sbs.count)(w, blk, xp, bs, sbs), _sums_codegen(_q4k_ints)


@intrinsic
def q6k_sums(typingctx, w, blk, xq, bs, sbs):
    """One Q6_K super-block . each activation super-block in sbs (natural order in xq; bs their
    per-16 sums, int16), as q4k_sums: the sum of scale_k * u . x, and the sum of scale_k * the
    sum of the 16 activations of k, u = the unsigned 6-bit values (value = u - 32)."""
    return types.UniTuple(types.int64, 2 * sbs.count)(w, blk, xq, bs, sbs), _sums_codegen(_q6k_ints)
