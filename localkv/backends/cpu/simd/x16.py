"""Sixteen lanes: what the 16-row lanes kernel (kernels/matmul_wide) needs beyond f32x8's lane
ops, which take F32x16 as well as F32x8: a zero, a broadcast, a load, and the 16-row product
of a decoded group of 32 weights.

With AVX-512 VNNI the product is one vpdpbusd on a 512-bit register per 4 weights, 16
activation rows at once: half the instructions of two 8-lane products. Elsewhere each 512-bit
product runs as two of u8x32's 256-bit ones (the same integers: every path is exact), so the
kernel compiles and agrees on any CPU; kernels/matmul_wide says where it is chosen. Offsets
as in vec (elements of the arrays given, C-contiguous, nothing bounds-checked).
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from localkv.backends.cpu.simd.f32x8 import halves_codegen, q4_codegen, q8_codegen
from localkv.backends.cpu.simd.u8x32 import dot_builder, summed_dots
from localkv.backends.cpu.simd.vec import (
    I8,
    I32,
    V8I32,
    V16F32,
    V16I32,
    F32x16,
    I32x16,
    features,
    function,
    ptr,
    splat,
)

_V64I8, _V16I8 = ir.VectorType(I8, 64), ir.VectorType(I8, 16)


def has_vnni512(feats: str) -> bool:
    """Whether LLVM features `feats` ("+avx512vnni,...") give the one-instruction product."""
    return "+avx512vnni" in feats and "+avx512bw" in feats


@intrinsic
def zero16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(V16F32, [0.0] * 16)

    return F32x16(), codegen


@intrinsic
def splat16(typingctx, s):
    def codegen(context, builder, sig, args):
        return splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), V16F32)

    return F32x16(s), codegen


@intrinsic
def load16(typingctx, arr, off):
    """16 floats at arr[off:] (a float32 array)."""

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V16F32), align=4)

    return F32x16(arr, off), codegen


@intrinsic
def hload16(typingctx, arr, off):
    """16 IEEE half floats at arr[off:] (a uint16 array) as F32x16 (f32x8.hload's, wider)."""

    def codegen(context, builder, sig, args):
        return halves_codegen(context, builder, sig, args, 16)

    return F32x16(arr, off), codegen


@intrinsic
def q8load16(typingctx, arr, off, scale):
    """16 int8 at arr[off:] times scale, as F32x16 (f32x8.q8load's, wider)."""

    def codegen(context, builder, sig, args):
        return q8_codegen(context, builder, sig, args, 16)

    return F32x16(arr, off, scale), codegen


@intrinsic
def q4load16(typingctx, arr, off, shift, scale):
    """The nibbles of the 16 bytes at arr[off:] less 8, times scale, as F32x16 (f32x8.q4load's)."""

    def codegen(context, builder, sig, args):
        return q4_codegen(context, builder, sig, args, 16)

    return F32x16(arr, off, shift, scale), codegen


def _halves_dot(context, small: bool):
    """The 512-bit product as two 256-bit `dot`s (u8x32's, for the CPU numba compiles for)."""
    dot = dot_builder(context, small)
    lo, hi = (ir.Constant(V8I32, list(range(k, k + 8))) for k in (0, 8))
    lo_b, hi_b = (ir.Constant(ir.VectorType(I32, 32), list(range(k, k + 32))) for k in (0, 32))

    def two(builder, acc, u, s):
        parts = []
        for m, mb in ((lo, lo_b), (hi, hi_b)):
            a = builder.shuffle_vector(acc, acc, m)
            uh, sh = (builder.shuffle_vector(v, v, mb) for v in (u, s))
            parts.append(dot(builder, a, uh, sh))
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(V16I32, list(range(16))))

    return two


def dot16_builder(context, small: bool):
    """The builder of the 16-lane dot (builder, acc, u, s) -> acc + per dword the 4 products of
    unsigned u and signed s bytes: vpdpbusd on 512 bits, else two 256-bit `dot`s. small: every
    u < 128."""
    if has_vnni512(features(context)):

        def vnni(builder, acc, u, s):
            fn = function(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32] * 3)
            return builder.call(fn, [acc, builder.bitcast(u, V16I32), builder.bitcast(s, V16I32)])

        return vnni
    return _halves_dot(context, small)


