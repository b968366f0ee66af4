"""The 32-value types' integer dots of one packed block (formats/packed: 16 weight rows
interleaved, dword k of row n at byte 64k + 4n) with one or a few activation rows, for
kernels/matmul_packed: 16 lanes, lane n the exact sum over the block's 32 values of weight
row n's unsigned u times the row's int8 activations.

Each 64-byte load holds 4 weights of each of the 16 rows; one vpdpbusd multiplies them with
the 4 activations they meet, broadcast to every lane, so no sum crosses lanes. Q4_0 and Q4_1
hold two values per byte: low nibbles are values 4k..4k+3, high nibbles 16 + 4k..; Q8_0's
bytes are u already. Each weight vector is loaded (and unpacked) once for every row given;
two chains of products per row, added at the end (integers: exact). Without VNNI (AVX2)
a nibble block's 8 products are vpmaddubsw's int16 words, summed as words and widened once
(x16.summed_dots16): the same integers. Offsets in bytes (p uint8, xq int8), nothing
bounds-checked.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import I8, I32, V16I32, I32x16, ptr, splat
from localkv.backends.cpu.simd.x16 import dot16_builder, summed_dots16

_V64I8 = ir.VectorType(I8, 64)


def _typer(nibbles: bool):
    def typer(typingctx, p, off, xq, xoffs):
        """The dots for each activation row whose offset xoffs holds (a UniTuple of integers):
        a UniTuple of I32x16, each weight vector loaded (and unpacked) once for all of them."""
        if not isinstance(xoffs, types.UniTuple):
            return None
        rows = xoffs.count

        def codegen(context, builder, sig, args):
            p, off, xq, xoffs = args
            starts = cgutils.unpack_tuple(builder, xoffs, rows)
            dot = dot16_builder(context, nibbles)  # nibbles: every u < 128
            summed = summed_dots16(context) if nibbles else None  # 8 x 2 x 15 x 128 < 32768
            low = ir.Constant(_V64I8, [15] * 64)
            zero = ir.Constant(V16I32, [0] * 16)
            accs = [[zero] * 2 for _ in range(rows)]  # two chains per row
            products = [[] for _ in range(rows)]  # summed's: one widening a row (registers)

            def product(i, u, at):
                for r, xoff in enumerate(starts):
                    addr = builder.add(xoff, ir.Constant(xoff.type, at))
                    x = builder.load(ptr(context, builder, sig.args[2], xq, addr, I32))
                    xs = builder.bitcast(splat(builder, x, V16I32), _V64I8)
                    if summed:
                        products[r].append((u, xs))
                    else:
                        accs[r][i % 2] = dot(builder, accs[r][i % 2], u, xs)

            for k in range(4 if nibbles else 8):
                at = builder.add(off, ir.Constant(off.type, 64 * k))
                v = builder.load(ptr(context, builder, sig.args[0], p, at, _V64I8), align=1)
                if nibbles:
                    product(k, builder.and_(v, low), 4 * k)
                    product(k + 1, builder.and_(builder.lshr(v, ir.Constant(_V64I8, [4] * 64)), low), 16 + 4 * k)
                else:
                    product(k, v, 4 * k)
            if summed:
                accs = [[summed(builder, zero, ps), zero] for ps in products]
            return context.make_tuple(builder, sig.return_type, [builder.add(a, b) for a, b in accs])

        return types.UniTuple(I32x16, rows)(p, off, xq, xoffs), codegen

    return typer


# q4_dots16(p, off, xq, xoffs): the packed Q4_0 / Q4_1 block at byte off of p . the 32
# activations at xq[x:] for each x of xoffs; q8_dots16: the same for a packed Q8_0 block (u bytes)
q4_dots16 = intrinsic(_typer(True))
q8_dots16 = intrinsic(_typer(False))
