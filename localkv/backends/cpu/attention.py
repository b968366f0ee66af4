"""The CPU backend's attention over the paged pool: K/V read through a block table, causal
prefill in query blocks, and what some architectures add (a sliding window, soft-capped scores).
The forks' shared-prefix decode and the one-launch decode are in backend.py."""

import functools

import numpy as np

import localkv.backends.cpu.build as build
import localkv.backends.cpu.compiled as cpu_kernels
from localkv import kv_format

Q_BLOCK = 64  # causal prefill runs in query blocks: each block scores only the keys it can see
# (the scores of a block stay nearer the cache)


def gather_kv(layer: np.ndarray, block_table: np.ndarray, n_ctx: int) -> np.ndarray:
    """The first n_ctx tokens of a sequence's K or V, read through its block table, as
    [kv_heads, n_ctx, hd]. A table that is one run of consecutive blocks (a fresh pool hands
    them out in order) is read in place: a strided view BLAS takes as it is. Otherwise one
    copy, contiguous per head."""
    nb, bs, kvh, hd = layer.shape
    b0 = table_run(block_table)
    if b0 >= 0:
        n = len(block_table)
        return f32(layer[b0 : b0 + n].reshape(n * bs, kvh, hd)[:n_ctx].transpose(1, 0, 2))
    return f32(layer.transpose(2, 0, 1, 3)[:, block_table].reshape(kvh, -1, hd)[:, :n_ctx])


def f32(a: np.ndarray) -> np.ndarray:
    """K/V rows as float32 [..., hd]: an f16 or quantized pool's are decoded once per call
    (numpy has no f16 matmul that is not a slow loop), an f32 pool's are read in place."""
    return kv_format.decode(a)


def table_run(block_table) -> int:
    """_run_start, taken from a frozen table when it carries it."""
    b0 = getattr(block_table, "run_start", None)
    return _run_start(block_table) if b0 is None else b0


def _run_start(block_table) -> int:
    """The first block if block_table is one run of consecutive blocks, else -1."""
    n = len(block_table)
    ok = n and int(block_table[-1]) - int(block_table[0]) == n - 1 and (n < 3 or (np.diff(block_table) == 1).all())
    return int(block_table[0]) if ok else -1


class Table(np.ndarray):
    """A read-only block table that carries its run check and its per-kv-head copy (see
    frozen_table and per_head)."""

    run_start: int | None = None  # views and results of it (numpy keeps the class) are checked when read
    heads: np.ndarray | None = None


def per_head(block_table, kvh: int) -> np.ndarray:
    """The table as the causal kernel reads it, int64 [kvh, blocks] (read-only): made once per
    frozen table, not once per layer."""
    heads = getattr(block_table, "heads", None)
    if heads is None or heads.shape[0] != kvh:
        heads = np.ascontiguousarray(np.broadcast_to(np.asarray(block_table, np.int64), (kvh, len(block_table))))
        heads.flags.writeable = False
        if isinstance(block_table, Table):
            block_table.heads = heads
    return heads


def frozen_table(block_table) -> Table:
    """A read-only copy of a block table for one forward pass, its run check done once: every
    layer reads K and V through it (60 checks a decode step before)."""
    t = np.array(block_table).view(Table)
    t.run_start = _run_start(t)
    t.flags.writeable = False
    return t


