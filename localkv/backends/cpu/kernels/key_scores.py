"""Scores of a chunk of keys from a q8_0 / q4_0 pool, in integer form: the query rows quantized
per 32 values as the weights' activations are (matmul_few.group_scale, x16.quant16: d = amax /
127, q = rint(x / d)), each key block's dot with them summed exactly in int32, and a score is

    s = 0; for each block b of the head in order: s = fma(float(dot_b), dq_b * dk_b, s)

(simd/keys.key_block). The integers are exact, so every path that reads a quantized K (the
causal tiles, decode_rows, its few-row groups) gets the same bits whatever its lanes hold, and
a row's bits depend on its own query and keys only. llama.cpp's CPU flash attention multiplies
a quantized K the same way (the query converted to q8_0). A pool of f16 / f32 K keeps the float
products of kernels/attention.

The query rows sit in lane blocks of L (16 where the rows fill them, else 8): xi [lane block][
head block][8 dwords][L rows][4 bytes] (int8), dq and qs [lane block][head block][L] (the
lanes' scales, float32, and code sums, int32); st [KEYS, R] as attention._scores leaves it.
"""

import numpy as np
from numba import types
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels.matmul_few import group_scale
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fstore, fzero
from localkv.backends.cpu.simd.keys import SHIFT, key_block, key_words16, rows_dot16
from localkv.backends.cpu.simd.x16 import quant16, zero16
from localkv.kv_format import QK
from localkv.sequence import HOLE


@register_jitable(**NO_NRT)
def lanes_of(R):
    """The lane block width for R rows (a multiple of 8)."""
    return 16 if R % 16 == 0 else 8


@register_jitable(fastmath=False)
def query_lanes(gq, R, L, xi, dq, qs, row, q):
    """Rows 0 .. R - 1 of gq [hd, >= R] (the queries transposed, scaled) quantized into lane
    blocks of L (L = 1: each row's codes in a row, for keys in the lanes): each row's values
    copied out (row), then per 32 values group_scale's (d, 1 / d) and quant16's codes (q: 32
    bytes of scratch) and their sum. A block holding inf or nan gets codes 0 and d nan (its
    scores nan, as float products give); one of zeros d 0."""
    hd = gq.shape[0]
    nb = hd // QK
    bits, words, qw = row.view(np.uint32), xi.view(np.uint32), q.view(np.uint32)
    for r in range(R):
        lb, lane = r // L, r % L
        for d in range(hd):
            row[d] = gq[d, r]
        for b in range(nb):
            d, inv = group_scale(bits, QK * b, QK)
            total = 0
            if inv > 0:
                total = quant16(row, QK * b, inv, q, 0) + quant16(row, QK * b + 16, inv, q, 16)
            else:
                q[:] = 0
            at = (lb * nb + b) * L + lane
            dq[at], qs[at] = d, total
            for k in range(8):
                words[((lb * nb + b) * 8 + k) * L + lane] = qw[k]


