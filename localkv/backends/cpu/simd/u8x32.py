"""The byte and integer SIMD operations of the kernels (U8x32, I32x8), as LLVM IR intrinsics.

numba's loop vectorizer does not turn the block loops of the quantized formats into packed
integer multiply-adds (it gathered, or left them scalar), so the kernels spell the vectors out:
U8x32 (32 bytes: one block of 32 quantized values), I32x8 and F32x8 (eight lanes). Values of
these types live in registers inside a kernel like any numba scalar.

`dot` is the core: per lane j, acc[j] + sum(u[4j+i] * s[4j+i] for i in 0..3), u unsigned and s
signed bytes (x86's vpdpbusd). With AVX-VNNI or AVX-512 VNNI it is that one instruction; with
AVX2, vpmaddubsw + vpmaddwd when every u < 128 (`dot7`: the pairs cannot saturate int16),
else the bytes widened to int16 first; on other CPUs plain widening multiplies and adds,
lowered by LLVM. All are exact. The choice follows the features numba compiles for, which
are part of numba's cache key, so a cached kernel never runs on a CPU it was not built for.
The float lanes (F32x8) are in f32x8, the types and IR helpers in vec (offsets as there).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import F32, I8, I16, I32, V8I32, V32I8, I32x8, U8x32, features, function, ptr, splat


def _byte(builder, value):
    return builder.trunc(value, I8) if value.type.width > 8 else value


def _has_vnni(context) -> bool:
    feats = features(context)
    return "+avxvnni" in feats or ("+avx512vnni" in feats and "+avx512vl" in feats)


# ---------------------------------------------------------------- bytes


@intrinsic
def load32(typingctx, arr, off):
    """32 bytes at arr[off:]."""

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V32I8), align=1)

    return U8x32(arr, off), codegen


@intrinsic
def store32(typingctx, arr, off, v):
    """arr[off:off + 32] = the 32 bytes of v (a uint8 array)."""

    def codegen(context, builder, sig, args):
        builder.store(args[2], ptr(context, builder, sig.args[0], args[0], args[1], V32I8), align=1)
        return context.get_dummy_value()

    return types.none(arr, off, v), codegen


@intrinsic
def scaled_bytes(typingctx, u, ka, kb, bias):
    """u's values times ka (values 0-15) or kb (16-31), plus bias, as two U8x32: the low bytes
    and the high bytes of those int16 (callers keep them inside 0..65535)."""

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(I16, 32)
        k = [context.cast(builder, a, t, types.int16) for a, t in zip(args[1:], sig.args[1:])]
        halves = ir.Constant(ir.VectorType(I32, 32), list(range(16)) + list(range(48, 64)))
        ks = builder.shuffle_vector(splat(builder, k[0], v16), splat(builder, k[1], v16), halves)
        e = builder.add(builder.mul(builder.zext(args[0], v16), ks), splat(builder, k[2], v16))
        lo = builder.trunc(e, V32I8)
        hi = builder.trunc(builder.lshr(e, ir.Constant(v16, [8] * 32)), V32I8)
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return types.UniTuple(U8x32, 2)(u, ka, kb, bias), codegen


@intrinsic
def nibbles(typingctx, arr, off):
    """The 16 bytes at arr[off:] as 32 values: their low nibbles, then their high nibbles."""

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(I8, 16)
        v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        lo = builder.and_(v, ir.Constant(v16, [15] * 16))
        hi = builder.lshr(v, ir.Constant(v16, [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32), list(range(32))))

    return U8x32(arr, off), codegen


@intrinsic
def bits(typingctx, word):
    """Byte j = bit j of a 32-bit word (0 or 1)."""

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(I32, 32)
        w = splat(builder, builder.trunc(args[0], I32) if args[0].type.width > 32 else args[0], v32)
        w = builder.and_(builder.lshr(w, ir.Constant(v32, list(range(32)))), ir.Constant(v32, [1] * 32))
        return builder.trunc(w, V32I8)

    return U8x32(word), codegen


def _byte_op(op):
    def typer(typingctx, v, k):
        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], splat(builder, _byte(builder, args[1]), V32I8))

        return U8x32(v, k), codegen

    return intrinsic(typer)


shr = _byte_op("lshr")  # shr(v, k): every byte shifted right by k
shl = _byte_op("shl")  # shl(v, k): every byte shifted left by k (bits past 8 dropped)
band = _byte_op("and_")  # band(v, c): every byte and c
bxor = _byte_op("xor")  # bxor(v, c): every byte xor c


@intrinsic
def bor(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])

    return U8x32(a, b), codegen


# ---------------------------------------------------------------- integer dot


@intrinsic
def izero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(V8I32, [0] * 8)

    return I32x8(), codegen


def dot_builder(context, small: bool):
    """The builder function of `dot` for the CPU numba compiles for. small: every u < 128."""
    feats = features(context)
    if _has_vnni(context):

        def vnni(builder, acc, u, s):
            fn = function(builder, "llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32] * 3)
            return builder.call(fn, [acc, builder.bitcast(u, V8I32), builder.bitcast(s, V8I32)])

        return vnni
    v16 = ir.VectorType(I16, 16)
    if "+avx2" in feats and small:  # u * s pairs fit int16 (vpmaddubsw saturates past 32767)
        summed = summed_dots(context)
        return lambda builder, acc, u, s: summed(builder, acc, [(u, s)])
    if "+avx2" in feats:  # bytes widened to int16 first: exact for any u

        def madd16(builder, acc, u, s):
            fn = function(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [v16] * 2)
            v32 = ir.VectorType(I16, 32)
            uw, sw = builder.zext(u, v32), builder.sext(s, v32)
            lo, hi = (ir.Constant(ir.VectorType(I32, 16), list(range(k, k + 16))) for k in (0, 16))
            a = builder.call(fn, [builder.shuffle_vector(uw, uw, lo), builder.shuffle_vector(sw, sw, lo)])
            b = builder.call(fn, [builder.shuffle_vector(uw, uw, hi), builder.shuffle_vector(sw, sw, hi)])
            q = builder.call(function(builder, "llvm.x86.avx2.phadd.d", V8I32, [V8I32] * 2), [a, b])
            return builder.add(acc, builder.shuffle_vector(q, q, ir.Constant(V8I32, [0, 1, 4, 5, 2, 3, 6, 7])))

        return madd16

    def generic(builder, acc, u, s):
        v32 = ir.VectorType(I32, 32)
        p = builder.mul(builder.zext(u, v32), builder.sext(s, v32), flags=("nsw",))
        for i in range(4):
            acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(V8I32, list(range(i, 32, 4)))))
        return acc

    return generic


def summed_dots(context):
    """On AVX2 without VNNI, summed(builder, acc, [(u, s), ...]) -> acc + the `dot` of every
    pair: each pair's vpmaddubsw words (two products each, u < 128) added as int16, then one
    vpmaddwd by ones. The same integers as one `dot` a pair while the words cannot overflow:
    n pairs x 2 x max u x 128 < 32768, the caller's bound. None where `dot` is one instruction
    (VNNI) or AVX2 is missing."""
    if _has_vnni(context) or "+avx2" not in features(context):
        return None
    v16 = ir.VectorType(I16, 16)

    def summed(builder, acc, products):
        maddubs = function(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [V32I8] * 2)
        words = [builder.call(maddubs, [u, s]) for u, s in products]
        total = words[0]
        for w in words[1:]:
            total = builder.add(total, w)
        fn = function(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [v16] * 2)
        return builder.add(acc, builder.call(fn, [total, ir.Constant(v16, [1] * 16)]))

    return summed


def _dot_typer(small: bool):
    def typer(typingctx, acc, u, s):
        def codegen(context, builder, sig, args):
            return dot_builder(context, small)(builder, *args)

        return I32x8(acc, u, s), codegen

    return typer


# dot(acc, u, s): acc[j] + sum over i < 4 of u[4j+i] (unsigned) * s[4j+i] (signed): lanes 0-3
# cover bytes 0-15, lanes 4-7 bytes 16-31. dot7: the same when every u < 128 (faster on AVX2).
dot = intrinsic(_dot_typer(False))
dot7 = intrinsic(_dot_typer(True))


# ---------------------------------------------------------------- scalars


@intrinsic
def half(typingctx, arr, off):
    """The IEEE half float stored (little-endian) at byte off of a uint8 array, as float32."""

    def codegen(context, builder, sig, args):
        p = ptr(context, builder, sig.args[0], args[0], args[1])
        h = builder.load(builder.bitcast(p, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(h, F32)

    return types.float32(arr, off), codegen


@intrinsic
def half_bits(typingctx, x):
    """The IEEE half float nearest a float32 (ties to even, as numpy's astype(float16)), as its
    16 bits."""

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def as_half(typingctx, x):
    """A float32 rounded to the nearest IEEE half float (half_bits' rounding), as float32."""

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.fpext(builder.fptrunc(x, ir.HalfType()), F32)

    return types.float32(x), codegen


@intrinsic
def at(typingctx, arr, off):
    """arr[off] for a C-contiguous array of any dimension (flat index), without the
    negative-index and bounds handling of numba's indexing."""

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1]))

    return arr.dtype(arr, off), codegen