def paged_attention(
    q: np.ndarray,
    k_layer: np.ndarray,
    v_layer: np.ndarray,
    block_table: np.ndarray,
    n_ctx: int,
    scale: float,
    mass: np.ndarray | None = None,
    extra=None,
    softcap: float = 0.0,
    window: int = 0,
    head_tables: bool = False,
) -> np.ndarray:
    """Causal attention of q [T, H, hd] — the last T tokens of an n_ctx context — over the
    K/V found through block_table. Returns [T, H, hd]. extra = (K, V) [kv_heads, n, hd]: more
    keys every query sees (h2o's heavy hitters, blocks read back from an offload tier; older
    than the whole table), attended to with the table's. If mass is given, the attention
    weight each key received, summed over queries, is added to it: mass [kv_heads, n + n_ctx]
    per kv head (its query heads summed; extra keys first), or mass [n_ctx] summed over all
    heads (the table's keys only). softcap > 0: scores become softcap * tanh(score / softcap)
    (Gemma 2). window > 0: a query sees only the `window` newest keys up to itself (its own
    included: llama.cpp's sliding window); blocks wholly before every query's window are not read.
    head_tables: block_table is per kv head, int64 [kv_heads, blocks], by position (a KV
    policy's PositionedKV): n_ctx counts positions, an entry -1 is a hole (keys not there) and
    -2 - i block i of extra = (K, V) [kv_heads, n, block_size, hd]; mass has no extra keys then.
    Without mass and extra keys before the table, attention runs in the tiled kernel when the
    kernels are on."""
    if head_tables and np.ndim(block_table) != 2:
        raise RuntimeError(f"head_tables with a table of shape {np.shape(block_table)}: a bug in the caller's logic")
    if mass is None and (extra is None or head_tables) and cpu_kernels.attends(q.shape[2]):
        if head_tables:
            return cpu_kernels.causal_attention(q, k_layer, v_layer, block_table, n_ctx, scale, softcap, window, extra)
        if build.FAST_PATHS and len(q) <= SHORT_T and n_ctx - len(q) >= SHORT_PAST and not (softcap or window):
            return _short_pass(q, k_layer, v_layer, block_table, n_ctx, scale)
        tables = per_head(block_table, k_layer.shape[2])
        return cpu_kernels.causal_attention(q, k_layer, v_layer, tables, n_ctx, scale, softcap, window)
    if window and not head_tables:
        block_table, n_ctx, mass, extra = _window_skip(
            k_layer.shape[1], block_table, n_ctx, len(q), window, mass, extra
        )
    if build.FAST_PATHS:
        return _query_blocks(q, k_layer, v_layer, block_table, n_ctx, scale, mass, extra, softcap, window, head_tables)
    holes = None
    if head_tables:
        k, v, holes = gather_positioned(k_layer, v_layer, block_table, n_ctx, extra)
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    else:
        k, v = (_keys(layer, block_table, n_ctx, extra, i) for i, layer in enumerate((k_layer, v_layer)))
    return _by_query(q, k, v, scale, mass, k.shape[1] - n_ctx, softcap, window, holes)


def _keys(layer: np.ndarray, block_table, n_ctx: int, extra, which: int) -> np.ndarray:
    """K or V of the table's first n_ctx tokens (extra's first) as one C-contiguous float32
    [kv_heads, n, hd]: the same layout whether the table is one run of blocks or not."""
    kv = gather_kv(layer, block_table, n_ctx)
    if extra is not None:
        return np.concatenate((f32(extra[which]), kv), axis=1)
    return np.ascontiguousarray(kv)


def _by_query(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mass, ne: int, softcap: float, window: int, holes
):
    """paged_attention one query token at a time (keys k, v [kvh, n, hd]: ne extra keys, then
    the table's, the last T of them the queries' own): each query's scores, softmax and
    weighted sum over exactly the keys it sees, in matmuls over its heads whose shapes depend on
    its position alone, so that its result does not depend on the tokens that share its pass
    (the one-answer rule)."""
    T, H, hd = q.shape
    kvh, n = k.shape[0], k.shape[1]
    g = H // kvh
    qg = (q * np.float32(scale)).reshape(T, kvh, g, hd)
    kt = k.transpose(0, 2, 1)
    out = np.empty((T, kvh, g, hd), np.float32)
    for t in range(T):
        end = n - T + t + 1  # keys past end are in this query's future
        k0 = max(0, end - window) if window else 0
        s = _capped(np.matmul(qg[t], kt[:, :, k0:end]), softcap)  # [kvh, g, keys]
        if holes is not None:  # keys offloaded and not recalled
            s += holes[:, None, k0:end]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        if mass is not None:
            _add_mass(mass, s / total, k0, end, ne)
        np.matmul(s, v[:, k0:end], out=out[t])
        out[t] /= total
    return out.reshape(T, H, hd)


def _capped(s: np.ndarray, softcap: float) -> np.ndarray:
    """Scores s soft-capped in place (softcap * tanh(s / softcap)) when softcap > 0."""
    if softcap:
        s *= 1.0 / softcap
        np.tanh(s, out=s)
        s *= softcap
    return s


def _add_mass(mass: np.ndarray, p: np.ndarray, k0: int, end: int, ne: int):
    """Attention weights p [kvh, rows, keys k0..end] summed over their rows into mass
    (paged_attention's two forms)."""
    if mass.ndim == 2:
        mass[:, k0:end] += p.sum(axis=1)
    else:
        a = max(k0, ne)
        mass[a - ne : end - ne] += p.sum(axis=(0, 1))[a - k0 :]


