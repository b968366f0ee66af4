"""Attention of one query token per sequence over the paged pool: decode steps (each sequence
over its own block table) and the forks' own tails after their shared prefix. Each dot product
runs on vectors of 8 along the head dimension (a multiple of 8), one horizontal sum at its end.
"""

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from localkv.backends.cpu.kernels import PAR, SER, self_check
from localkv.backends.cpu.kernels.attention import exp, vload
from localkv.backends.cpu.simd.f32x8 import fadd, fload, fma, fsplat, fsplat_at, fstore, hsum


@register_jitable
def _attend(q, k, v, h, table, n, scale, s, out, mx, sm):
    """Unnormalised attention of q [g, hd] (kv head h's group of query heads, times scale; hd
    a multiple of 8) over the first n >= 1 tokens of one block table, K/V read from the pool
    layers k/v [blocks, block_size, kv_heads, hd] (C-contiguous; float32, or uint16 holding
    half floats): out [g, hd], row max mx and row sum sm [g]; s [g, >= n] is scratch. Each
    dot product runs on vectors of 8 along hd, one horizontal sum at its end; the weighted
    sum keeps 8 of hd in a register over all the keys."""
    bs, kvh = k.shape[1], k.shape[2]
    g, hd = q.shape
    rows = np.empty(n + 3, np.int64)  # flat offset of each token's row: one division per token
    for t in range(n):
        rows[t] = ((table[t // bs] * bs + t % bs) * kvh + h) * hd
    rows[n : n + 3] = rows[0]  # the last group of 4 keys reads valid rows past n (not kept)
    for t in range(0, n, 4):  # 4 keys at a time: 4 independent FMA chains, not one
        for j in range(g):
            qj = q[j]
            a0 = a1 = a2 = a3 = fsplat(np.float32(0))
            for c in range(0, hd, 8):
                x = fload(qj, c)
                a0 = fma(x, vload(k, rows[t] + c), a0)
                a1 = fma(x, vload(k, rows[t + 1] + c), a1)
                a2 = fma(x, vload(k, rows[t + 2] + c), a2)
                a3 = fma(x, vload(k, rows[t + 3] + c), a3)
            s[j, t] = hsum(a0) * scale
            if t + 1 < n:
                s[j, t + 1] = hsum(a1) * scale
            if t + 2 < n:
                s[j, t + 2] = hsum(a2) * scale
            if t + 3 < n:
                s[j, t + 3] = hsum(a3) * scale
    for j in range(g):
        m = s[j, 0]
        for t in range(1, n):
            m = max(m, s[j, t])
        total = np.float32(0)
        for t in range(n):
            e = exp(s[j, t] - m)
            s[j, t] = e
            total += e
        mx[j], sm[j] = m, total
        sj, oj = s[j], out[j]
        for c in range(0, hd, 8):
            a0 = a1 = a2 = a3 = fsplat(np.float32(0))
            for t in range(0, n - 3, 4):
                a0 = fma(fsplat_at(sj, t), vload(v, rows[t] + c), a0)
                a1 = fma(fsplat_at(sj, t + 1), vload(v, rows[t + 1] + c), a1)
                a2 = fma(fsplat_at(sj, t + 2), vload(v, rows[t + 2] + c), a2)
                a3 = fma(fsplat_at(sj, t + 3), vload(v, rows[t + 3] + c), a3)
            for t in range(n - n % 4, n):
                a0 = fma(fsplat_at(sj, t), vload(v, rows[t] + c), a0)
            fstore(oj, c, fadd(fadd(a0, a1), fadd(a2, a3)))


@njit(**PAR)
def paged_tails(q, k, v, tables, lens, out, mx, sm):
    """Unnormalised attention of each sequence's own few tokens (after a prefix shared with the
    others): q [kvh, B, g, hd] (scaled) of sequence b over the first lens[b] (>= 1) tokens of
    its table tables[b], pool layers k/v as _attend's; out [kvh, B, g, hd], row max mx and row
    sum sm [kvh, B, g, 1]. Parallel over (sequence, kv head); the tails are short."""
    kvh, B, g, hd = q.shape
    for job in prange(B * kvh):
        b, h = job // kvh, job % kvh
        s = np.empty((g, lens[b]), np.float32)
        _attend(q[h, b], k, v, h, tables[b], lens[b], np.float32(1), s, out[h, b], mx[h, b, :, 0], sm[h, b, :, 0])


def _decode_attention(q, k, v, tables, lens, scale, out, scores):
    """Attention of one query token per sequence: q [B, H, hd] over the first lens[b] tokens
    of sequence b's K/V, read through its block table tables[b] from the pool layers k, v
    (as _attend's); out [B, H, hd]. scores [B * kv_heads, H / kv_heads, >= max(lens)] is
    scratch. Over (sequence, kv head), in parallel or not (two builds below)."""
    B, H, hd = q.shape
    kvh = k.shape[2]
    g = H // kvh
    for job in prange(B * kvh):
        b, h = job // kvh, job % kvh
        mx, sm = np.empty(g, np.float32), np.empty(g, np.float32)
        rows = out[b, h * g : (h + 1) * g]
        _attend(q[b, h * g : (h + 1) * g], k, v, h, tables[b], lens[b], scale, scores[job], rows, mx, sm)
        for j in range(g):
            inv = np.float32(1) / sm[j]
            for d in range(hd):
                rows[j, d] *= inv


# A parallel region costs more than a short context's attention: both builds, chosen by size.
decode_attention = njit(**PAR)(_decode_attention)
decode_attention_serial = njit(**SER)(_decode_attention)


@self_check("base", cost=6.5, fast=True)
def check() -> bool:
    """The tails kernel and both builds of decode attention for an f16 pool (the CPU's default;
    an f32 pool's builds load on first use), with the array kinds the model passes, against
    numpy."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 8), dtype=np.float32)
    kv = rng.standard_normal((2, 3, 2, 2, 8), dtype=np.float32)  # K/V, 3 blocks of 2 tokens, 2 kv heads
    tables, lens = np.array([[2, 0], [1, 2]], np.int32), np.array([3, 4], np.int32)
    want = np.empty(q.shape, np.float32)
    for b in range(2):
        k, v = (a[tables[b]].reshape(4, 2, 8)[: lens[b]] for a in kv)
        s = np.einsum("hgd,nhd->hgn", q[b].reshape(2, 2, 8), k) * 0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        want[b] = np.einsum("hgn,nhd->hgd", p / p.sum(-1, keepdims=True), v).reshape(4, 8)
    pool = kv.astype(np.float16).view(np.uint16)
    ok = True
    for kernel in (decode_attention, decode_attention_serial):
        out = np.empty(q.shape, np.float32)
        kernel(q, pool[0], pool[1], tables, lens, np.float32(0.5), out, np.empty((4, 2, 4), np.float32))
        ok = ok and np.allclose(out, want, rtol=1e-2, atol=1e-2)
    ones = np.ones((1, 4, 2, 8), np.float16).view(np.uint16)  # equal keys: each output is the values' sum
    table, n = np.zeros((2, 1), np.int64), np.full(2, 2, np.int64)
    table.flags.writeable = n.flags.writeable = False
    out, mx, sm = (np.empty((2, 1, 3, w), np.float32) for w in (8, 1, 1))
    paged_tails(np.ones((2, 1, 3, 8), np.float32), ones, ones, table, n, out, mx, sm)
    return ok and bool((mx == 8.0).all() and (sm == 2.0).all() and (out == 2.0).all())
