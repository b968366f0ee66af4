"""Decode attention of many sequences (one query token each) in one call, with the causal
kernel's bits for every row (the one-answer rule: a token's attention does not depend on the
other rows of its pass, nor on whether the pass was a decode step or a prompt chunk).

Each row walks its keys as paged_causal does: chunks of KEYS at the positions 0, KEYS, ...,
scores on 8 x 8 register tiles (rows in the lanes), the online-softmax step and the FMA
accumulation in the same order, one softmax per SPAN of positions and the spans folded in
position order. The spans are the jobs here (with the kv heads, and runs of sequences when
there are few spans): a long context's keys are read once a step, split over every thread,
where a job per kv head left a thread idle (3 kv heads on 2 threads). What differs from
paged_causal is which rows share a tile: at each chunk the sequences whose block tables hold
the same blocks there (the forks of one prompt, requests on one system prompt) are scored
together, so a shared chunk is read and converted once for all
of them and fills the lanes; the others take a tile each. A row's arithmetic is the same in
either case, so the sharing changes no bit. A group of up to 4 rows (one sequence, most
models) takes kernels/decode_few's tiles, keys in the lanes, with the same bits.
"""

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import EXACT_PAR, self_check, uniform_pool
from localkv.backends.cpu.kernels.attention import (
    KEYS,
    SPAN,
    _accumulate,
    _empty,
    _fold,
    _scores,
    _softmax_step,
    queries,
)
from localkv.backends.cpu.kernels.decode_few import ROWS, accumulate_rows, rows_t, scores_t, softmax_t
from localkv.backends.cpu.kernels.key_scores import lanes_of, scores_at, scores_keys
from localkv.backends.cpu.kernels.pool_rows import quant_bytes, row_into
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.u8x32 import prefetch
from localkv.kv_format import QK

AHEAD = 2  # chunks between a chunk's prefetch and its reads (BENCHMARKS.md, attention at depth)


@register_jitable(**NO_NRT)
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


