"""The F32x8 operations of the kernels (types and offsets as in vec): float lanes, the scale
FMAs, widening of fp16 / bf16 weights, the expansion of a decoded group to float32, and a float
from its bits."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import (
    F32,
    FAST,
    FLOATS,
    I8,
    I16,
    I32,
    V8F32,
    V8I32,
    F32x8,
    F32x16,
    I32x8,
    features,
    function,
    ptr,
    splat,
)


@intrinsic
def fzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(V8F32, [0.0] * 8)

    return F32x8(), codegen


@intrinsic
def fsplat(typingctx, s):
    def codegen(context, builder, sig, args):
        return splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), V8F32)

    return F32x8(s), codegen


@intrinsic
def tofloat(typingctx, v):
    """An I32x8 or I32x16 as floats (the lane ops below take either width, the 8-lane and the
    16-lane kernels one sequence of ops per lane)."""
    if v not in FLOATS:
        return None
    out = FLOATS[v]

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], out.llvm_type)

    return out(v), codegen


@intrinsic
def iadd(typingctx, a, b):
    """a + b lane by lane, I32x8 or I32x16 (integers: exact)."""
    if a not in FLOATS or b != a:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return a(a, b), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c, lane by lane, rounded once (llvm.fma: vfmadd). These lane ops carry no
    fast-math flags: with them LLVM may reassociate or contract each inlined copy of a kernel
    its own way, and one row's sums would then depend on the code path that computed them."""

    if not _floats(a, b, c):
        return None
    vt = a.llvm_type

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3), f"llvm.fma.v{vt.count}f32")
        return builder.call(fn, list(args))

    return a(a, b, c), codegen


@intrinsic
def fmul(typingctx, a, b):
    if not _floats(a, b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return a(a, b), codegen


def _floats(*ts) -> bool:
    """All of ts one float vector type (F32x8 or F32x16)."""
    return ts[0] in (F32x8, F32x16) and all(t == ts[0] for t in ts)


@intrinsic
def fload(typingctx, arr, off):
    """8 floats at arr[off:] (a float32 array)."""

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1], V8F32), align=4)

    return F32x8(arr, off), codegen


@intrinsic
def hsum(typingctx, v):
    """The sum of the 8 lanes."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(F32, [F32, V8F32]), "llvm.vector.reduce.fadd.v8f32"
        )
        return builder.call(fn, [ir.Constant(F32, 0.0), args[0]], fastmath=FAST)

    return types.float32(v), codegen


@intrinsic
def fadd(typingctx, a, b):
    if not _floats(a, b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return a(a, b), codegen


@intrinsic
def fsub(typingctx, a, b):
    if not _floats(a, b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])

    return a(a, b), codegen


@intrinsic
def expand(typingctx, out, off, u, sa, sb, ma, mb):
    """out[off:off+32] = s * u + m as float32 (sa, ma for values 0-15, sb, mb for 16-31)."""

    def codegen(context, builder, sig, args):
        out, off, u = args[:3]
        sa, sb, ma, mb = (context.cast(builder, v, t, types.float32) for v, t in zip(args[3:], sig.args[3:]))
        for q in range(4):
            part = builder.shuffle_vector(u, u, ir.Constant(V8I32, list(range(8 * q, 8 * q + 8))))
            s, m = (sa, ma) if q < 2 else (sb, mb)
            v = builder.fmul(builder.uitofp(part, V8F32), splat(builder, s, V8F32), flags=FAST)
            v = builder.fadd(v, splat(builder, m, V8F32), flags=FAST)
            p = ptr(context, builder, sig.args[0], out, builder.add(off, ir.Constant(off.type, 8 * q)), V8F32)
            builder.store(v, p, align=4)
        return context.get_dummy_value()

    return types.none(out, off, u, sa, sb, ma, mb), codegen


@intrinsic
def fjoin(typingctx, a, b):
    """Two 4-tuples of floats as one F32x8 (a in lanes 0-3)."""
    if not all(isinstance(t, types.UniTuple) and t.count == 4 for t in (a, b)):
        return None

    def codegen(context, builder, sig, args):
        v = ir.Constant(V8F32, ir.Undefined)
        for t, (tup, ty) in enumerate(zip(args, sig.args)):
            for i in range(4):
                s = context.cast(builder, builder.extract_value(tup, i), ty.dtype, types.float32)
                v = builder.insert_element(v, s, ir.Constant(ir.IntType(32), 4 * t + i))
        return v

    return F32x8(a, b), codegen


@intrinsic
def lane(typingctx, v, i):
    """Lane i of an F32x8 or F32x16."""

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(v, i), codegen


@intrinsic
def hload(typingctx, arr, off):
    """8 IEEE half floats at arr[off:] (a uint16 array) as F32x8."""

    def codegen(context, builder, sig, args):
        return halves_codegen(context, builder, sig, args, 8)

    return F32x8(arr, off), codegen


def halves_codegen(context, builder, sig, args, lanes: int):
    """hload's IR for `lanes` half floats (x16's 16-lane load shares it)."""
    v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I16, lanes)), align=2)
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(F32, lanes))


@intrinsic
def q8load(typingctx, arr, off, scale):
    """8 int8 at arr[off:] (an int8 array) times scale, as F32x8: exact (an int8 times a half
    float fits a float32's significand), so no path's rounding differs from another's."""

    def codegen(context, builder, sig, args):
        return q8_codegen(context, builder, sig, args, 8)

    return F32x8(arr, off, scale), codegen


def q8_codegen(context, builder, sig, args, lanes: int):
    """q8load's IR for `lanes` values."""
    vf = ir.VectorType(F32, lanes)
    v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I8, lanes)), align=1)
    s = context.cast(builder, args[2], sig.args[2], types.float32)
    return builder.fmul(builder.sitofp(v, vf), splat(builder, s, vf))


