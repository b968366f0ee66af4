"""The 32-value types' integer dot of one packed block (formats/packed: 16 weight rows
interleaved, dword k of row n at byte 64k + 4n) with one activation row, for
kernels/matmul_packed: 16 lanes, lane n the exact sum over the block's 32 values of weight
row n's unsigned u times the row's int8 activations.

Each 64-byte load holds 4 weights of each of the 16 rows; one vpdpbusd multiplies them with
the 4 activations they meet, broadcast to every lane, so no sum crosses lanes. Q4_0 and Q4_1
hold two values per byte: low nibbles are values 4k..4k+3, high nibbles 16 + 4k..; Q8_0's
bytes are u already. Two chains of products, added at the end (integers: exact). Offsets in
bytes (p uint8, xq int8), nothing bounds-checked.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import I8, I32, V16I32, I32x16, ptr, splat
from localkv.backends.cpu.simd.x16 import dot16_builder

_V64I8 = ir.VectorType(I8, 64)


def _codegen(nibbles: bool, rows: int):
    def codegen(context, builder, sig, args):
        p, off, xq = args[:3]
        xoffs = args[3:]
        dot = dot16_builder(context, nibbles)  # nibbles: every u < 128
        low = ir.Constant(_V64I8, [15] * 64)
        accs = [[ir.Constant(V16I32, [0] * 16)] * 2 for _ in range(rows)]

        def product(i, u, at):
            for r, xoff in enumerate(xoffs):
                x = builder.load(
                    ptr(context, builder, sig.args[2], xq, builder.add(xoff, ir.Constant(xoff.type, at)), I32)
                )
                xs = builder.bitcast(splat(builder, x, V16I32), _V64I8)
                accs[r][i % 2] = dot(builder, accs[r][i % 2], u, xs)

        for k in range(4 if nibbles else 8):
            at = builder.add(off, ir.Constant(off.type, 64 * k))
            v = builder.load(ptr(context, builder, sig.args[0], p, at, _V64I8), align=1)
            if nibbles:
                product(k, builder.and_(v, low), 4 * k)
                product(k + 1, builder.and_(builder.lshr(v, ir.Constant(_V64I8, [4] * 64)), low), 16 + 4 * k)
            else:
                product(k, v, 4 * k)
        sums = [builder.add(a, b) for a, b in accs]
        return sums[0] if rows == 1 else context.make_tuple(builder, sig.return_type, sums)

    return codegen


@intrinsic
def q4_dot16(typingctx, p, off, xq, xoff):
    """The packed Q4_0 / Q4_1 block at byte off of p . the 32 activations at xq[xoff:]."""
    return I32x16(p, off, xq, xoff), _codegen(True, 1)


@intrinsic
def q8_dot16(typingctx, p, off, xq, xoff):
    """The packed Q8_0 block (u bytes) at byte off of p . the 32 activations at xq[xoff:]."""
    return I32x16(p, off, xq, xoff), _codegen(False, 1)


@intrinsic
def q4_dot16x4(typingctx, p, off, xq, x0, x1, x2, x3):
    """q4_dot16 for 4 activation rows (at xq[x0:], ..): each weight vector unpacked once."""
    return types.UniTuple(I32x16, 4)(p, off, xq, x0, x1, x2, x3), _codegen(True, 4)


@intrinsic
def q8_dot16x4(typingctx, p, off, xq, x0, x1, x2, x3):
    """q8_dot16 for 4 activation rows: each weight vector loaded once."""
    return types.UniTuple(I32x16, 4)(p, off, xq, x0, x1, x2, x3), _codegen(False, 4)