@register_jitable(**NO_NRT)
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
def paged_decode(q, scale, k, v, tables, lens, parts, workers, out):
    """Attention of B sequences' last tokens: q [B, H, hd] their query rows, each value times
    scale (float32, as the causal kernel's queries), sequence b at position lens[b] - 1 over
    the first lens[b] tokens of its block table tables[b] (int64 [B, blocks]); out [B, H, hd]
    normalised. Parallel over (kv head, part of the sequences, SPAN of positions): `parts`
    runs of sequences per head, each span's partial softmax kept, then folded in position order
    as the causal kernel folds them (one read of the K/V a step, on every thread at depth;
    a context of one span is normalised by the job that walked it, one launch less);
    `workers` (the thread count) take the jobs in turn, each on buffers it makes once. The
    queries are scaled and the outputs placed here, not in numpy around the call (a few
    microseconds a layer, as much as a short context's attention)."""
    B, H, hd = q.shape
    kvh = k.shape[2]
    g = H // kvh
    rows = B * g
    most = 0
    for s in range(B):
        most = max(most, lens[s])
    spans = -(-most // SPAN)
    po = np.empty((kvh, spans, rows, hd), np.float32)
    pm, ps = np.empty((kvh, spans, rows), np.float32), np.empty((kvh, spans, rows), np.float32)
    jobs = kvh * parts * spans
    workers = min(jobs, workers)
    for w in prange(workers):  # which worker runs a job changes no bit
        bufs, ints, lanes, scratch = _buffers(hd, -(-B // parts), g)
        # a worker's jobs are consecutive, the kv heads of a span next to each other: a block
        # holds every head's rows, so the heads after the first read its lines from the cache
        for job in range(w * jobs // workers, (w + 1) * jobs // workers):
            s, h, p = job // (kvh * parts), job // parts % kvh, job % parts
            s0, s1 = p * B // parts, (p + 1) * B // parts
            _walk(q, scale, k, v, tables, lens, h, s0, s1, s, po[h, s], pm[h, s], ps[h, s], bufs, ints, lanes, scratch)
            if spans == 1:  # a row of one span has that span's bits (_fold): no second launch
                _normalised(po[h, 0, s0 * g : s1 * g], ps[h, 0, s0 * g : s1 * g], h, s0 * g, g, out)
    if spans > 1:
        for job in prange(kvh * parts):
            h, p = job // parts, job % parts
            r0, r1 = p * B // parts * g, (p + 1) * B // parts * g
            o, m = np.empty((r1 - r0, hd), np.float32), np.empty(r1 - r0, np.float32)
            sums = np.empty(r1 - r0, np.float32)
            _empty(o, m, sums)
            for s in range(spans):
                _fold(o, m, sums, po[h, s, r0:r1], pm[h, s, r0:r1], ps[h, s, r0:r1], r1 - r0)
            _normalised(o, sums, h, r0, g, out)


@register_jitable(**NO_NRT)
def _normalised(o, sums, h, r0, g, out):
    """Kv head h's rows r0 .. r0 + len(o) - 1 (sequence, query head of the group) of the
    softmax state (o, sums) divided by their sums, into out [B, H, hd]."""
    for r in range(o.shape[0]):
        inv = np.float32(1) / sums[r]
        b, j = (r0 + r) // g, (r0 + r) % g
        for d in range(o.shape[1]):
            out[b, h * g + j, d] = o[r, d] * inv


@register_jitable
def _buffers(hd, seqs, g):
    """A worker's buffers for jobs of up to `seqs` sequences of g query heads: a group's
    tiles as contiguous arrays of its own width (bufs: views of these), the walk's ints, a
    quantized K's query lanes (key_scores) and their scratch."""
    R8 = -(-seqs * g // 8) * 8
    kc, vc = np.empty((KEYS, hd), np.float32), np.empty((KEYS, hd), np.float32)
    st_buf, gq_buf, go_buf = (
        np.empty(KEYS * R8, np.float32),
        np.empty(hd * R8, np.float32),
        np.empty(R8 * hd, np.float32),
    )
    top, gm, gs = np.empty(R8, np.float32), np.empty(R8, np.float32), np.empty(R8, np.float32)
    kt, st_t = np.empty(hd * KEYS, np.float32), np.empty(ROWS * KEYS, np.float32)  # decode_few's
    taken, members = np.zeros(seqs, np.bool_), np.empty(seqs, np.int64)
    held = np.empty(seqs, np.int64)  # the group whose state the lanes hold
    offs, ahead = np.empty(KEYS, np.int64), np.empty(KEYS, np.int64)
    nb = hd // QK
    lanes = (np.empty(R8 * hd, np.int8), np.empty(R8 * nb, np.float32), np.empty(R8 * nb, np.int32))
    bufs = (kc, vc, st_buf, gq_buf, go_buf, top, gm, gs, kt, st_t)
    return bufs, (taken, members, held, offs, ahead), lanes, (np.empty(hd, np.float32), np.empty(QK, np.int8))


@register_jitable(**NO_NRT)
def _walk(q, scale, k, v, tables, lens, h, s0, s1, span, po, pm, ps, bufs, ints, lanes, scratch):
    """Kv head h's partial softmax of sequences s0 .. s1 - 1 over the keys of one span: po
    [rows, hd], pm, ps [rows] at the rows of those sequences (an empty state for a sequence
    that does not reach the span), chunk by chunk on a worker's buffers (_buffers): without
    reference counts, as the views it takes per chunk (of the buffers, of a block table) cost
    as much as a chunk's prefetches at depth."""
    kc, vc, st_buf, gq_buf, go_buf, top, gm, gs, kt, st_t = bufs
    taken, members, held, offs, ahead = ints
    xi, dq, qs = lanes
    row, code = scratch
    B, H, hd = q.shape
    bs = k.shape[1]
    g = H // k.shape[2]
    o, m, sums = po[s0 * g : s1 * g], pm[s0 * g : s1 * g], ps[s0 * g : s1 * g]
    _empty(o, m, sums)
    resident = 0
    most = 0
    for s in range(s0, s1):
        most = max(most, lens[s])
    for t0 in range(span * SPAN, min(most, (span + 1) * SPAN), KEYS):
        for s in range(s0, s1):  # the rows AHEAD chunks on, on their way while this one is summed
            if s > s0 and _same_keys(tables, lens, s - 1, s, t0 + AHEAD * KEYS, bs):
                continue  # the rows the sequence before asked for (forks, a shared system prompt)
            if lens[s] > t0 + AHEAD * KEYS:
                na = min(KEYS, lens[s] - t0 - AHEAD * KEYS)
                _offsets(tables[s], h, t0 + AHEAD * KEYS, na, bs, k.shape[2], ahead)
                _prefetch_rows(k, ahead, na)
                _prefetch_rows(v, ahead, na)
        taken[:] = False
        while True:
            count = _group(tables, lens, s0, s1, t0, bs, taken, members)
            if count == 0:
                break
            n = 0
            for i in range(count):
                n = max(n, min(lens[members[i]] - t0, KEYS))
            _offsets(tables[members[0]], h, t0, n, bs, k.shape[2], offs)
            r8 = -(-count * g // 8) * 8
            st, gq = st_buf[: KEYS * r8].reshape((KEYS, r8)), gq_buf[: hd * r8].reshape((hd, r8))
            go = go_buf[: r8 * hd].reshape((r8, hd))
            if not _holds(held, resident, members, count):  # the lanes change hands
                _scatter(go_buf, gm, gs, held, resident, g, s0, o, m, sums)
                _gather(q, scale, o, m, sums, members, count, g, h, s0, gq, go, gm, gs)
                queries(k, gq, 1 if count * g <= ROWS else lanes_of(r8), xi, dq, qs, row, code)
                for i in range(count):  # a loop: a slice copy between arrays needs numba's runtime
                    held[i] = members[i]
                resident = count
            _chunk(k, v, offs, n, count * g, gq, go, gm, gs, st, top, bufs, lanes)
    _scatter(go_buf, gm, gs, held, resident, g, s0, o, m, sums)


@register_jitable(**NO_NRT)
def _chunk(k, v, offs, n, rows, gq, go, gm, gs, st, top, bufs, lanes):
    """One chunk of a group's rows (gq [hd, r8], their state go, gm, gs), keys at the pool rows
    offs[:n]: scored (_chunk_scores), the softmax step, the weighted values. A group of up to
    ROWS rows, 8 lanes mostly padding, takes decode_few's sums, keys in the lanes."""
    vc, st_t = bufs[1], bufs[9]
    hd, r8 = gq.shape
    _chunk_scores(k, offs, n, rows, gq, st, bufs, lanes)
    if rows <= ROWS:
        softmax_t(st_t, n, go, gm, gs, rows)
        accumulate_rows(st_t, 1, KEYS, v, offs, n, go, rows)
    else:
        _softmax_step(st, n, go, gm[:r8], gs[:r8], top[:r8])
        _rows(v, offs, n, vc, hd)
        _accumulate(st, vc, go, r8, hd)


def _chunk_scores(k, offs, n, rows, gq, st, bufs, lanes):
    """The scores of the pool rows offs[:n] for a group's rows gq [hd, r8]: up to ROWS rows into
    decode_few's st_t (bufs[9]) with the keys in the lanes, more into st [KEYS, r8]; a quantized
    K in integer form (key_scores, on the query lanes), a float K's rows converted first."""


@overload(_chunk_scores, jit_options=NO_NRT)
def _chunk_scores_impl(k, offs, n, rows, gq, st, bufs, lanes):
    if quant_bytes(k):

        def ints(k, offs, n, rows, gq, st, bufs, lanes):
            hd, r8 = gq.shape
            if rows <= ROWS:
                scores_keys(k, offs, n, lanes[0], lanes[1], lanes[2], bufs[9], hd)
            else:
                scores_at(k, offs, n, lanes[0], lanes[1], lanes[2], st, r8, hd)

        return ints

    def floats(k, offs, n, rows, gq, st, bufs, lanes):
        kc, kt, st_t = bufs[0], bufs[8], bufs[9]
        hd, r8 = gq.shape
        if rows <= ROWS:
            rows_t(k, offs, n, kt, hd)
            scores_t(kt, gq, r8, st_t, hd)
        else:
            _rows(k, offs, n, kc, hd)
            _scores(gq, kc, st, r8, hd)

    return floats


@register_jitable(**NO_NRT)
def _offsets(table, h, t0, n, bs, kvh, offs):
    """offs[t] = the pool row (a flat index over blocks, positions and kv heads) of kv head h's
    key at position t0 + t, for t < n, through the block table: one division per block of the
    chunk, where one per key cost a decode step at depth more than its prefetches."""
    j = t0 // bs
    o, t = t0 - j * bs, 0
    while t < n:
        base, stop = (table[j] * bs + o) * kvh + h, min(n, t + bs - o)
        for i in range(t, stop):
            offs[i] = base + (i - t) * kvh
        t, j, o = stop, j + 1, 0


@register_jitable(**NO_NRT)
def _rows(pool, offs, n, dst, hd):
    """dst [KEYS, hd] = the pool rows offs[:n] (n <= KEYS) as float32; zeros after them."""
    for t in range(KEYS):
        if t < n:
            row_into(dst, t * hd, pool, offs[t], hd)
        else:
            for d in range(hd):
                dst[t, d] = 0


@register_jitable(**NO_NRT)
def _prefetch_rows(pool, offs, n):
    """Hint the pool rows offs[:n] into the caches: a paged layer is read one head's row at a
    time, at strides the hardware prefetchers follow poorly across blocks, and a step at depth
    is bound by these reads. No result changes."""
    row = pool.shape[3]
    line = max(1, 64 // pool.itemsize)  # elements per cache line
    for t in range(n):
        for e in range(0, row, line):
            prefetch(pool, offs[t] * row + e)


@register_jitable(**NO_NRT)
def _holds(held, resident, members, count):
    """The lanes hold the state of this group already (a sequence alone, or the same forks
    chunk after chunk): no gather and scatter per chunk."""
    if resident != count:
        return False
    for i in range(count):  # noqa: SIM110 (a generator does not compile)
        if held[i] != members[i]:
            return False
    return True


@register_jitable(**NO_NRT)
def _scatter(go_buf, gm, gs, members, count, g, s0, o, m, sums):
    """_gather's inverse: a group's running state from its lanes (go_buf [r8, hd] flat, gm,
    gs) back to its rows of o, m, sums."""
    hd = o.shape[1]
    for i in range(count):
        for j in range(g):
            r, at = i * g + j, (members[i] - s0) * g + j
            for d in range(hd):
                o[at, d] = go_buf[r * hd + d]
            m[at], sums[at] = gm[r], gs[r]


@register_jitable(**NO_NRT)
def _gather(q, scale, o, m, sums, members, count, g, h, s0, gq, go, gm, gs):
    """A group's query rows (scaled) and running state into lanes 0 .. count * g - 1 of gq [hd,
    r8] and go, gm, gs; the lanes after them zero queries with an empty state."""
    hd, r8 = gq.shape
    for i in range(count):
        for j in range(g):
            r, at = i * g + j, (members[i] - s0) * g + j
            for d in range(hd):
                gq[d, r], go[r, d] = q[members[i], h * g + j, d] * scale, o[at, d]
            gm[r], gs[r] = m[at], sums[at]
    for r in range(count * g, r8):
        for d in range(hd):
            gq[d, r], go[r, d] = 0, 0
        gm[r], gs[r] = -np.inf, 0


@self_check("kv", cost=10.2)
def check(k_fmt: str, v_fmt: str) -> bool:
    """Two sequences on one block and one on another, a pool of these K and V formats,
    read-only int64 tables: equal keys weigh every value alike, so each row's output is the
    value."""
    hd = 32  # one block of a quantized row
    shape = (2, 4, 2, hd)  # [blocks, block size, kv heads, head dim]
    (k, _), (v, value) = uniform_pool(k_fmt, shape), uniform_pool(v_fmt, shape)
    tables = np.array([[0], [0], [1]], np.int64)
    lens = np.array([3, 2, 4], np.int64)
    tables.flags.writeable = lens.flags.writeable = False
    out = np.empty((3, 2, hd), np.float32)
    paged_decode(np.ones((3, 2, hd), np.float32), np.float32(1), k, v, tables, lens, 2, 2, out)
    return np.allclose(out, value, rtol=1e-6, atol=0)
