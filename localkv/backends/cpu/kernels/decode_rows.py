"""Decode attention of many sequences (one query token each) in one call, with the causal
kernel's bits for every row (the one-answer rule: a token's attention does not depend on the
other rows of its pass, nor on whether the pass was a decode step or a prompt chunk).

Each row walks its keys as paged_causal does: chunks of KEYS at the positions 0, KEYS, ...,
scores on 8 x 8 register tiles (rows in the lanes), the online-softmax step and the FMA
accumulation in the same order. What differs is which rows share a tile: at each chunk the
sequences whose block tables hold the same blocks there (the forks of one prompt, requests on
one system prompt) are scored together, so a shared chunk is read and converted once for all
of them and fills the lanes; the others take a tile each. A row's arithmetic is the same in
either case, so the sharing changes no bit.
"""

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from localkv.backends.cpu.kernels import EXACT_PAR, self_check
from localkv.backends.cpu.kernels.attention import KEYS, _accumulate, _rows, _scores, _softmax_step, rload
from localkv.backends.cpu.simd.f32x8 import fadd, fload, fma, fsplat_at, fstore, fzero


@register_jitable
def _same_keys(tables, lens, a, b, t0, bs):
    """Sequences a and b see the same keys in the chunk at t0: as many, in the same blocks (so
    the rows of a group need no mask of their own)."""
    end = min(t0 + KEYS, max(lens[a], lens[b]))
    if min(lens[a], lens[b]) < end:
        return False
    for j in range(t0 // bs, (end - 1) // bs + 1):  # noqa: SIM110 (a generator does not compile)
        if tables[a, j] != tables[b, j]:
            return False
    return True


@register_jitable
def _group(tables, lens, s0, s1, t0, bs, taken, members):
    """The sequences of s0..s1-1 that reach the chunk at t0 and share its keys with the first
    of them not yet taken (members[:count], marked taken); 0 when none is left."""
    count = 0
    for s in range(s0, s1):
        if not taken[s - s0] and lens[s] > t0 and (count == 0 or _same_keys(tables, lens, members[0], s, t0, bs)):
            members[count] = s
            taken[s - s0] = True
            count += 1
    return count


@njit(**EXACT_PAR)
def paged_decode(qt, k, v, tables, lens, parts, out):
    """Attention of B sequences' last tokens: qt [kvh, hd, B * g] their query rows (ordered
    (sequence, head), transposed, scaled), sequence b at position lens[b] - 1 over the first
    lens[b] tokens of its block table tables[b] (int64 [B, blocks]); out [kvh, B * g, hd]
    normalised. Parallel over (kv head, part of the sequences): `parts` runs of them per head."""
    kvh, hd, rows = qt.shape
    B, bs = len(lens), k.shape[1]
    g = rows // B
    for job in prange(kvh * parts):
        h, p = job // parts, job % parts
        s0, s1 = p * B // parts, (p + 1) * B // parts
        R = (s1 - s0) * g  # the job's rows
        R8 = -(-R // 8) * 8
        kc, vc = np.empty((KEYS, hd), np.float32), np.empty((KEYS, hd), np.float32)
        # a group's tiles, as contiguous arrays of its own width (views of these buffers)
        st_buf, gq_buf, go_buf = (
            np.empty(KEYS * R8, np.float32),
            np.empty(hd * R8, np.float32),
            np.empty(R8 * hd, np.float32),
        )
        top, gm, gs = np.empty(R8, np.float32), np.empty(R8, np.float32), np.empty(R8, np.float32)
        o, m, sums = np.zeros((R, hd), np.float32), np.full(R, -np.inf, np.float32), np.zeros(R, np.float32)
        taken, members = np.zeros(s1 - s0, np.bool_), np.empty(s1 - s0, np.int64)
        offs = np.empty(KEYS, np.int64)
        most = 0
        for s in range(s0, s1):
            most = max(most, lens[s])
        for t0 in range(0, most, KEYS):
            taken[:] = False
            while True:
                count = _group(tables, lens, s0, s1, t0, bs, taken, members)
                if count == 0:
                    break
                n = 0
                for i in range(count):
                    n = max(n, min(lens[members[i]] - t0, KEYS))
                _rows(k, tables[members[0]], h, t0, n, kc, hd)
                r8 = -(-count * g // 8) * 8
                st, gq = st_buf[: KEYS * r8].reshape((KEYS, r8)), gq_buf[: hd * r8].reshape((hd, r8))
                go = go_buf[: r8 * hd].reshape((r8, hd))
                _gather(qt, o, m, sums, members, count, g, h, s0, gq, go, gm, gs)
                _scores(gq, kc, st, r8, hd)
                _softmax_step(st, n, go, gm[:r8], gs[:r8], top[:r8])
                if 2 * count * g <= r8:  # lanes mostly padding: the weighted values along hd instead
                    _accumulate_rows(st, v, tables[members[0]], h, t0, n, go, count * g, offs)
                else:
                    _rows(v, tables[members[0]], h, t0, n, vc, hd)
                    _accumulate(st, vc, go, r8, hd)
                for i in range(count):
                    for j in range(g):
                        r, at = i * g + j, (members[i] - s0) * g + j
                        for d in range(hd):
                            o[at, d] = go[r, d]
                        m[at], sums[at] = gm[r], gs[r]
        for r in range(R):
            inv = np.float32(1) / sums[r]
            for d in range(hd):
                out[h, s0 * g + r, d] = o[r, d] * inv


@register_jitable
def _accumulate_rows(st, v, table, h, t0, n, o, rows, offs):
    """_accumulate's sums for the first `rows` rows of o [r8, hd], with 8 of hd in the lanes
    and V read from the pool as stored: each value still gains its n weighted values in key
    order, so its bits are _accumulate's (which adds the chunk's padding keys as + 0: so does
    the last line here, which only makes a -0 +0)."""
    bs, kvh, hd = v.shape[1], v.shape[2], o.shape[1]
    for t in range(n):
        offs[t] = (table[(t0 + t) // bs] * bs + (t0 + t) % bs) * kvh + h  # the pool rows
    zero = fzero()
    for r in range(rows):
        d0 = 0
        for d0 in range(0, hd - 63, 64):  # 8 accumulators: FMA latency hidden
            at = r * hd + d0
            a0, a1, a2, a3 = fload(o, at), fload(o, at + 8), fload(o, at + 16), fload(o, at + 24)
            a4, a5, a6, a7 = fload(o, at + 32), fload(o, at + 40), fload(o, at + 48), fload(o, at + 56)
            for t in range(n):
                w, b = fsplat_at(st, t * st.shape[1] + r), offs[t]
                a0, a1 = fma(w, rload(v, b, d0), a0), fma(w, rload(v, b, d0 + 8), a1)
                a2, a3 = fma(w, rload(v, b, d0 + 16), a2), fma(w, rload(v, b, d0 + 24), a3)
                a4, a5 = fma(w, rload(v, b, d0 + 32), a4), fma(w, rload(v, b, d0 + 40), a5)
                a6, a7 = fma(w, rload(v, b, d0 + 48), a6), fma(w, rload(v, b, d0 + 56), a7)
            pad = n < KEYS
            fstore(o, at, fadd(a0, zero) if pad else a0)
            fstore(o, at + 8, fadd(a1, zero) if pad else a1)
            fstore(o, at + 16, fadd(a2, zero) if pad else a2)
            fstore(o, at + 24, fadd(a3, zero) if pad else a3)
            fstore(o, at + 32, fadd(a4, zero) if pad else a4)
            fstore(o, at + 40, fadd(a5, zero) if pad else a5)
            fstore(o, at + 48, fadd(a6, zero) if pad else a6)
            fstore(o, at + 56, fadd(a7, zero) if pad else a7)
        for d in range(hd // 64 * 64, hd, 8):  # a head size that is not a multiple of 64
            a = fload(o, r * hd + d)
            for t in range(n):
                a = fma(fsplat_at(st, t * st.shape[1] + r), rload(v, offs[t], d), a)
            fstore(o, r * hd + d, fadd(a, zero) if n < KEYS else a)


@register_jitable
def _gather(qt, o, m, sums, members, count, g, h, s0, gq, go, gm, gs):
    """A group's query rows and running state into lanes 0 .. count * g - 1 of gq [hd, r8] and
    go, gm, gs; the lanes after them zero queries with an empty state."""
    hd, r8 = gq.shape
    for i in range(count):
        for j in range(g):
            r, at = i * g + j, (members[i] - s0) * g + j
            for d in range(hd):
                gq[d, r], go[r, d] = qt[h, d, members[i] * g + j], o[at, d]
            gm[r], gs[r] = m[at], sums[at]
    for r in range(count * g, r8):
        for d in range(hd):
            gq[d, r], go[r, d] = 0, 0
        gm[r], gs[r] = -np.inf, 0


@self_check("base", cost=7.2)
def check() -> bool:
    """Two sequences on one block and one on another, f16 pool, read-only int64 tables: equal
    keys weigh every value alike, so each row's output is the value."""
    k = np.ones((2, 4, 2, 8), np.float16).view(np.uint16)  # [blocks, block size, kv heads, head dim]
    tables = np.array([[0], [0], [1]], np.int64)
    lens = np.array([3, 2, 4], np.int64)
    tables.flags.writeable = lens.flags.writeable = False
    out = np.empty((2, 3, 8), np.float32)
    paged_decode(np.ones((2, 8, 3), np.float32), k, k, tables, lens, 2, out)
    return bool((out == 1.0).all())