def _query_blocks(
    q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass, extra, softcap, window, head_tables
):
    """paged_attention in blocks of Q_BLOCK queries (the fast paths' numpy attention: its sums'
    order depends on the pass's shape)."""
    T, H, hd = q.shape
    holes = None
    if head_tables:
        k, v, holes = gather_positioned(k_layer, v_layer, block_table, n_ctx, extra)
        extra = None
    else:
        k = gather_kv(k_layer, block_table, n_ctx)
        v = gather_kv(v_layer, block_table, n_ctx)
    ne = 0
    if extra is not None:
        ne = extra[0].shape[1]
        k, v = np.concatenate((extra[0], k), axis=1), np.concatenate((extra[1], v), axis=1)
    kvh = k.shape[0]
    g = H // kvh  # query heads h*g .. h*g+g-1 share kv head h
    # scale the queries, not the scores, and (without mass) normalise the output rows, not the
    # scores: two passes fewer over the [kvh, g * tq, kend] scores
    qg = (q * scale).reshape(T, kvh, g, hd).transpose(1, 2, 0, 3)  # [kvh, g, T, hd]
    out = np.empty((T, kvh, g, hd), q.dtype)
    past = ne + n_ctx - T
    # one scores buffer and one output buffer for all query blocks: the same memory, still in
    # cache, instead of a fresh array per block
    rows = kvh * g * min(T, Q_BLOCK)
    s_buf, o_buf = np.empty(rows * (past + T), q.dtype), np.empty(rows * hd, q.dtype)
    for q0 in range(0, T, Q_BLOCK):
        q1 = min(T, q0 + Q_BLOCK)
        tq, kend = q1 - q0, past + q1  # keys past kend are in every query's future
        k0 = max(0, past + q0 - window + 1) if window else 0  # keys before k0 are outside every window
        n = kend - k0
        s = np.matmul(
            qg[:, :, q0:q1].reshape(kvh, g * tq, hd),
            k[:, k0:kend].transpose(0, 2, 1),
            out=s_buf[: kvh * g * tq * n].reshape(kvh, g * tq, n),
        )
        _capped(s, softcap)
        if holes is not None:
            s += holes[:, None, k0:kend]
        _mask_max(s, tq, past + q0 - k0, window)
        np.exp(s, out=s)
        total = row_sums(s)
        if mass is None:
            o = np.matmul(s, v[:, k0:kend], out=o_buf[: kvh * g * tq * hd].reshape(kvh, g * tq, hd))
            o /= total
        else:
            s /= total
            _add_mass(mass, s, k0, kend, ne)
            o = np.matmul(s, v[:, k0:kend])
        out[q0:q1] = o.reshape(kvh, g, tq, hd).transpose(2, 0, 1, 3)
    return out.reshape(T, H, hd)


def gather_positioned(k_layer: np.ndarray, v_layer: np.ndarray, tables, n_ctx: int, extra=None):
    """The first n_ctx positions of K and V through per-kv-head tables (paged_attention), as
    [kv_heads, n_ctx, hd] float32 each, zeros at the holes; and the holes as a score bias
    [kv_heads, n_ctx] (-inf there, else 0), None when there are none."""
    nb, bs, kvh, _ = k_layer.shape
    hd = kv_format.of(k_layer).head_dim(k_layer.shape[3])
    tables = np.asarray(tables)
    k, v = np.zeros((2, kvh, tables.shape[1], bs, hd), np.float32)
    for h, t in enumerate(tables):
        pool, far = t >= 0, t <= -2
        k[h, pool], v[h, pool] = f32(k_layer[t[pool], :, h]), f32(v_layer[t[pool], :, h])
        if far.any():
            k[h, far], v[h, far] = f32(extra[0][h, -2 - t[far]]), f32(extra[1][h, -2 - t[far]])
    hole = np.repeat(tables == -1, bs, axis=1)[:, :n_ctx]
    holes = np.where(hole, np.float32(-np.inf), np.float32(0)) if hole.any() else None
    return k.reshape(kvh, -1, hd)[:, :n_ctx], v.reshape(kvh, -1, hd)[:, :n_ctx], holes


