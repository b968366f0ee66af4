"""The numba kernels behind cpu_kernels (imported only when numba is there).

rowdot_1 / rowdot_4n (x [R, K], w [N, K], out [R, N]; R = 1, or a multiple of 4): out = x @ w.T,
parallel over the N weight rows. Each weight row is read once from memory and multiplied into
all R activation rows, one accumulator per row, 4 rows at a time: written out so the
accumulators stay in registers and the K loop vectorizes.
"""

import numpy as np
from numba import njit, prange

_OPTS = dict(parallel=True, fastmath=True, boundscheck=False, cache=True, nogil=True)


@njit(**_OPTS)
def rowdot_1(x, w, out):
    K = x.shape[1]
    for n in prange(w.shape[0]):
        s0 = np.float32(0)
        for k in range(K):
            s0 += x[0, k] * w[n, k]
        out[0, n] = s0


@njit(**_OPTS)
def rowdot_4n(x, w, out):
    # rows in passes of 4 over each weight row: the later passes read it from L1. One pass with
    # 8 accumulators was no faster
    K = x.shape[1]
    for n in prange(w.shape[0]):
        for r in range(0, x.shape[0], 4):
            s0 = np.float32(0)
            s1 = np.float32(0)
            s2 = np.float32(0)
            s3 = np.float32(0)
            for k in range(K):
                wv = w[n, k]
                s0 += x[r, k] * wv
                s1 += x[r + 1, k] * wv
                s2 += x[r + 2, k] * wv
                s3 += x[r + 3, k] * wv
            out[r, n] = s0
            out[r + 1, n] = s1
            out[r + 2, n] = s2
            out[r + 3, n] = s3


@njit(**_OPTS)
def scores_8(q, kf, out):
    """out[h, r, j] = q[h, r] . kf[j, h*hd : (h+1)*hd] for q [kvh, R, hd] (R a multiple of 8),
    kf [n, kvh*hd] (a contiguous run of pool blocks, tokens as rows), out [kvh, R, n]: the
    attention scores of R queries per kv head, parallel over the keys, each key row read once
    for 8 queries at a time."""
    kvh, R, hd = q.shape
    for j in prange(out.shape[2]):
        for h in range(kvh):
            o = h * hd
            for r in range(0, R, 8):
                s0 = np.float32(0)
                s1 = np.float32(0)
                s2 = np.float32(0)
                s3 = np.float32(0)
                s4 = np.float32(0)
                s5 = np.float32(0)
                s6 = np.float32(0)
                s7 = np.float32(0)
                for d in range(hd):
                    kv = kf[j, o + d]
                    s0 += q[h, r, d] * kv
                    s1 += q[h, r + 1, d] * kv
                    s2 += q[h, r + 2, d] * kv
                    s3 += q[h, r + 3, d] * kv
                    s4 += q[h, r + 4, d] * kv
                    s5 += q[h, r + 5, d] * kv
                    s6 += q[h, r + 6, d] * kv
                    s7 += q[h, r + 7, d] * kv
                out[h, r, j] = s0
                out[h, r + 1, j] = s1
                out[h, r + 2, j] = s2
                out[h, r + 3, j] = s3
                out[h, r + 4, j] = s4
                out[h, r + 5, j] = s5
                out[h, r + 6, j] = s6
                out[h, r + 7, j] = s7


# Single-threaded fused element-wise kernels: one pass where numpy makes several (and
# temporaries), for prefill's memory-bound steps. No parallel workers: no interplay with BLAS.
_SERIAL = dict(fastmath=True, boundscheck=False, cache=True, nogil=True)


@njit(**_SERIAL)
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


@njit(**_SERIAL)
def rope(x, cos, sin):
    """Rotate the halves of x [T, heads, hd] in place by cos/sin [T, hd/2] (NEOX order)."""
    T, n_heads, hd = x.shape
    half = hd // 2
    for t in range(T):
        for j in range(n_heads):
            for i in range(half):
                a = x[t, j, i]
                b = x[t, j, i + half]
                x[t, j, i] = a * cos[t, i] - b * sin[t, i]
                x[t, j, i + half] = b * cos[t, i] + a * sin[t, i]


@njit(**_SERIAL)
def causal_max(s, tq, first):
    """Scores s [kvh, g*tq, n] of a causal query block, rows ordered (group, query): query i sees
    keys 0 .. first+i. Subtracts each row's maximum over the keys it sees and sets the rest to
    -inf (exp gives 0), in one pass instead of numpy's mask add, max and subtract."""
    kvh, rows, n = s.shape
    ninf = np.float32(-np.inf)
    for h in range(kvh):
        for row in range(rows):
            end = min(n, first + row % tq + 1)
            m = ninf
            for j in range(end):
                m = max(m, s[h, row, j])
            for j in range(end):
                s[h, row, j] -= m
            for j in range(end, n):
                s[h, row, j] = ninf
