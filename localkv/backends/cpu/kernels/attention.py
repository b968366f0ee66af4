"""Attention over the paged pool on float32 vectors: a prefill pass's causal attention (tiles
of query tokens; in the key chunks that cross a tile's positions, the keys past a row's own are
masked), and the pieces decode_rows shares with it.

The keys are taken KEYS at a time (a chunk). A chunk's V rows, and a float K's, are converted
once (pool_rows: f16 by F16C; q8_0 / q4_0 codes times their block's scale, exact) into float32
rows for every query row that reads them; a q8_0 / q4_0 K is scored in its integer form
(key_scores) instead. The products are register tiles of 8 x 8:
the scores of 8 query rows (one vector, queries transposed) for 8 keys, and the weighted values
of 8 query rows for 8 of the head dimension, each a vector load, 8 broadcasts and 8 FMAs a step
with the accumulators in registers. A row of scores per query, as
the earlier kernels kept, is stored and reloaded at every step and a horizontal sum ends every
dot product: several times slower. The softmax runs online (flash attention): each job keeps
its chunks' running row maximum, rescaling what it summed only when the maximum grows. In the
causal kernel (and decode_rows, which gives its bits) a row's keys form spans of SPAN
positions, each with its own softmax, folded in position order (`_fold`): the split-K of
flash-decoding, defined by positions only, so a decode step can run its spans on all the threads
while a prefill tile walks them in turn. The exponential is a polynomial (`exp`, and f32x8.fexp
with its bits on 8 rows at once), where numba's np.exp is a scalar call.

Head dimensions must be a multiple of 8 (every model the loader takes has one).
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import EXACT_PAR, self_check, uniform_pool
from localkv.backends.cpu.kernels.key_scores import lanes_of, query_lanes, scores_sourced
from localkv.backends.cpu.kernels.pool_rows import quant_bytes, row_into
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import (
    EXP_FLOOR,
    EXP_POLY,
    LN2_HI,
    LN2_LO,
    LOG2E,
    fadd,
    fload,
    float_of_bits,
    fma,
    fmax,
    fstore,
    fweights,
    fzero,
    wload,
    wsplat_at,
)
from localkv.backends.cpu.simd.x16 import zero16
from localkv.kv_format import QK
from localkv.sequence import HOLE

KEYS = 64  # keys per chunk
# keys per span (a multiple of KEYS): a row sums each span of its keys on its own, from the
# positions 0, SPAN, 2 * SPAN..., and folds the spans' partial softmaxes in position order
# (_fold), so a long decode splits its keys over the threads without its bits depending on them
SPAN = 512


@register_jitable(**NO_NRT)
def exp(x):
    """exp(x) of a float32 x <= 0 (a score less its row maximum): f32x8's recipe (EXP_POLY) on
    one lane, fexp's bits."""
    x = max(x, np.float32(EXP_FLOOR))
    k = np.floor(x * np.float32(LOG2E) + np.float32(0.5))
    r = x - k * np.float32(LN2_HI) - k * np.float32(LN2_LO)
    p = np.float32(EXP_POLY[0])
    for i in range(1, len(EXP_POLY)):
        p = p * r + np.float32(EXP_POLY[i])
    return p * float_of_bits((np.int32(k) + np.int32(127)) << np.int32(23))


