"""The F32x8 operations of the kernels (see _simd): float lanes, the scale FMAs, widening of
fp16 / bf16 weights, and the expansion of a decoded group to float32."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.quant._simd import _F32, _FAST, _I16, _V8F32, _V8I32, F32x8, _ptr, _splat


@intrinsic
def fzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V8F32, [0.0] * 8)

    return F32x8(), codegen


@intrinsic
def fsplat(typingctx, s):
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _V8F32)

    return F32x8(s), codegen


@intrinsic
def fpair(typingctx, a, b):
    """[a, a, a, a, b, b, b, b]: one scale per 16 bytes of a `dot`."""

    def codegen(context, builder, sig, args):
        va = _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _V8F32)
        vb = _splat(builder, context.cast(builder, args[1], sig.args[1], types.float32), _V8F32)
        return builder.shuffle_vector(va, vb, ir.Constant(_V8I32, [0, 1, 2, 3, 12, 13, 14, 15]))

    return F32x8(a, b), codegen


@intrinsic
def tofloat(typingctx, v):
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _V8F32)

    return F32x8(v), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c, lane by lane."""

    def codegen(context, builder, sig, args):
        return builder.fadd(builder.fmul(args[0], args[1], flags=_FAST), args[2], flags=_FAST)

    return F32x8(a, b, c), codegen


@intrinsic
def fmul(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1], flags=_FAST)

    return F32x8(a, b), codegen


@intrinsic
def fload(typingctx, arr, off):
    """8 floats at arr[off:] (a float32 array)."""

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _V8F32), align=4)

    return F32x8(arr, off), codegen


@intrinsic
def hsum(typingctx, v):
    """The sum of the 8 lanes."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32, _V8F32]), "llvm.vector.reduce.fadd.v8f32"
        )
        return builder.call(fn, [ir.Constant(_F32, 0.0), args[0]], fastmath=_FAST)

    return types.float32(v), codegen


@intrinsic
def fadd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1], flags=_FAST)

    return F32x8(a, b), codegen


@intrinsic
def expand(typingctx, out, off, u, sa, sb, ma, mb):
    """out[off:off+32] = s * u + m as float32 (sa, ma for values 0-15, sb, mb for 16-31)."""

    def codegen(context, builder, sig, args):
        out, off, u = args[:3]
        sa, sb, ma, mb = (context.cast(builder, v, t, types.float32) for v, t in zip(args[3:], sig.args[3:]))
        for q in range(4):
            part = builder.shuffle_vector(u, u, ir.Constant(_V8I32, list(range(8 * q, 8 * q + 8))))
            s, m = (sa, ma) if q < 2 else (sb, mb)
            v = builder.fmul(builder.uitofp(part, _V8F32), _splat(builder, s, _V8F32), flags=_FAST)
            v = builder.fadd(v, _splat(builder, m, _V8F32), flags=_FAST)
            p = _ptr(context, builder, sig.args[0], out, builder.add(off, ir.Constant(off.type, 8 * q)), _V8F32)
            builder.store(v, p, align=4)
        return context.get_dummy_value()

    return types.none(out, off, u, sa, sb, ma, mb), codegen


@intrinsic
def lane(typingctx, v, i):
    """Lane i of an F32x8."""

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(v, i), codegen


@intrinsic
def hload(typingctx, arr, off):
    """8 IEEE half floats at arr[off:] (a uint16 array) as F32x8."""

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I16, 8)), align=2)
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), _V8F32)

    return F32x8(arr, off), codegen


@intrinsic
def bload(typingctx, arr, off):
    """8 bfloat16 at arr[off:] (a uint16 array) as F32x8."""

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I16, 8)), align=2)
        v = builder.shl(builder.zext(v, _V8I32), ir.Constant(_V8I32, [16] * 8))
        return builder.bitcast(v, _V8F32)

    return F32x8(arr, off), codegen


@intrinsic
def fstore(typingctx, arr, off, v):
    """arr[off:off+8] = v (a float32 array)."""

    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1], _V8F32), align=4)
        return context.get_dummy_value()

    return types.none(arr, off, v), codegen


@intrinsic
def fsplat_at(typingctx, arr, off):
    """arr's float32 at flat offset off in every lane (no negative-index wraparound: offsets
    that differ by constants stay one address register plus displacements)."""

    def codegen(context, builder, sig, args):
        return _splat(builder, builder.load(_ptr(context, builder, sig.args[0], args[0], args[1]), align=4), _V8F32)

    return F32x8(arr, off), codegen