def summed_dots16(context):
    """u8x32.summed_dots on 16 lanes (each V64I8 pair as two 256-bit halves): summed(builder,
    acc, [(u, s), ...]) -> acc + every pair's 16-lane dot, its words summed before one
    widening (the caller's bound). None where `dot16_builder` is one instruction (VNNI) or
    AVX2 is missing."""
    summed = None if has_vnni512(features(context)) else summed_dots(context)
    if summed is None:
        return None
    bytes_ = [ir.Constant(ir.VectorType(I32, 32), list(range(k, k + 32))) for k in (0, 32)]
    lanes = [ir.Constant(V8I32, list(range(k, k + 8))) for k in (0, 8)]

    def summed16(builder, acc, products):
        halves = []
        for a, h in zip(lanes, bytes_):
            part = [(builder.shuffle_vector(u, u, h), builder.shuffle_vector(s, s, h)) for u, s in products]
            halves.append(summed(builder, builder.shuffle_vector(acc, acc, a), part))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(V16I32, list(range(16))))

    return summed16


def _lanes16_typer(small: bool):
    def typer(typingctx, u, xi, off):
        """The 16-row product of one group: (pa, pb), lane r = the dot of values 0-15 (pa) or
        16-31 (pb) of u with row r of the activations, which xi holds at off as [8 dwords][16
        rows][4 bytes] (int8): u8x32.lanes_dot's integers, 16 rows at a time."""

        def codegen(context, builder, sig, args):
            u, xi, off = args
            words = builder.bitcast(u, V8I32)
            product = dot16_builder(context, small)
            out = []
            for half_ in range(2):
                accs = [ir.Constant(V16I32, [0] * 16)] * 2  # two chains of products: half the latency
                for k in range(4 * half_, 4 * half_ + 4):
                    b = builder.bitcast(builder.shuffle_vector(words, words, ir.Constant(V16I32, [k] * 16)), _V64I8)
                    at = builder.add(off, ir.Constant(off.type, 64 * k))
                    x = builder.load(ptr(context, builder, sig.args[1], xi, at, _V64I8), align=1)
                    accs[k % 2] = product(builder, accs[k % 2], b, x)
                out.append(builder.add(accs[0], accs[1]))
            return context.make_tuple(builder, sig.return_type, out)

        return types.UniTuple(I32x16, 2)(u, xi, off), codegen

    return typer


lanes_dot16 = intrinsic(_lanes16_typer(False))
lanes_dot16_7 = intrinsic(_lanes16_typer(True))  # every u < 128


# ---------------------------------------------------------------- integer lanes (exact)


@intrinsic
def izero16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(V16I32, [0] * 16)

    return I32x16(), codegen


@intrinsic
def iload16(typingctx, arr, off):
    """16 int32 at arr[off:] (an int32 array)."""

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V16I32), align=4)

    return I32x16(arr, off), codegen


@intrinsic
def imadd16(typingctx, acc, a, k, b, j):
    """acc + a * k + b * j lane by lane, k and j integers (int32 arithmetic: exact while the
    sums stay inside int32, as the K-quants' do)."""

    def codegen(context, builder, sig, args):
        acc, a, k, b, j = args
        sk = splat(builder, context.cast(builder, k, sig.args[2], types.int32), V16I32)
        sj = splat(builder, context.cast(builder, j, sig.args[4], types.int32), V16I32)
        return builder.add(acc, builder.add(builder.mul(a, sk), builder.mul(b, sj)))

    return I32x16(acc, a, k, b, j), codegen


