"""An 8 x 8 block of floats stored transposed: eight F32x8 rows in, their columns out, by the
three rounds of in-register shuffles (unpack pairs, pick pairs of pairs, swap 128-bit halves)
that x86 lowers to unpcklps/unpckhps, shufps and vperm2f128. Moves only: no value changes."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from localkv.backends.cpu.simd.vec import I32, F32x8, ptr


def _shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 8), mask))


def _transpose(builder, rows):
    """The columns of 8 rows (lists of 8 lane values per vector)."""
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    t = []
    for i in range(0, 8, 2):  # t[i]: rows i, i+1 interleaved, columns 0,1 | 4,5; t[i+1]: 2,3 | 6,7
        t += [_shuffle(builder, rows[i], rows[i + 1], lo), _shuffle(builder, rows[i], rows[i + 1], hi)]
    first, second = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    u = []
    for i in (0, 4):  # u: rows i..i+3 of columns c | c+4, for c = 0, 1, 2, 3
        u += [
            _shuffle(builder, t[i], t[i + 2], first),
            _shuffle(builder, t[i], t[i + 2], second),
            _shuffle(builder, t[i + 1], t[i + 3], first),
            _shuffle(builder, t[i + 1], t[i + 3], second),
        ]
    low, high = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    cols = [_shuffle(builder, u[c], u[c + 4], low) for c in range(4)]
    return cols + [_shuffle(builder, u[c], u[c + 4], high) for c in range(4)]


@intrinsic
def tstore8(typingctx, arr, off, stride, v0, v1, v2, v3, v4, v5, v6, v7):
    """arr[off + j * stride + i] = v_i[j] for i, j < 8 (a float32 array): row i of the block
    becomes column i."""
    if any(v != F32x8 for v in (v0, v1, v2, v3, v4, v5, v6, v7)):
        return None

    def codegen(context, builder, sig, args):
        at = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
        step = builder.sext(args[2], ir.IntType(64)) if args[2].type.width < 64 else args[2]
        for j, col in enumerate(_transpose(builder, list(args[3:]))):
            where = builder.add(at, builder.mul(step, ir.Constant(ir.IntType(64), j)))
            builder.store(col, ptr(context, builder, sig.args[0], args[0], where, col.type), align=4)
        return context.get_dummy_value()

    return types.none(arr, off, stride, v0, v1, v2, v3, v4, v5, v6, v7), codegen
