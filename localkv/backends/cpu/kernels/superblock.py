"""The decode kernel of Q4_K and Q6_K weights: one or two activation rows, a super-block of 256
weights at a time (`simd/wide`), as llama.cpp's K-quant dots.

The generic kernel (`matmul_few.matmul_few`) pays a float conversion and scale FMAs for every 32
weights; here the sub-block scales multiply in integers and a 256-value super-block costs one
float FMA. The activations are those of every K-quant kernel: int8 per 256 values (llama.cpp's
Q8_K), so this kernel and the generic one (still used for 3-8 rows) compute the same sums.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import PAR
from localkv.backends.cpu.kernels.matmul_few import chunk, chunks, quantized
from localkv.backends.cpu.quant.formats import act_group, geometry
from localkv.backends.cpu.simd.u8x32 import at, half, prefetch
from localkv.backends.cpu.simd.wide import q4k_block, q6k_block, whsum, wzero

TYPES = ("Q4_K", "Q6_K")  # the types with a super-block kernel
ROWS = 2  # activation rows it takes at most; more go to the generic kernel's lanes
PREFETCH = 2048  # bytes ahead in the weights, on top of the hardware prefetcher


def layout(qt, xq):
    """(activations, their sums) in the order and grouping this type's block product reads."""


@overload(layout)
def _layout(qt, xq):
    if qt.qname == "Q4_K":
        return lambda qt, xq: _q4k_layout(xq)
    return lambda qt, xq: (xq, _sums(xq, 16))


@register_jitable
def _sums(xq, n):
    """The sums of each n activations of every row, as int16 (flat)."""
    R, K = xq.shape
    out = np.empty(R * K // n, np.int16)
    for r in range(R):
        for g in range(K // n):
            s = 0
            for i in range(n):
                s += xq[r, n * g + i]
            out[r * (K // n) + g] = s
    return out


@register_jitable
def _q4k_layout(xq):
    """Each 128 values as 0-31, 64-95, 32-63, 96-127: a 64-byte load of Q4_K nibbles holds
    two 32-byte chunks, low nibbles values 0-31 and 64-95 (of its 128), high ones the others."""
    R, K = xq.shape
    xp = np.empty((R, K), np.int8)
    for r in range(R):
        for b in range(K // 128):
            for i in range(32):
                o = 128 * b + i
                xp[r, o], xp[r, o + 32] = xq[r, o], xq[r, o + 64]
                xp[r, o + 64], xp[r, o + 96] = xq[r, o + 32], xq[r, o + 96]
    return xp, _sums(xq, 32)


def block(qt, acc, w, blk, xa, bs, sb, dx):
    """(acc + float products of the super-block at blk with activation super-block sb, its
    offset term), dx the activations' scale."""


@overload(block, inline="always")
def _block(qt, acc, w, blk, xa, bs, sb, dx):
    if qt.qname == "Q4_K":

        def q4k(qt, acc, w, blk, xa, bs, sb, dx):
            acc, m = q4k_block(acc, w, blk, xa, bs, sb, half(w, blk) * dx)
            return acc, np.float32(m) * (half(w, blk + 2) * dx)

        return q4k

    def q6k(qt, acc, w, blk, xa, bs, sb, dx):
        s = half(w, blk + 208) * dx
        acc, m = q6k_block(acc, w, blk, xa, bs, sb, s)
        return acc, np.float32(m) * (np.float32(32) * s)

    return q6k


@register_jitable(_nrt=False)
def _row(qt, w, base, xa, bs, dx, r, nb):
    """One weight row . activation row r (nb super-blocks)."""
    _, nbytes = geometry(qt)
    acc = wzero()
    m = np.float32(0)
    for b in range(nb):
        blk = base + b * nbytes
        for k in range(0, nbytes, 64):
            prefetch(w, blk + PREFETCH + k)
        acc, mb = block(qt, acc, w, blk, xa, bs, r * nb + b, at(dx, (r * nb + b) * 8))
        m += mb
    return whsum(acc) - m


@njit(**PAR)
def matmul_super(qt, x, ws, offs, out):
    """matmul_few.matmul_few for Q4_K / Q6_K and 1 <= R <= ROWS activation rows."""
    R, K = x.shape
    xq, dx, _ = quantized(x, act_group(qt))
    xa, bs = layout(qt, xq)
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w = ws[i]
        for n in range(n0, n1):
            for r in range(R):
                out[r, col + n] = _row(qt, w, n * w.shape[1], xa, bs, dx, r, K // 256)