@intrinsic
def half_dot16(typingctx, xu, xoff, wd, woff):
    """The 16 rows' dots of 16 weights with their activations: lane r = sum over i < 16 of
    xu[xoff + 64 (i // 4) + 4 r + i % 4] (unsigned: the activations plus 128) times
    wd[woff + i] (signed: the decoded weights, each broadcast from memory to all lanes). With
    VNNI each 4 weights cost one vpdpbusd reading them straight from memory, no shuffle."""

    def codegen(context, builder, sig, args):
        xu, xoff, wd, woff = args
        product = dot16_builder(context, False)
        accs = [ir.Constant(V16I32, [0] * 16)] * 2  # two chains: half the latency
        for k in range(4):
            at = builder.add(woff, ir.Constant(woff.type, 4 * k))
            word = builder.load(ptr(context, builder, sig.args[2], wd, at, I32), align=1)
            wv = builder.bitcast(splat(builder, word, V16I32), _V64I8)
            at = builder.add(xoff, ir.Constant(xoff.type, 64 * k))
            x = builder.load(ptr(context, builder, sig.args[0], xu, at, _V64I8), align=1)
            accs[k % 2] = product(builder, accs[k % 2], x, wv)
        return builder.add(accs[0], accs[1])

    return I32x16(xu, xoff, wd, woff), codegen


@intrinsic
def isplat16(typingctx, k):
    def codegen(context, builder, sig, args):
        return splat(builder, context.cast(builder, args[0], sig.args[0], types.int32), V16I32)

    return I32x16(k), codegen


@intrinsic
def pairs_dot16(typingctx, acc, arr, off, word):
    """acc + per lane the dot of the two int16 at arr[off + lane] (an int32 array, each word
    two int16) with the two int16 of `word` (vpdpwssd, word broadcast; exact: the products and
    their sums stay inside int32 for the K-quants' activation sums and scales)."""

    def codegen(context, builder, sig, args):
        acc, arr, off, word = args
        v = builder.load(ptr(context, builder, sig.args[1], arr, off, V16I32), align=4)
        wv = splat(builder, context.cast(builder, word, sig.args[3], types.int32), V16I32)
        if "+avx512vnni" in features(context):
            fn = function(builder, "llvm.x86.avx512.vpdpwssd.512", V16I32, [V16I32] * 3)
            return builder.call(fn, [acc, v, wv])
        v32 = ir.VectorType(ir.IntType(16), 32)
        a, b = (
            builder.sext(builder.bitcast(v, v32), ir.VectorType(I32, 32)),
            builder.sext(builder.bitcast(wv, v32), ir.VectorType(I32, 32)),
        )
        p = builder.mul(a, b)
        even = builder.shuffle_vector(p, p, ir.Constant(V16I32, list(range(0, 32, 2))))
        odd = builder.shuffle_vector(p, p, ir.Constant(V16I32, list(range(1, 32, 2))))
        return builder.add(acc, builder.add(even, odd))

    return I32x16(acc, arr, off, word), codegen


# ------------------------------------------------ activation rows into int8 (kernels' _quantize)


@intrinsic
def absmax16(typingctx, bits, off, top):
    """max(top, the largest of the 16 uint32 at bits[off:] with the sign bit cleared): a float32
    row's amax by its bits (an integer max: no NaN rules, and bits past +inf's mean inf or nan)."""

    def codegen(context, builder, sig, args):
        v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V16I32), align=4)
        v = builder.and_(v, ir.Constant(V16I32, [0x7FFFFFFF] * 16))
        m = builder.call(function(builder, "llvm.vector.reduce.umax.v16i32", I32, [V16I32]), [v])
        top = context.cast(builder, args[2], sig.args[2], types.uint32)
        return builder.select(builder.icmp_unsigned(">", m, top), m, top)

    return types.uint32(bits, off, top), codegen


@intrinsic
def quant16(typingctx, x, off, inv, q, qoff):
    """q[qoff : qoff + 16] = rint(x[off : off + 16] * inv) as int8 (a float32 multiply, then
    round half to even: np.rint's values, 16 lanes at once); returns the sum of the 16 stored
    bytes."""

    def codegen(context, builder, sig, args):
        v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V16F32), align=4)
        s = splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), V16F32)
        r = builder.call(function(builder, "llvm.rint.v16f32", V16F32, [V16F32]), [builder.fmul(v, s)])
        b = builder.trunc(builder.fptosi(r, V16I32), _V16I8)
        builder.store(b, ptr(context, builder, sig.args[3], args[3], args[4], _V16I8), align=1)
        total = function(builder, "llvm.vector.reduce.add.v16i32", I32, [V16I32])
        return builder.call(total, [builder.sext(b, V16I32)])

    return types.int32(x, off, inv, q, qoff), codegen


