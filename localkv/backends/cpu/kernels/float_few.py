"""The matmul for weights stored as floats (F32, F16, BF16: Hugging Face checkpoints and the
small tensors of GGUF files), any number of rows: float FMAs, the activations kept as float32,
one dot per row (a row's bits whatever rows share the call).

F16 and BF16 are passed as uint16 arrays and widened 8 values at a time as they are read;
each weight row is read from memory once per call and from L1 for the further activation
rows.
"""

from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import PAR
from localkv.backends.cpu.kernels.matmul_few import chunk, chunks
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import bload, fadd, fload, fma, fzero, hload, hsum


def load8(qt, w, off):
    """8 weights from flat element off of w as an F32x8."""


@overload(load8, jit_options=NO_NRT)
def _load8(qt, w, off):
    return {"F32": lambda qt, w, off: fload(w, off), "F16": lambda qt, w, off: hload(w, off),
            "BF16": lambda qt, w, off: bload(w, off)}[qt.qname]  # fmt: skip


@register_jitable(**NO_NRT)
def _float_dot(qt, w, base, x, xo, K):
    """Weight row (from element base) . activations x (from element xo), K a multiple of 8."""
    a0, a1, a2, a3 = fzero(), fzero(), fzero(), fzero()
    k = 0
    while k + 32 <= K:
        a0 = fma(load8(qt, w, base + k), fload(x, xo + k), a0)
        a1 = fma(load8(qt, w, base + k + 8), fload(x, xo + k + 8), a1)
        a2 = fma(load8(qt, w, base + k + 16), fload(x, xo + k + 16), a2)
        a3 = fma(load8(qt, w, base + k + 24), fload(x, xo + k + 24), a3)
        k += 32
    while k < K:
        a0 = fma(load8(qt, w, base + k), fload(x, xo + k), a0)
        k += 8
    return hsum(fadd(fadd(a0, a1), fadd(a2, a3)))


@njit(**PAR)
def matmul_few_float(qt, x, ws, offs, out):
    """out[:, offs[i] + n] = x @ row n of ws[i] for the three matrices ws (as
    matmul_few.matmul_lanes), for F32 / F16 / BF16 weights (x float32 C-contiguous, K % 8 == 0)."""
    R, K = x.shape
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w = ws[i]
        for n in range(n0, n1):
            for r in range(R):
                out[r, col + n] = _float_dot(qt, w, n * K, x, r * K, K)
