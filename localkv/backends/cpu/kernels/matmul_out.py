"""The 8-lane matmul for a few activation rows (decode) with 8 weight rows, not 8 activation
rows, in the lanes: matmul_lanes' bits for each row, without its 7 idle lanes when one row
is multiplied.

matmul_lanes (matmul_few) gives a row's output n by one lane's float ops, group after group
(matmul_few.walk, each group's matmul_few.group_step), from pa, pb the integer dots of the
group's two 16-value halves and sa, sb, ma, mb the weight row's scales. Here lane l runs
that same sequence for weight row n + l: the 8 rows' groups are decoded one by one
(formats.group), each dotted with the row's int8 activations (u8x32.dot), the 8 dots summed
across lanes into (pa, pb) by quad_sums and halves (integer sums: exact in any order), and
the scales gathered into vectors (formats.scales8: one hardware gather where a block opens
with its f16 scales, the scalars joined for the others: BENCHMARKS.md has the gain). Same
values, same float ops in the same order, so the same bits; tests/test_matmul_out.py holds
them equal for every block type.

A work chunk (matmul_few.CHUNK rows) is 8 rows at a time; past a matrix's last row the lanes
repeat it and are not written. Each activation row walks the 8 weight rows again: they are
in L1 by then, so a call of R rows reads the weights once but decodes them R times (which
is why more rows go to the lanes kernel: out_rows).
"""

from numba import njit, prange
from numba.extending import register_jitable

from localkv.backends.cpu.formats.blocks import GATHERED, act_group, group, product, scales8
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import PREFETCH, chunk, chunks, group_step, lanes_chunk, quantized, walk
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fsplat, ijoin, lane
from localkv.backends.cpu.simd.u8x32 import at, halves, izero, load32, prefetch, quad_sums

LANES = 8  # weight rows per vector


def out_rows(qtype: str) -> int:
    """Up to this many activation rows matmul_out is faster than matmul_lanes
    (quant.compiled.every_row): it decodes the weights once per row, the lanes kernel once per
    8 rows; a block whose scales are gathered (formats.GATHERED) is cheap enough for 2
    (BENCHMARKS.md)."""
    return 2 if qtype in GATHERED else 1


@register_jitable(**NO_NRT)
def _four(qt, w, o, blk, j, xv):
    """Group j of the blocks at blk of 4 weight rows (their byte offsets o) . activations xv:
    (quad_sums of the 4 dots, the 4 rows' sa, sb, ma, mb as 4-tuples)."""
    prefetch(w, o[0] + blk + PREFETCH)
    prefetch(w, o[1] + blk + PREFETCH)
    prefetch(w, o[2] + blk + PREFETCH)
    prefetch(w, o[3] + blk + PREFETCH)
    u0, sa0, sb0, ma0, mb0 = group(qt, w, o[0] + blk, j)
    u1, sa1, sb1, ma1, mb1 = group(qt, w, o[1] + blk, j)
    u2, sa2, sb2, ma2, mb2 = group(qt, w, o[2] + blk, j)
    u3, sa3, sb3, ma3, mb3 = group(qt, w, o[3] + blk, j)
    z = izero()
    p = quad_sums(product(qt, z, u0, xv), product(qt, z, u1, xv), product(qt, z, u2, xv), product(qt, z, u3, xv))
    return p, (sa0, sa1, sa2, sa3), (sb0, sb1, sb2, sb3), (ma0, ma1, ma2, ma3), (mb0, mb1, mb2, mb3)


@register_jitable(**NO_NRT)
def _out_step(qt, w, blk, j, g, inp, a, m):
    """Group j of the block at blk of 8 weight rows (group g of the rows) . one activation
    row, into a and m: _lanes_step's float ops, lane l for weight row l. inp: the rows' byte
    offsets (two 4-tuples), quantized()'s xq, dx, xs16 and the activation row r."""
    lo, hi, idx, xq, dx, xs16, r = inp
    i = r * dx.shape[1] + g
    xv = load32(xq, 32 * i)
    p, sa, sb, ma, mb = _four(qt, w, lo, blk, j, xv)
    q, ta, tb, na, nb = _four(qt, w, hi, blk, j, xv)
    pa, pb = halves(p, q)
    scales = scales8(qt, w, lo[0] + blk, idx, ((sa, ta), (sb, tb), (ma, na), (mb, nb)))
    xsa, xsb = fsplat(at(xs16, 2 * i)), fsplat(at(xs16, 2 * i + 1))
    return group_step(qt, pa, pb, scales, fsplat(at(dx, i)), xsa, xsb, a, m)


@register_jitable(**NO_NRT)
def _rows(n, last, nbytes):
    """The byte offsets of weight rows n..n+7 (the last row repeated past last), as two 4-tuples."""
    lo = (n * nbytes, min(n + 1, last) * nbytes, min(n + 2, last) * nbytes, min(n + 3, last) * nbytes)
    return lo, (min(n + 4, last) * nbytes, min(n + 5, last) * nbytes, min(n + 6, last) * nbytes,
                min(n + 7, last) * nbytes)  # fmt: skip


@register_jitable(**NO_NRT)
def _from_first(lo, hi):
    """The 8 rows' byte offsets (_rows) less the first one's, as I32x8: scales8's gather."""
    b = lo[0]
    return ijoin((0, lo[1] - b, lo[2] - b, lo[3] - b), (hi[0] - b, hi[1] - b, hi[2] - b, hi[3] - b))


@njit(**EXACT_PAR)
def matmul_out(qt, x, ws, offs, out):
    """out[:, offs[i] + n] = x @ row n of ws[i] for the three matrices ws (as matmul_lanes), each
    output the bits matmul_lanes gives it. x float32 [R, K], R >= 1."""
    xq, dx, xs16 = quantized(x, act_group(qt))
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        out_chunk(qt, ws[i], n0, n1, col, xq, dx, xs16, out)


@njit(**EXACT_PAR)
def lanes_then_out(qt, xi, dxv, xsa, xsb, ws, offs, out_l, x, out):
    """matmul_lanes into out_l for lanes_inputs' blocks of 8 (xi, dxv, xsa, xsb) and matmul_out
    into out for the rows of x, in one pass: each work chunk's weights multiplied into the
    blocks, then into x's rows while they are in the caches (a pass of 8 + 1 rows reads its
    weights from memory once, not twice). A kernel apart from matmul_out: a decode step's
    call with five more arguments cost 1.2 us more (numba's dispatch), 121 calls a step."""
    xq, dx, xs16 = quantized(x, act_group(qt))
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        lanes_chunk(qt, ws[i], n0, n1, col, xi, dxv, xsa, xsb, out_l)
        out_chunk(qt, ws[i], n0, n1, col, xq, dx, xs16, out)


@register_jitable(**NO_NRT)
def out_chunk(qt, w, n0, n1, col, xq, dx, xs16, out):
    """matmul_out's work on weight rows n0 .. n1 - 1 of w (a work chunk) for the rows of xq,
    dx, xs16 (quantized()'s)."""
    ng = xq.shape[1] // 32
    for n in range(n0, n1, LANES):
        lo, hi = _rows(n, w.shape[0] - 1, w.shape[1])
        idx = _from_first(lo, hi)
        for r in range(xq.shape[0]):
            v = walk(_out_step, qt, w, 0, (lo, hi, idx, xq, dx, xs16, r), ng)
            for k in range(min(LANES, n1 - n)):
                out[r, col + n + k] = lane(v, k)