# ------------------------------------------------ K/V rows into q8_0 / q4_0 (kv_format.fit)


def _codes16(builder, v, inv, q4: bool):
    """kv_format._codes of 16 values over their scale (v * inv): q8_0 C's roundf (llvm.round:
    halves away from zero) in [-127, 127], q4_0 trunc(v * inv + 8.5) in [0, 15]; as floats."""
    y = builder.fmul(v, inv)
    if q4:
        c = builder.call(function(builder, "llvm.trunc.v16f32", V16F32, [V16F32]), [builder.fadd(y, _splat_f(8.5))])
        lo, hi = 0.0, 15.0
    else:
        c = builder.call(function(builder, "llvm.round.v16f32", V16F32, [V16F32]), [y])
        lo, hi = -127.0, 127.0
    c = builder.call(function(builder, "llvm.maxnum.v16f32", V16F32, [V16F32, V16F32]), [c, _splat_f(lo)])
    return builder.call(function(builder, "llvm.minnum.v16f32", V16F32, [V16F32, V16F32]), [c, _splat_f(hi)])


def _splat_f(value: float):
    return ir.Constant(V16F32, [value] * 16)


def _halves(context, builder, sig, args):
    """The block's two F32x16 (values 0-15, 16-31) and inv splat."""
    p = ptr(context, builder, sig.args[0], args[0], args[1], V16F32)
    lo = builder.load(p, align=4)
    hi = builder.load(builder.gep(p, [ir.Constant(I32, 1)]), align=4)
    inv = splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), V16F32)
    return lo, hi, inv


@intrinsic
def fit_error32(typingctx, x, off, inv, stored, q4):
    """kv_format.fit's error of one candidate for the 32 values at x[off:] (float32): each
    value less its code (less 8 for q4_0) times the stored scale, squared, summed in
    kv_format._tree's order (the halves added lane by lane, then 8, 4, 2, 1). q4 a literal."""
    if not isinstance(q4, types.BooleanLiteral):
        return None
    nibbles = q4.literal_value

    def codegen(context, builder, sig, args):
        lo, hi, inv_v = _halves(context, builder, sig, args)
        s = splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), V16F32)
        sq = []
        for v in (lo, hi):
            value = _codes16(builder, v, inv_v, nibbles)
            if nibbles:
                value = builder.fsub(value, _splat_f(8.0))
            r = builder.fsub(v, builder.fmul(value, s))
            sq.append(builder.fmul(r, r))
        t = builder.fadd(sq[0], sq[1])
        for n in (8, 4, 2, 1):
            a = builder.shuffle_vector(t, t, ir.Constant(ir.VectorType(I32, n), list(range(n))))
            b = builder.shuffle_vector(t, t, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
            t = builder.fadd(a, b)
        return builder.extract_element(t, ir.Constant(I32, 0))

    return types.float32(x, off, inv, stored, q4), codegen


@intrinsic
def store_codes32(typingctx, x, off, inv, q4, out, at):
    """The codes of the 32 values at x[off:] (kv_format._codes) as a block's bytes at out[at:]
    (a uint8 array): q8_0 32 int8, q4_0 16 bytes, value i < 16 in byte i's low nibble, i + 16
    its high. q4 a literal."""
    if not isinstance(q4, types.BooleanLiteral):
        return None
    nibbles = q4.literal_value

    def codegen(context, builder, sig, args):
        lo, hi, inv_v = _halves(context, builder, sig, args)
        a, b = (builder.fptosi(_codes16(builder, v, inv_v, nibbles), V16I32) for v in (lo, hi))
        if nibbles:
            codes = builder.trunc(builder.or_(a, builder.shl(b, ir.Constant(V16I32, [4] * 16))), _V16I8)
        else:
            both = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
            codes = builder.trunc(both, ir.VectorType(I8, 32))
        builder.store(codes, ptr(context, builder, sig.args[4], args[4], args[5], codes.type), align=1)
        return context.get_dummy_value()

    return types.none(x, off, inv, q4, out, at), codegen