@intrinsic
def u32(typingctx, arr, off):
    """The little-endian uint32 at byte off of a uint8 array."""

    def codegen(context, builder, sig, args):
        p = ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.zext(builder.load(builder.bitcast(p, I32.as_pointer()), align=1), ir.IntType(64))

    return types.int64(arr, off), codegen


def _lanes_typer(small: bool, five_bits: bool = False):
    def typer(typingctx, u, xi, off):
        """The 8-row product of one group: (pa, pb), lane r = the dot of values 0-15 (pa) or 16-31
        (pb) of u with row r of the activations, which xi holds at off as [8 dwords][8 rows][4
        bytes] (int8). Each dword of u is broadcast to all lanes and multiplied into 8 rows."""

        def codegen(context, builder, sig, args):
            u, xi, off = args
            words = builder.bitcast(u, V8I32)
            dot_impl = dot_builder(context, small)
            summed = summed_dots(context) if five_bits else None  # 4 x 2 x 31 x 128 < 32768
            out = []
            for half_ in range(2):
                acc = ir.Constant(V8I32, [0] * 8)
                products = []
                for k in range(4 * half_, 4 * half_ + 4):
                    b = builder.bitcast(builder.shuffle_vector(words, words, ir.Constant(V8I32, [k] * 8)), V32I8)
                    at = builder.add(off, ir.Constant(off.type, 32 * k))
                    x = builder.load(ptr(context, builder, sig.args[1], xi, at, V32I8), align=1)
                    if summed is None:
                        acc = dot_impl(builder, acc, b, x)
                    else:
                        products.append((b, x))
                out.append(acc if summed is None else summed(builder, acc, products))
            return context.make_tuple(builder, sig.return_type, out)

        return types.UniTuple(I32x8, 2)(u, xi, off), codegen

    return typer


