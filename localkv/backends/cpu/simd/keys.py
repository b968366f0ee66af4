"""The score of one quantized key block against 8 or 16 query rows (the lanes), in integers:
what kernels/key_scores builds a chunk's scores from.

A q8_0 / q4_0 key block is 32 codes and an f16 scale dk; the query rows are quantized per 32
values too (codes q, scale dq: the weights' activation rule). The block's part of a score is
dq * dk times the integer dot of the codes, summed exactly in int32 (vpdpbusd, 4 products a
lane per step), so it is the same integer however the products are grouped: any lane layout,
any instruction set, the GPU's. The dot takes one unsigned operand: the key's codes shifted
into it (q8_0 + 128, q4_0 its nibbles as stored, value + 8), and the shift times the query's
code sum (qs) taken off after. Offsets as in vec (elements of the arrays; bytes of the pool).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from localkv.backends.cpu.simd.u8x32 import dot_builder
from localkv.backends.cpu.simd.vec import F32, I8, I32, V8I32, V16F32, V16I32, F32x8, F32x16, I32x16, ptr, splat
from localkv.backends.cpu.simd.x16 import dot16_builder

SHIFT = {"q8_0": 128, "q4_0": 8}  # what the unsigned operand adds to a key's code


@intrinsic
def key_block(typingctx, pool, at, xi, xoff, dq, qs, off, s):
    """s + (dq * dk) * dot, lane by lane (one rounding for the product dq * dk, one for the
    fma): the key block at byte `at` of a q8_0 (int8) or q4_0 (uint8) pool, dk its f16 scale,
    dot its 32 codes' products with each lane's query codes, which xi holds from xoff as [8
    dwords][L rows][4 bytes] (int8, L = s's lanes: 8 or 16), less the shift times qs[off + lane]
    (int32: the sum of the lane's 32 codes); dq[off + lane] the lane's scale (float32)."""
    if s not in (F32x8, F32x16) or pool.dtype not in (types.int8, types.uint8):
        return None
    q4 = pool.dtype == types.uint8
    lanes = s.llvm_type.count
    vi = V8I32 if lanes == 8 else V16I32
    vbytes = ir.VectorType(I8, 4 * lanes)
    shift = SHIFT["q4_0" if q4 else "q8_0"]

    def codegen(context, builder, sig, args):
        pool_v, at_v, xi_v, xoff_v, dq_v, qs_v, off_v, s_v = args
        dot = (dot_builder if lanes == 8 else dot16_builder)(context, q4)  # q4: every unsigned byte < 16
        accs = [ir.Constant(vi, [0] * lanes)] * 2  # two chains of products: half the latency
        for k in range(8):
            byte = builder.add(at_v, ir.Constant(at_v.type, 2 + (4 * (k % 4) if q4 else 4 * k)))
            word = builder.load(ptr(context, builder, sig.args[0], pool_v, byte, I32), align=1)
            if q4:  # values 0-15 are the low nibbles of the 16 bytes, 16-31 the high ones
                if k >= 4:
                    word = builder.lshr(word, ir.Constant(I32, 4))
                word = builder.and_(word, ir.Constant(I32, 0x0F0F0F0F))
            else:
                word = builder.xor(word, ir.Constant(I32, 0x80808080))  # int8 + 128 as uint8
            u = builder.bitcast(splat(builder, word, vi), vbytes)
            x_at = builder.add(xoff_v, ir.Constant(xoff_v.type, 4 * lanes * k))
            x = builder.load(ptr(context, builder, sig.args[2], xi_v, x_at, vbytes), align=1)
            accs[k % 2] = dot(builder, accs[k % 2], u, x)
        total = builder.add(accs[0], accs[1])
        sums = builder.load(ptr(context, builder, sig.args[5], qs_v, off_v, vi), align=4)
        total = builder.sub(total, builder.mul(sums, ir.Constant(vi, [shift] * lanes)))
        h = builder.load(
            builder.bitcast(ptr(context, builder, sig.args[0], pool_v, at_v), ir.HalfType().as_pointer()), align=1
        )
        dk = splat(builder, builder.fpext(h, F32), s.llvm_type)
        w = builder.fmul(builder.load(ptr(context, builder, sig.args[4], dq_v, off_v, s.llvm_type), align=4), dk)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(s.llvm_type, [s.llvm_type] * 3), f"llvm.fma.v{lanes}f32"
        )
        return builder.call(fn, [builder.sitofp(total, s.llvm_type), w, s_v])

    return s(pool, at, xi, xoff, dq, qs, off, s), codegen


# ------------------------------------------------------- 16 keys in the lanes (few query rows)


def _label_shuffle(builder, x, lx, y, ly, want):
    """The vector of labels `want` from x and y, whose lanes carry the labels lx and ly."""
    where = {label: i for i, label in enumerate(lx)} | {label: len(lx) + i for i, label in enumerate(ly)}
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, len(want)), [where[w] for w in want]))


def _transpose16(builder, rows):
    """16 keys' 8 dwords (rows: 16 V8I32) -> 8 V16I32, vector k holding dword k of keys 0-15:
    four rounds of two-source shuffles (vpermt2d), each doubling the keys a vector spans."""
    vecs = [(r, [(j, k) for k in range(8)]) for j, r in enumerate(rows)]
    span = 1  # keys per vector
    while span < 16:
        out = []
        for a in range(0, len(vecs), 2):
            (x, lx), (y, ly) = vecs[a], vecs[a + 1]
            keys = sorted({j for j, _ in lx} | {j for j, _ in ly})
            ks = sorted({k for _, k in lx})
            step = 16 // (2 * span)  # dwords per key in each output vector
            for c in range(0, len(ks), step):
                want = [(j, k) for k in ks[c : c + step] for j in keys]
                out.append((_label_shuffle(builder, x, lx, y, ly, want), want))
        # pair next the vectors of the same dwords and neighbouring keys
        vecs, span = sorted(out, key=lambda p: (p[1][0][1], p[1][0][0])), 2 * span
    return [v for v, _ in vecs]


@intrinsic
def key_words16(typingctx, pool, offs, t, row, at):
    """The key blocks at byte `at` of the pool rows offs[t .. t + 15] (row: a row's bytes),
    their codes as dot's unsigned bytes (q8_0 + 128, q4_0 nibbles) with the keys in the lanes:
    (words, dk), words[k] lane j = key t + j's codes 4k .. 4k + 3, dk lane j its scale."""
    if pool.dtype not in (types.int8, types.uint8):
        return None
    q4 = pool.dtype == types.uint8
    words_t = types.UniTuple(I32x16, 8)
    v16i8, v32i8 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)

    def codegen(context, builder, sig, args):
        pool_v, offs_v, t_v, row_v, at_v = args
        i64 = ir.IntType(64)
        rows, scales = [], ir.Constant(ir.VectorType(ir.IntType(16), 16), ir.Undefined)
        for j in range(16):
            o = builder.load(ptr(context, builder, sig.args[1], offs_v, builder.add(t_v, ir.Constant(t_v.type, j))))
            base = builder.add(builder.mul(builder.sext(o, i64), builder.sext(row_v, i64)), builder.sext(at_v, i64))
            h = builder.load(
                builder.bitcast(ptr(context, builder, sig.args[0], pool_v, base), ir.IntType(16).as_pointer()), align=1
            )
            scales = builder.insert_element(scales, h, ir.Constant(I32, j))
            codes = builder.add(base, ir.Constant(i64, 2))
            if q4:  # values 0-15: the 16 bytes' low nibbles, 16-31 their high ones
                b = builder.load(ptr(context, builder, sig.args[0], pool_v, codes, v16i8), align=1)
                lo = builder.and_(b, ir.Constant(v16i8, [15] * 16))
                hi = builder.lshr(b, ir.Constant(v16i8, [4] * 16))
                w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
            else:
                w = builder.load(ptr(context, builder, sig.args[0], pool_v, codes, v32i8), align=1)
            rows.append(builder.bitcast(w, V8I32))
        words = _transpose16(builder, rows)
        if not q4:  # int8 + 128 as uint8, on the transposed words: 8 ops, not 16
            words = [builder.xor(w, ir.Constant(V16I32, [0x80808080] * 16)) for w in words]
        dk = builder.fpext(builder.bitcast(scales, ir.VectorType(ir.HalfType(), 16)), V16F32)
        return context.make_tuple(builder, sig.return_type, [context.make_tuple(builder, words_t, words), dk])

    return types.Tuple((words_t, F32x16))(pool, offs, t, row, at), codegen


@intrinsic
def rows_dot16(typingctx, words, xq, off, sub, dq, dk, s):
    """s + (dq * dk) * (dot - sub), lane by lane (key_block's rounding): dot lane j = the
    products of key j's codes (words, key_words16) with one query row's 32 codes at xq[off:]
    (int8), each dword broadcast to the 16 keys; sub the shift times the row's code sum."""

    def codegen(context, builder, sig, args):
        words_v, xq_v, off_v, sub_v, dq_v, dk_v, s_v = args
        dot = dot16_builder(context, False)
        accs = [ir.Constant(V16I32, [0] * 16)] * 2
        for k in range(8):
            at = builder.add(off_v, ir.Constant(off_v.type, 4 * k))
            word = builder.load(ptr(context, builder, sig.args[1], xq_v, at, I32), align=1)
            q = builder.bitcast(splat(builder, word, V16I32), ir.VectorType(I8, 64))
            u = builder.bitcast(builder.extract_value(words_v, k), ir.VectorType(I8, 64))
            accs[k % 2] = dot(builder, accs[k % 2], u, q)
        total = builder.sub(
            builder.add(accs[0], accs[1]),
            splat(builder, context.cast(builder, sub_v, sig.args[3], types.int32), V16I32),
        )
        w = builder.fmul(splat(builder, context.cast(builder, dq_v, sig.args[4], types.float32), V16F32), dk_v)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F32, [V16F32] * 3), "llvm.fma.v16f32")
        return builder.call(fn, [builder.sitofp(total, V16F32), w, s_v])

    return F32x16(words, xq, off, sub, dq, dk, s), codegen
