"""matmul_lanes (matmul_few) with 16 activation rows in the lanes of 512-bit vectors: the same
bits for every row, about half the instructions per row where the CPU has AVX-512 VNNI.

Why: a prefill pass spends most of its time in the lanes kernel, and each of its groups pays
the weights' decode, the broadcast of each 4 weights and the scale arithmetic once per 8 rows.
Here they are paid once per 16 rows, and each integer product (x16.lanes_dot16) covers 16 rows
in one instruction. Lane r runs _lanes_step's float ops in walk's order, like lane r of the
8-lane kernel, on the same integers (exact in any width), so it computes the same bits
(tests/backends/test_matmul_wide.py holds them equal for every block type; the one-answer rule
of backends/cpu/backend.py is then kept whichever kernel a row lands in).

quant.compiled.every_row gives this kernel a pass's whole blocks of 16 rows where the CPU has
AVX-512 VNNI (`chosen`), the rest to the 8-lane kernel and matmul_out. Elsewhere the kernel
compiles and agrees too (its products then run as two 256-bit ones), but is not faster.
"""

import llvmlite.binding as llvm
import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.formats.blocks import act_group, group
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import CHUNK, PREFETCH, chunk, chunks, group_step, quantized, walk_from
from localkv.backends.cpu.kernels.matmul_out import out_chunk
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fadd, fstore
from localkv.backends.cpu.simd.u8x32 import prefetch
from localkv.backends.cpu.simd.x16 import has_vnni512, lanes_dot16, lanes_dot16_7, load16, splat16, zero16

LANES = 16  # activation rows per block


def chosen() -> bool:
    """Whether every_row gives blocks of 16 rows to this kernel on this CPU: where its product
    is one instruction (numba compiles for the host's features)."""
    return has_vnni512("".join(f"+{k}," for k, on in llvm.get_host_cpu_features().items() if on))


def _product(qt, u, xi, off):
    """formats.lanes_product for 16 rows: dot7's form unless u may reach 128 (Q8_0)."""


@overload(_product, inline="always")
def _product_of(qt, u, xi, off):
    if qt.qname == "Q8_0":
        return lambda qt, u, xi, off: lanes_dot16(u, xi, off)
    return lambda qt, u, xi, off: lanes_dot16_7(u, xi, off)


@register_jitable(**NO_NRT)
def _wide_step(qt, w, blk, j, g, inp, a, m):
    """matmul_few._lanes_step for 16 rows (inp: lanes_inputs(qt, x, 16)'s xi, dxv, xsa, xsb)."""
    xi, dxv, xsa, xsb = inp
    prefetch(w, blk + PREFETCH)
    u, sa, sb, ma, mb = group(qt, w, blk, j)
    pa, pb = _product(qt, u, xi, 512 * g)
    scales = (splat16(sa), splat16(sb), splat16(ma), splat16(mb))
    return group_step(qt, pa, pb, scales, load16(dxv, 16 * g), load16(xsa, 16 * g), load16(xsb, 16 * g), a, m)


@register_jitable(**NO_NRT)
def transpose16(vb, tb):
    """tb = the 16 x 16 floats of vb transposed (both small, in L1: moves, no rounding). Writing
    a chunk's outputs to out a column at a time (a scalar store per token row, each to another
    cache line) cost a quarter of a prefill matmul's time."""
    for t in range(LANES):
        for r in range(LANES):
            tb[LANES * t + r] = vb[LANES * r + t]


@njit(**EXACT_PAR)
def matmul_wide(qt, xi, dxv, xsa, xsb, ws, offs, out, xt, out_t):
    """matmul_lanes for lanes_inputs(qt, x, 16)'s blocks (out [16 * blocks, outputs]): row r's
    outputs are lane r % 16 of its block, matmul_lanes' bits. A block's activations stay in L1
    while a work chunk's weight rows pass over them (two rows per pass, sharing the loads of
    the activations, measured slower on Q4_1 and Q8_0). The rows of xt [t, K] (t >= 0: a pass's
    last rows past its blocks) go through matmul_out's arithmetic into out_t in the same pass,
    each chunk's weights still in the caches."""
    nb, ng = xi.shape[0], xi.shape[1] // 512
    xq, dx, xs16 = quantized(xt, act_group(qt))
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w = ws[i]
        vb, tb = np.empty(LANES * CHUNK, np.float32), np.empty(LANES * CHUNK, np.float32)
        for b in range(nb):
            inp = (xi[b], dxv[b], xsa[b], xsb[b])
            for n in range(n0, n1):
                a0, a1, m0, m1 = walk_from(_wide_step, qt, w, n * w.shape[1], inp, ng, zero16())
                fstore(vb, LANES * (n - n0), fadd(fadd(a0, a1), fadd(m0, m1)))
            transpose16(vb, tb)  # out's rows are tokens: each takes the chunk's outputs in one store
            for r in range(LANES):
                out[b * LANES + r, col + n0 : col + n1] = tb[LANES * r : LANES * r + n1 - n0]
        if len(xt):
            out_chunk(qt, w, n0, n1, col, xq, dx, xs16, out_t)