@intrinsic
def q4load(typingctx, arr, off, shift, scale):
    """The 4-bit values of the 8 bytes at arr[off:] (a uint8 array; the low nibbles for shift
    0, the high ones for 4) less 8, times scale, as F32x8 (exact, as q8load)."""

    def codegen(context, builder, sig, args):
        return q4_codegen(context, builder, sig, args, 8)

    return F32x8(arr, off, shift, scale), codegen


def q4_codegen(context, builder, sig, args, lanes: int):
    """q4load's IR for `lanes` values (from as many bytes)."""
    vi, vf = ir.VectorType(I32, lanes), ir.VectorType(F32, lanes)
    v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I8, lanes)), align=1)
    n = builder.zext(v, vi)
    sh = splat(builder, context.cast(builder, args[2], sig.args[2], types.int32), vi)
    n = builder.and_(builder.lshr(n, sh), ir.Constant(vi, [15] * lanes))
    n = builder.sub(n, ir.Constant(vi, [8] * lanes))
    s = context.cast(builder, args[3], sig.args[3], types.float32)
    return builder.fmul(builder.sitofp(n, vf), splat(builder, s, vf))


@intrinsic
def bload(typingctx, arr, off):
    """8 bfloat16 at arr[off:] (a uint16 array) as F32x8."""

    def codegen(context, builder, sig, args):
        v = builder.load(ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I16, 8)), align=2)
        v = builder.shl(builder.zext(v, V8I32), ir.Constant(V8I32, [16] * 8))
        return builder.bitcast(v, V8F32)

    return F32x8(arr, off), codegen


@intrinsic
def fstore(typingctx, arr, off, v):
    """arr[off:off+8] = v (a float32 array; off:off+16 for an F32x16)."""
    if v not in (F32x8, F32x16):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], ptr(context, builder, sig.args[0], args[0], args[1], v.llvm_type), align=4)
        return context.get_dummy_value()

    return types.none(arr, off, v), codegen


@intrinsic
def fsplat_at(typingctx, arr, off):
    """arr's float32 at flat offset off in every lane (no negative-index wraparound: offsets
    that differ by constants stay one address register plus displacements)."""

    def codegen(context, builder, sig, args):
        return splat(builder, builder.load(ptr(context, builder, sig.args[0], args[0], args[1]), align=4), V8F32)

    return F32x8(arr, off), codegen


@intrinsic
def wload(typingctx, arr, off, z):
    """Floats at arr[off:] as a vector as wide as z (F32x8 or F32x16: its type says which)."""
    if z not in (F32x8, F32x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(ptr(context, builder, sig.args[0], args[0], args[1], z.llvm_type), align=4)

    return z(arr, off, z), codegen


@intrinsic
def wsplat_at(typingctx, arr, off, z):
    """arr's float32 at flat offset off in every lane of a vector as wide as z (fsplat_at's)."""
    if z not in (F32x8, F32x16):
        return None

    def codegen(context, builder, sig, args):
        return splat(builder, builder.load(ptr(context, builder, sig.args[0], args[0], args[1]), align=4), z.llvm_type)

    return z(arr, off, z), codegen


@intrinsic
def float_of_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], F32)

    return types.float32(types.int32), codegen