def _window_skip(bs: int, block_table, n_ctx: int, T: int, window: int, mass, extra):
    """(table, n_ctx, mass, extra) without the leading blocks that lie wholly before the first
    query's window: not read at all. The extra keys, older than the whole table, go with them."""
    skip = max(0, n_ctx - T - window + 1) // bs
    if skip == 0:
        return block_table, n_ctx, mass, extra
    ne = 0 if extra is None else extra[0].shape[1]
    if mass is not None:
        mass = mass[:, ne + skip * bs :] if mass.ndim == 2 else mass[skip * bs :]
    return block_table[skip:], n_ctx - skip * bs, mass, None


def _mask_max(s: np.ndarray, tq: int, first: int, window: int):
    """Scores s [kvh, g*tq, n] of a query block, rows ordered (group, query): query i sees keys
    up to first + i, and with a window only the `window` newest of those. Sets the others to
    -inf and subtracts each row's maximum."""
    if cpu_kernels.active():  # mask, row max and subtract in one pass
        cpu_kernels.causal_max(s, tq, first, window)
        return
    kvh, n = s.shape[0], s.shape[2]
    if window:
        seen = np.arange(n)[None, :]
        last = first + np.arange(tq)[:, None]
        s.reshape(kvh, -1, tq, n)[...] += np.where((seen > last) | (seen <= last - window), -np.inf, 0).astype(s.dtype)
    elif tq > 1:  # query i of the block sees keys up to first + i
        s.reshape(kvh, -1, tq, n)[..., first:] += _causal_mask(tq)
    s -= s.max(axis=-1, keepdims=True)


@functools.lru_cache(maxsize=8)
def _causal_mask(n: int) -> np.ndarray:
    """[n, n]: 0 on and below the diagonal, -inf above (read-only, made once per size)."""
    m = np.triu(np.full((n, n), -np.inf, np.float32), k=1)
    m.flags.writeable = False
    return m


def partial(q, k, v, hidden=None):
    """Unnormalised attention of q [..., R, hd] (already scaled) over k/v [..., n, hd] (leading
    dims batch, e.g. kv heads): (out, row max, row sum). hidden [R, n]: True where a query must
    not see a key."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    if hidden is not None:
        s[..., hidden] = -np.inf
    m = s.max(axis=-1, keepdims=True)
    s -= m
    np.exp(s, out=s)
    return np.matmul(s, v), m, row_sums(s)


def merge(first, second):
    """Normalised attention from two partial results over disjoint key sets (cascade attention)."""
    (o1, m1, l1), (o2, m2, l2) = first, second
    m = np.maximum(m1, m2)
    a, c = np.exp(m1 - m), np.exp(m2 - m)
    return (o1 * a + o2 * c) / (l1 * a + l2 * c)


# A pass of at most this many tokens after at least SHORT_PAST attends in two parts (_short_pass)
SHORT_T, SHORT_PAST = 32, 256


def _short_pass(q: np.ndarray, k_layer, v_layer, table, n_ctx: int, scale: float) -> np.ndarray:
    """Causal attention of a few new tokens after a long context (a turn after a cached
    prompt): every query sees all the older keys, so those go through the kernels' shared-prefix
    attention (compiled.paged_partial: each chunk of keys converted once for all of a kv
    head's rows, the keys split over the threads), where the tiled causal kernel converts them
    once per query tile and has a job per kv head and tile; the new tokens' own keys, causal
    among themselves, in numpy; the two parts merged."""
    T, H, hd = q.shape
    nb, bs, kvh, _ = k_layer.shape
    g, past = H // kvh, n_ctx - T
    qg = (q.reshape(T, kvh, g, hd).transpose(1, 0, 2, 3) * np.float32(scale)).reshape(kvh, T * g, hd)
    older = cpu_kernels.paged_partial(qg, k_layer, v_layer, table, past)
    pos = np.arange(past, n_ctx)
    slots = np.asarray(table)[pos // bs] * bs + pos % bs
    k_new, v_new = (f32(a.reshape(nb * bs, kvh, hd)[slots]).transpose(1, 0, 2) for a in (k_layer, v_layer))
    hidden = np.arange(T * g)[:, None] // g < np.arange(T)[None, :]  # row (token t, head) sees keys <= t
    out = merge(older, partial(qg, k_new, v_new, hidden))
    return out.reshape(kvh, T, g, hd).transpose(1, 0, 2, 3).reshape(T, H, hd)


def row_sums(s: np.ndarray) -> np.ndarray:
    """s.sum(-1, keepdims=True) as a matrix-vector product with ones: BLAS's gemv does it
    faster than numpy's pairwise sum on these shapes."""
    return np.matmul(s, np.ones(s.shape[-1], s.dtype))[..., None]