@register_jitable(**NO_NRT)
def _rows(pool, table, h, t0, n, dst, hd):
    """dst [KEYS, hd] = kv head h's rows of tokens t0 .. t0 + n - 1 (n <= KEYS) read through
    the block table from a pool layer [blocks, block_size, kv_heads, row], as float32; zeros
    after them."""
    bs, kvh = pool.shape[1], pool.shape[2]
    for t in range(KEYS):
        if t < n:
            row_into(dst, t * hd, pool, (table[(t0 + t) // bs] * bs + (t0 + t) % bs) * kvh + h, hd)
        else:
            for d in range(hd):
                dst[t, d] = 0


@register_jitable(**NO_NRT)
def _tile(a, a0, a_step, b, b0, b_step, b_lane, n, c, c0, c_lane, add, z):
    """The register tile of both products: for i < 8, c[c0 + i * c_lane :][:W] = (itself, if
    add, else 0) + the sum over k < n of the vector a[a0 + k * a_step :][:W] times the scalar
    b[b0 + k * b_step + i * b_lane]: one vector load, 8 broadcasts and 8 FMAs a step, the 8
    accumulators in registers. W is z's width: 8, or 16 (one AVX-512 FMA for two),
    each lane the same FMAs in the same order either way, so the same bits."""
    if add:
        a_0, a_1 = wload(c, c0, z), wload(c, c0 + c_lane, z)
        a_2, a_3 = wload(c, c0 + 2 * c_lane, z), wload(c, c0 + 3 * c_lane, z)
        a_4, a_5 = wload(c, c0 + 4 * c_lane, z), wload(c, c0 + 5 * c_lane, z)
        a_6, a_7 = wload(c, c0 + 6 * c_lane, z), wload(c, c0 + 7 * c_lane, z)
    else:
        a_0 = a_1 = a_2 = a_3 = a_4 = a_5 = a_6 = a_7 = z
    for k in range(n):
        x, base = wload(a, a0 + k * a_step, z), b0 + k * b_step
        a_0 = fma(x, wsplat_at(b, base, z), a_0)
        a_1 = fma(x, wsplat_at(b, base + b_lane, z), a_1)
        a_2 = fma(x, wsplat_at(b, base + 2 * b_lane, z), a_2)
        a_3 = fma(x, wsplat_at(b, base + 3 * b_lane, z), a_3)
        a_4 = fma(x, wsplat_at(b, base + 4 * b_lane, z), a_4)
        a_5 = fma(x, wsplat_at(b, base + 5 * b_lane, z), a_5)
        a_6 = fma(x, wsplat_at(b, base + 6 * b_lane, z), a_6)
        a_7 = fma(x, wsplat_at(b, base + 7 * b_lane, z), a_7)
    fstore(c, c0, a_0)
    fstore(c, c0 + c_lane, a_1)
    fstore(c, c0 + 2 * c_lane, a_2)
    fstore(c, c0 + 3 * c_lane, a_3)
    fstore(c, c0 + 4 * c_lane, a_4)
    fstore(c, c0 + 5 * c_lane, a_5)
    fstore(c, c0 + 6 * c_lane, a_6)
    fstore(c, c0 + 7 * c_lane, a_7)


@register_jitable(**NO_NRT)
def _scores(qt, kc, st, R8, hd):
    """st [KEYS, R8] = kc @ qt for qt [hd, R8] (the queries transposed): tiles of 16 queries (a
    vector; 8 for the last when R8 is not a multiple of 16) x 8 keys (broadcast), summed over hd."""
    wide = R8 - R8 % 16
    for rb in range(0, wide, 16):
        for tb in range(0, KEYS, 8):
            _tile(qt, rb, R8, kc, tb * hd, 1, hd, hd, st, tb * R8 + rb, R8, False, zero16())
    for rb in range(wide, R8, 8):
        for tb in range(0, KEYS, 8):
            _tile(qt, rb, R8, kc, tb * hd, 1, hd, hd, st, tb * R8 + rb, R8, False, fzero())


@register_jitable(**NO_NRT)
def _accumulate(st, vc, o, R8, hd):
    """o [R8, hd] += st.T @ vc for st [KEYS, R8], vc [KEYS, hd]: tiles of 16 of hd (a vector;
    8 for the rest) x 8 queries (broadcast weights), summed over the keys."""
    wide = hd - hd % 16
    for rb in range(0, R8, 8):
        for db in range(0, wide, 16):
            _tile(vc, db, hd, st, rb, R8, 1, KEYS, o, rb * hd + db, hd, True, zero16())
        for db in range(wide, hd, 8):
            _tile(vc, db, hd, st, rb, R8, 1, KEYS, o, rb * hd + db, hd, True, fzero())


@register_jitable(**NO_NRT)
def _softmax_step(st, n, o, m, total, top):
    """Scores st [KEYS, R8] of a chunk's first n keys into weights in place (zeros after them),
    against the running row maxima m [R8], which grow to this chunk's where it is higher: the
    running output o [R8, hd] and row sums total [R8] are rescaled then, and total gains the
    new weights, in key order. 8 rows (lanes) at a time; top [R8] is scratch."""
    R8 = st.shape[1]
    for rb in range(0, R8, 8):
        t8 = fload(st, rb)
        for t in range(1, n):
            t8 = fmax(t8, fload(st, t * R8 + rb))
        fstore(top, rb, t8)
    for r in range(R8):
        if top[r] > m[r]:
            a = exp(m[r] - top[r])
            for d in range(o.shape[1]):
                o[r, d] *= a
            total[r] *= a
            m[r] = top[r]
    for rb in range(0, R8, 8):
        m8, s8 = fload(m, rb), fload(total, rb)
        for t in range(n):
            e = fweights(fload(st, t * R8 + rb), m8)
            fstore(st, t * R8 + rb, e)
            s8 = fadd(s8, e)
        fstore(total, rb, s8)
        for t in range(n, KEYS):
            fstore(st, t * R8 + rb, fzero())


QT = 32  # query tokens per tile of the causal kernel


@register_jitable(**NO_NRT)
def _sourced_rows(pool, extra, tables, h, t0, n, dst, hd, seen):
    """_rows through a per-kv-head table: tables[h, j] maps positions j * bs .. j * bs + bs - 1
    to a pool block (>= 0), to nothing (HOLE: zeros, seen[t] False) or to block -2 - e of
    extra [kvh, nx, bs, row] (recalled from an offload tier). A block's rows are taken as a
    run: one table read and one division per block, not per row."""
    bs, kvh = pool.shape[1], pool.shape[2]
    t = 0
    while t < KEYS:
        if t < n:
            e, o0 = tables[h, (t0 + t) // bs], (t0 + t) % bs
            run = min(bs - o0, n - t)
        else:
            e, o0, run = HOLE, 0, KEYS - t
        for i in range(run):
            if e >= 0:
                row_into(dst, (t + i) * hd, pool, (e * bs + o0 + i) * kvh + h, hd)
            elif e < HOLE:
                row_into(dst, (t + i) * hd, extra, (h * extra.shape[1] + (-2 - e)) * bs + o0 + i, hd)
            else:
                for d in range(hd):
                    dst[t + i, d] = 0
            seen[t + i] = e != HOLE
        t += run


def queries(k, gq, L, xi, dq, qs, row, q):
    """A pool of quantized K: the query rows of gq [hd, R] into key_scores' lane blocks of L
    (query_lanes); of float K: nothing (the float products read gq as it is)."""


@overload(queries, jit_options=NO_NRT)
def _queries_impl(k, gq, L, xi, dq, qs, row, q):
    if quant_bytes(k):
        return lambda k, gq, L, xi, dq, qs, row, q: query_lanes(gq, gq.shape[1], L, xi, dq, qs, row, q)
    return lambda k, gq, L, xi, dq, qs, row, q: None


def key_chunk(gq, k, extra, tables, h, t0, n, kc, st, seen, xi, dq, qs):
    """st [KEYS, R] = the scores of the chunk's keys at t0 .. t0 + n - 1 (through a per-kv-head
    table, _sourced_rows) for the query rows of gq [hd, R]: a quantized K's in integer form
    (key_scores, on the lanes `queries` made), a float K's converted into kc and multiplied
    (_scores)."""


@overload(key_chunk, jit_options=NO_NRT)
def _key_chunk_impl(gq, k, extra, tables, h, t0, n, kc, st, seen, xi, dq, qs):
    if quant_bytes(k):

        def ints(gq, k, extra, tables, h, t0, n, kc, st, seen, xi, dq, qs):
            scores_sourced(k, extra, tables, h, t0, n, xi, dq, qs, st, gq.shape[1], gq.shape[0], seen)

        return ints

    def floats(gq, k, extra, tables, h, t0, n, kc, st, seen, xi, dq, qs):
        _sourced_rows(k, extra, tables, h, t0, n, kc, gq.shape[0], seen)
        _scores(gq, kc, st, gq.shape[1], gq.shape[0])

    return floats


@register_jitable(**NO_NRT)
def _cap_and_mask(st, n, t0, first, g, rows, softcap, window, seen):
    """Scores st [KEYS, RT] of a chunk at t0, for rows whose token r // g sits at position
    first + r // g (rows >= `rows` are padding): soft-capped (softcap > 0: softcap *
    tanh(s / softcap), Gemma 2), and -inf where the key is absent, in the row's future or
    (window > 0) not among its `window` newest keys."""
    RT = st.shape[1]
    ninf = np.float32(-np.inf)
    if softcap > 0:
        inv = np.float32(1) / softcap
        for t in range(n):
            for r in range(RT):
                st[t, r] = softcap * np.tanh(st[t, r] * inv)
    for t in range(n):
        if not seen[t]:
            for r in range(RT):
                st[t, r] = ninf
    last = first + (rows - 1) // g  # the tile's last row's position
    if t0 + n - 1 > first or (window > 0 and t0 <= last - window):
        for t in range(n):
            for r in range(RT):
                p = first + r // g
                if t0 + t > p or (window > 0 and t0 + t <= p - window):
                    st[t, r] = ninf


@register_jitable(**NO_NRT)
def _fold(o, m, sums, po, pm, ps, rows):
    """Fold a span's partial softmax (po [rows, hd], row maxima pm, row sums ps) into the
    running one (o, m, sums), row by row: a span the row saw nothing of (ps 0) leaves it as it
    was, the first it saw is taken as it is (so a row of one span has one span's bits), a later
    one rescales both to their common maximum. Every path folds its spans in position order."""
    for r in range(rows):
        if ps[r] > 0:
            if sums[r] > 0:
                top = max(m[r], pm[r])
                a, b = exp(m[r] - top), exp(pm[r] - top)
                for d in range(o.shape[1]):
                    o[r, d] = o[r, d] * a + po[r, d] * b
                sums[r], m[r] = sums[r] * a + ps[r] * b, top
            else:
                for d in range(o.shape[1]):
                    o[r, d] = po[r, d]
                sums[r], m[r] = ps[r], pm[r]


@register_jitable(**NO_NRT)
def _empty(o, m, sums):
    """A softmax state that has seen no key."""
    o[:] = 0
    m[:] = -np.inf
    sums[:] = 0


@register_jitable
def _span_part(qt, k, v, tables, extra_k, extra_v, h, c, lo, hi, first, g, rows, softcap, window, o, m, sums):
    """The softmax state (o, m, sums), from empty, of tile c's rows of kv head h over the keys
    lo .. hi - 1 (one span's, or less: lo a multiple of KEYS), chunk by chunk at lo, lo + KEYS..."""
    hd, RT = qt.shape[2], qt.shape[3]
    kc, vc = np.empty((KEYS, hd), np.float32), np.empty((KEYS, hd), np.float32)
    st, top = np.empty((KEYS, RT), np.float32), np.empty(RT, np.float32)
    seen = np.empty(KEYS, np.bool_)
    nb = hd // QK
    xi, dq, qs = np.empty(RT * hd, np.int8), np.empty(RT * nb, np.float32), np.empty(RT * nb, np.int32)
    queries(k, qt[h, c], lanes_of(RT), xi, dq, qs, np.empty(hd, np.float32), np.empty(QK, np.int8))
    _empty(o, m, sums)
    for t0 in range(lo, hi, KEYS):
        n = min(hi - t0, KEYS)
        key_chunk(qt[h, c], k, extra_k, tables, h, t0, n, kc, st, seen, xi, dq, qs)
        _sourced_rows(v, extra_v, tables, h, t0, n, vc, hd, seen)
        _cap_and_mask(st, n, t0, first, g, rows, softcap, window, seen)
        _softmax_step(st, n, o, m, sums, top)
        _accumulate(st, vc, o, RT, hd)


@register_jitable(**NO_NRT)
def _tile_keys(past, T, QT, c, window):
    """(first position, first key, end of keys) of tile c: the keys its rows can see, from a
    multiple of KEYS."""
    first, end = past + c * QT, past + min(T, (c + 1) * QT)
    start = max(0, first - window + 1) // KEYS * KEYS if window > 0 else 0
    return first, start, end


@register_jitable(**NO_NRT)
def _normalise(fo, fs, out):
    for r in range(fo.shape[0]):
        inv = np.float32(1) / fs[r] if fs[r] > 0 else np.float32(0)
        for d in range(fo.shape[1]):
            out[r, d] = fo[r, d] * inv


@njit(**EXACT_PAR)
def paged_causal(qt, k, v, tables, extra_k, extra_v, past, T, QT, g, softcap, window, split, out):
    """Causal attention of a pass's T query tokens (token i at position past + i) over the
    first past + T positions of per-kv-head tables (_sourced_rows): qt [kvh, tiles, hd, RT]
    holds tile c's QT tokens x g query heads of kv head h (rows ordered (token, head), RT >=
    QT * g a multiple of 8, zero padding after; transposed, scaled); out [kvh, tiles, RT, hd]
    the normalised result. Each tile reads the keys its rows can see, chunk by chunk at the
    positions 0, KEYS, 2 * KEYS..., masking the others (_cap_and_mask), one softmax per SPAN of
    positions (_span_part), the spans folded in order (_fold): a masked key weighs 0 and a
    chunk a row sees nothing of leaves it as it was, so each row's bits depend on its own keys
    only (not on T, QT, the tile or the chunks skipped before a window).
    Parallel over (kv head, tile), the tiles paired long with short; with split, over (kv
    head, tile, span), then the spans are folded per tile: the same folds in the same order,
    so the same bits, for a short pass deep in a context (a turn after a cached prompt, a
    speculative verify), whose few tiles would leave threads idle."""
    kvh, tiles, hd, RT = qt.shape
    if split:
        spans = -(-(past + T) // SPAN)
        po = np.empty((kvh, tiles, spans, RT, hd), np.float32)
        pm, ps = np.empty((kvh, tiles, spans, RT), np.float32), np.empty((kvh, tiles, spans, RT), np.float32)
        for job in prange(kvh * tiles * spans):
            h, c, sp = job // (tiles * spans), job // spans % tiles, job % spans
            first, start, end = _tile_keys(past, T, QT, c, window)
            lo, hi = max(start, sp * SPAN), min(end, (sp + 1) * SPAN)
            rows = min(T - c * QT, QT) * g
            parts = po[h, c, sp], pm[h, c, sp], ps[h, c, sp]
            _span_part(qt, k, v, tables, extra_k, extra_v, h, c, lo, hi, first, g, rows, softcap, window, *parts)
        for job in prange(kvh * tiles):
            h, c = job // tiles, job % tiles
            fo, fm, fs = np.empty((RT, hd), np.float32), np.empty(RT, np.float32), np.empty(RT, np.float32)
            _empty(fo, fm, fs)
            for sp in range(spans):
                _fold(fo, fm, fs, po[h, c, sp], pm[h, c, sp], ps[h, c, sp], RT)
            _normalise(fo, fs, out[h, c])
        return
    for job in prange(kvh * tiles):
        h, i = job // tiles, job % tiles
        c = i // 2 if i % 2 == 0 else tiles - 1 - i // 2  # 0, last, 1, last - 1, ...
        o, m, sums = np.empty((RT, hd), np.float32), np.empty(RT, np.float32), np.empty(RT, np.float32)
        fo, fm, fs = np.empty((RT, hd), np.float32), np.empty(RT, np.float32), np.empty(RT, np.float32)
        _empty(fo, fm, fs)
        first, start, end = _tile_keys(past, T, QT, c, window)
        rows = min(T - c * QT, QT) * g  # the tile's real rows
        lo = start
        while lo < end:
            hi = min(end, (lo // SPAN + 1) * SPAN)
            _span_part(qt, k, v, tables, extra_k, extra_v, h, c, lo, hi, first, g, rows, softcap, window, o, m, sums)
            _fold(fo, fm, fs, o, m, sums, RT)
            lo = hi
        _normalise(fo, fs, out[h, c])


@self_check("kv", cost=8.3)
def check(k_fmt: str, v_fmt: str) -> bool:
    """The causal kernel for a pool of these K and V formats, with the array kinds the model
    passes (read-only int64 tables, no extra blocks): equal keys weigh every value alike, so
    each normalised output is the value."""
    hd = 32  # one block of a quantized row
    (k, _), (v, value) = uniform_pool(k_fmt, (1, 4, 2, hd)), uniform_pool(v_fmt, (1, 4, 2, hd))
    cout = np.empty((2, 1, QT, hd), np.float32)  # one tile of one head each
    tables = np.zeros((2, 1), np.int64)
    tables.flags.writeable = False
    no_k, no_v = (np.empty((2, 0, 4, a.shape[-1]), a.dtype) for a in (k, v))
    q = np.ones((2, 1, hd, QT), np.float32)
    ok = True
    for split in (False, True):
        paged_causal(q, k, v, tables, no_k, no_v, 0, 3, QT, 1, np.float32(0), 0, split, cout)
        ok = ok and np.allclose(cout[:, :, :3], value, rtol=1e-6, atol=0)
    return ok