@intrinsic
def ijoin(typingctx, a, b):
    """Two 4-tuples of integers as one I32x8 (a in lanes 0-3), each truncated to 32 bits."""
    if not all(isinstance(t, types.UniTuple) and t.count == 4 for t in (a, b)):
        return None

    def codegen(context, builder, sig, args):
        v = ir.Constant(V8I32, ir.Undefined)
        for t, tup in enumerate(args):
            for i in range(4):
                s = builder.extract_value(tup, i)
                s = builder.trunc(s, I32) if s.type.width > 32 else s
                v = builder.insert_element(v, s, ir.Constant(I32, 4 * t + i))
        return v

    return I32x8(a, b), codegen


@intrinsic
def hgather(typingctx, arr, off, idx):
    """(lo, hi): lane l the IEEE half floats at bytes off + idx[l] and off + idx[l] + 2 of a
    uint8 array, as float32: the scales of one block of 8 weight rows (idx their byte offsets
    from off) in one gather where 16 scalar loads and inserts built them. The same values
    whichever way they are loaded, so no float op downstream changes."""

    def codegen(context, builder, sig, args):
        base = builder.bitcast(ptr(context, builder, sig.args[0], args[0], args[1]), I8.as_pointer())
        if "+avx2" in features(context):
            fn = function(builder, "llvm.x86.avx2.gather.d.d.256", V8I32, [V8I32, base.type, V8I32, V8I32, I8])
            ones = ir.Constant(V8I32, [-1] * 8)
            words = builder.call(fn, [ir.Constant(V8I32, [0] * 8), base, args[2], ones, ir.Constant(I8, 1)])
        else:  # no hardware gather: the same words, one load each
            words = ir.Constant(V8I32, ir.Undefined)
            for lane_ in range(8):
                at = builder.gep(base, [builder.extract_element(args[2], ir.Constant(I32, lane_))])
                word = builder.load(builder.bitcast(at, I32.as_pointer()), align=1)
                words = builder.insert_element(words, word, ir.Constant(I32, lane_))
        halves = builder.bitcast(words, ir.VectorType(I16, 16))
        out = []
        for first in (0, 1):
            h = builder.shuffle_vector(halves, halves, ir.Constant(V8I32, list(range(first, 16, 2))))
            out.append(builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), V8F32))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(F32x8, 2)(arr, off, idx), codegen


# exp(x) for x <= 0 (a score less its row maximum), to about 2.4e-7 relative: 2**k from the
# exponent bits times a degree-6 polynomial of the remainder, x floored at EXP_FLOOR (about 1e-38
# then, the smallest normal floats, never a subnormal). The one recipe of kernels/attention.exp
# (one lane) and fexp (8): the same IEEE operations in the same order, so the same bits.
EXP_FLOOR, LOG2E = -87.0, 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06
EXP_POLY = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)  # Horner's, highest first


def _f(value) -> ir.Constant:
    return ir.Constant(V8F32, [value] * 8)  # llvmlite rounds a float constant to float32


def _gt_select(builder, a, b, yes, no):
    return builder.select(builder.fcmp_ordered(">", a, b), yes, no)


@intrinsic
def fmax(typingctx, a, b):
    """Python's max(a, b) lane by lane, as numba computes it: b where b > a, else a."""

    def codegen(context, builder, sig, args):
        a, b = args
        return _gt_select(builder, b, a, b, a)

    return F32x8(a, b), codegen


def _exp(builder, x):
    x = _gt_select(builder, _f(EXP_FLOOR), x, _f(EXP_FLOOR), x)
    k = builder.fadd(builder.fmul(x, _f(LOG2E)), _f(0.5))
    k = builder.call(
        cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F32, [V8F32]), "llvm.floor.v8f32"), [k]
    )
    r = builder.fsub(builder.fsub(x, builder.fmul(k, _f(LN2_HI))), builder.fmul(k, _f(LN2_LO)))
    p = _f(EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = builder.fadd(builder.fmul(p, r), _f(c))
    bits = builder.add(builder.fptosi(k, V8I32), ir.Constant(V8I32, [127] * 8))
    return builder.fmul(p, builder.bitcast(builder.shl(bits, ir.Constant(V8I32, [23] * 8)), V8F32))


@intrinsic
def fexp(typingctx, x):
    """kernels/attention.exp on 8 lanes (see EXP_POLY)."""

    def codegen(context, builder, sig, args):
        return _exp(builder, args[0])

    return F32x8(x), codegen


@intrinsic
def fweights(typingctx, s, m):
    """exp(s - m) where s > -inf, else 0: a masked key weighs nothing, not exp's floor."""

    def codegen(context, builder, sig, args):
        s, m = args
        e = _exp(builder, builder.fsub(s, m))
        return _gt_select(builder, s, _f(float("-inf")), e, _f(0.0))

    return F32x8(s, m), codegen
