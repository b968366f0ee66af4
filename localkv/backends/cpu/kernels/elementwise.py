"""Single-threaded fused element-wise kernels: one pass where numpy makes several (and
temporaries), for prefill's memory-bound steps (RMSNorm, RoPE, SwiGLU). No parallel workers."""

import numpy as np
from numba import njit
from numba.extending import register_jitable

from localkv.backends.cpu.kernels import SER, self_check
from localkv.backends.cpu.kernels.attention import exp


@njit(**SER)
def rmsnorm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, row by row."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        r = np.float32(1.0 / np.sqrt(ss / D + eps))
        for d in range(D):
            out[t, d] = x[t, d] * r * w[d]


@njit(**SER, error_model="numpy")  # a float division that raises on zero does not vectorise
def silu_mul(gu, f, out, by_rows):
    """out = silu(gate) * up, one pass where numpy makes five. gu (C-contiguous) holds gate then
    up: along its rows when by_rows (a prefill pass's transposed [2f, T] matmul output; out
    [f, T]), else along each row ([T, 2f]; out [T, f]). sigmoid from exp(-|gate|): the
    vectorising exp takes x <= 0."""
    dr, dc = (f, 0) if by_rows else (0, f)  # up's offset from gate: the C-contiguous array is
    R, C = out.shape  # indexed as it is, so the inner loop runs on vectors
    one = np.float32(1)
    for r in range(R):
        for c in range(C):
            a = gu[r, c]
            e = exp(-abs(a))
            s = one / (one + e)
            out[r, c] = a * (s if a >= 0 else e * s) * gu[r + dr, c + dc]


@register_jitable
def _rotate(x, t, j, i0, i1, c, s):
    a, b = x[t, j, i0], x[t, j, i1]
    x[t, j, i0] = a * c - b * s
    x[t, j, i1] = b * c + a * s


@register_jitable
def _rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the halves (i, i + hd/2) (NEOX)
    or the adjacent pairs (2i, 2i+1) (llama.cpp's "normal" order). x may be a view of a
    prefill pass's transposed matmul output, tokens adjacent in memory: the loops then run
    along the tokens (along the head dimension, every element was a cache line of its own)."""
    T, n_heads, hd = x.shape
    half = hd // 2
    if x.strides[0] < x.strides[2]:
        for j in range(n_heads):
            for i in range(half):
                i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                for t in range(T):
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])
    else:
        for t in range(T):
            for j in range(n_heads):
                for i in range(half):
                    i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])


@njit(**SER)
def rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the adjacent pairs (2i, 2i+1)
    (llama.cpp's "normal" order) when pairs, else the halves (NEOX order). One kernel for both
    orders: each compiled kernel costs a start its own cache load."""
    _rope(x, cos, sin, pairs)


@self_check("base", cost=1.1)
def check() -> bool:
    """The kernels for the array kinds the model passes (a read-only norm weight, a strided qkv
    view, both layouts of SwiGLU's input) against numpy."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    w.flags.writeable = False
    out = np.empty_like(x)
    rmsnorm(x, w, 1e-5, out)
    ok = np.allclose(out, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * w, rtol=1e-4, atol=1e-5)
    qkv = rng.standard_normal((2, 3, 4), dtype=np.float32)
    cos, sin = np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)
    want = qkv.copy()
    for x in (qkv[:, :2], qkv[:1, :2]):  # many rows: a strided view; one (a decode step): contiguous
        for pairs in (False, True):
            rope(x, cos[: len(x)], sin[: len(x)], pairs)  # angle 0: unchanged
    gu = rng.standard_normal((3, 16), dtype=np.float32) * 20  # past exp's range both ways
    g, u = gu[:, :8].astype(np.float64), gu[:, 8:]
    act = g / (1 + np.exp(-g)) * u
    for by_rows in (False, True):  # a decode step's [T, 2f] and a prefill pass's transposed [2f, T]
        got = np.empty((8, 3) if by_rows else (3, 8), np.float32)
        silu_mul(np.ascontiguousarray(gu.T) if by_rows else gu, 8, got, by_rows)
        ok = ok and np.allclose(got.T if by_rows else got, act, rtol=1e-5, atol=1e-6)
    return ok and np.array_equal(qkv, want)