lanes_dot = intrinsic(_lanes_typer(False))
lanes_dot7 = intrinsic(_lanes_typer(True))  # every u < 128
lanes_dot5 = intrinsic(_lanes_typer(True, True))  # every u < 32: without VNNI, words summed first


def _pair_sums(builder, a, b):
    """Within each 128-bit half: a[0]+a[1], a[2]+a[3], b[0]+b[1], b[2]+b[3] (vphaddd's order)."""
    even = builder.shuffle_vector(a, b, ir.Constant(V8I32, [0, 2, 8, 10, 4, 6, 12, 14]))
    odd = builder.shuffle_vector(a, b, ir.Constant(V8I32, [1, 3, 9, 11, 5, 7, 13, 15]))
    return builder.add(even, odd)


@intrinsic
def quad_sums(typingctx, p0, p1, p2, p3):
    """Four `dot` results -> lane i = the sum of lanes 0-3 of p_i, lane 4 + i = that of lanes
    4-7 (the two 16-byte halves' sums of four weight rows)."""

    def codegen(context, builder, sig, args):
        return _pair_sums(builder, _pair_sums(builder, args[0], args[1]), _pair_sums(builder, args[2], args[3]))

    return I32x8(p0, p1, p2, p3), codegen


@intrinsic
def halves(typingctx, p, q):
    """Two quad_sums -> (lanes 0-3 of p then of q, lanes 4-7 of p then of q)."""

    def codegen(context, builder, sig, args):
        lo = builder.shuffle_vector(args[0], args[1], ir.Constant(V8I32, [0, 1, 2, 3, 8, 9, 10, 11]))
        hi = builder.shuffle_vector(args[0], args[1], ir.Constant(V8I32, [4, 5, 6, 7, 12, 13, 14, 15]))
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return types.UniTuple(I32x8, 2)(p, q), codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the cache line of arr[off] into the caches (reads, kept in all levels). A prefetch
    never faults, so off may run past the end of the array."""

    def codegen(context, builder, sig, args):
        p = builder.bitcast(ptr(context, builder, sig.args[0], args[0], args[1]), ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [p.type, I32, I32, I32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, off), codegen