@register_jitable(**NO_NRT)
def _key(arr, at, nb, nbytes, xi, dq, qs, R, st, so, L, z):
    """st[so + r] for r < R = the scores of the key row at byte `at` of arr (a pool's or an
    offload tier's) against the R query rows, lane block by lane block."""
    for lb in range(R // L):
        s = z
        for b in range(nb):
            s = key_block(arr, at + b * nbytes, xi, (lb * nb + b) * 8 * 4 * L, dq, qs, (lb * nb + b) * L, s)
        fstore(st, so + lb * L, s)


@register_jitable(**NO_NRT)
def scores_at(pool, offs, n, xi, dq, qs, st, R, hd):
    """st [KEYS, R] (flat): the scores of the pool rows offs[:n] (flat row indices over a
    layer's blocks, positions and kv heads) for the R query rows (query_lanes); rows past n
    left as they are (the softmax step reads n keys)."""
    row = pool.shape[-1]
    nb = hd // QK
    if lanes_of(R) == 16:
        for t in range(n):
            _key(pool, offs[t] * row, nb, row // nb, xi, dq, qs, R, st, t * R, 16, zero16())
    else:
        for t in range(n):
            _key(pool, offs[t] * row, nb, row // nb, xi, dq, qs, R, st, t * R, 8, fzero())


@register_jitable(**NO_NRT)
def scores_sourced(pool, extra, tables, h, t0, n, xi, dq, qs, st, R, hd, seen):
    """scores_at for the keys at positions t0 .. t0 + n - 1 through a per-kv-head table, as
    attention._sourced_rows reads them (a pool block, a block recalled into extra, or a hole:
    score 0, seen[t] False; False too past n)."""
    if lanes_of(R) == 16:
        _sourced(pool, extra, tables, h, t0, n, xi, dq, qs, st, R, hd, seen, 16, zero16())
    else:
        _sourced(pool, extra, tables, h, t0, n, xi, dq, qs, st, R, hd, seen, 8, fzero())


@register_jitable(**NO_NRT)
def _sourced(pool, extra, tables, h, t0, n, xi, dq, qs, st, R, hd, seen, L, z):
    bs, kvh, row = pool.shape[1], pool.shape[2], pool.shape[3]
    nb = hd // QK
    nbytes = row // nb
    t = 0
    while t < n:
        e, o0 = tables[h, (t0 + t) // bs], (t0 + t) % bs
        run = min(bs - o0, n - t)
        for i in range(run):
            if e >= 0:
                at = ((e * bs + o0 + i) * kvh + h) * row
                _key(pool, at, nb, nbytes, xi, dq, qs, R, st, (t + i) * R, L, z)
            elif e < HOLE:
                at = ((h * extra.shape[1] + (-2 - e)) * bs + o0 + i) * row
                _key(extra, at, nb, nbytes, xi, dq, qs, R, st, (t + i) * R, L, z)
            else:
                for lb in range(R // L):
                    fstore(st, (t + i) * R + lb * L, z)
            seen[t + i] = e != HOLE
        t += run
    for i in range(n, len(seen)):
        seen[i] = False


def code_shift(pool) -> int:
    """What the dot's unsigned operand adds to a code of this quantized pool (keys.SHIFT)."""


@overload(code_shift)
def _code_shift_impl(pool):
    value = SHIFT["q4_0" if pool.dtype == types.uint8 else "q8_0"]
    return lambda pool: value


ROWS = 4  # query rows of scores_keys: decode_rows' groups of up to ROWS rows (decode_few's too)


@register_jitable(**NO_NRT)
def scores_keys(pool, offs, n, xq, dq, qs, st, hd):
    """st [ROWS, KEYS] (flat, KEYS = len(offs)): the scores of the pool rows offs[:n] for ROWS
    query rows (query_lanes with L = 1), 16 keys in the lanes: each key block's codes loaded and
    transposed once for the rows (key_words16). offs past n are set to a key before them, whose
    scores there the softmax step leaves unread."""
    keys, row, nb = len(offs), pool.shape[-1], hd // QK
    nbytes, shift = row // nb, code_shift(pool)
    for t in range(n, keys):
        offs[t] = offs[n - 1]
    for t in range(0, n, 16):
        s0 = s1 = s2 = s3 = zero16()
        for b in range(nb):
            words, dk = key_words16(pool, offs, t, row, b * nbytes)
            s0 = rows_dot16(words, xq, b * QK, shift * qs[b], dq[b], dk, s0)
            s1 = rows_dot16(words, xq, (nb + b) * QK, shift * qs[nb + b], dq[nb + b], dk, s1)
            s2 = rows_dot16(words, xq, (2 * nb + b) * QK, shift * qs[2 * nb + b], dq[2 * nb + b], dk, s2)
            s3 = rows_dot16(words, xq, (3 * nb + b) * QK, shift * qs[3 * nb + b], dq[3 * nb + b], dk, s3)
        fstore(st, t, s0)
        fstore(st, keys + t, s1)
        fstore(st, 2 * keys + t, s2)
        fstore(st, 3 * keys + t, s3)
