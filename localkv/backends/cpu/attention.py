"""The CPU backend's attention over the paged pool: K/V read through a block table, causal
(the tiled kernel, or numpy one query at a time), and what some architectures add (a sliding
window, soft-capped scores). The one-launch decode is in backend.py."""

import numpy as np

import localkv.backends.cpu.compiled as cpu_kernels
from localkv import kv_format
from localkv.backends.cpu.quant import fallback


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
        tables = per_head(block_table, k_layer.shape[2])
        return cpu_kernels.causal_attention(q, k_layer, v_layer, tables, n_ctx, scale, softcap, window)
    if window and not head_tables:
        block_table, n_ctx, mass, extra = _window_skip(
            k_layer.shape[1], block_table, n_ctx, len(q), window, mass, extra
        )
    holes = None
    if head_tables:
        k, v, holes = gather_positioned(k_layer, v_layer, block_table, n_ctx, extra)
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    else:
        k, v = (_keys(layer, block_table, n_ctx, extra, i) for i, layer in enumerate((k_layer, v_layer)))
    qs = q * np.float32(scale)
    if kv_format.of(k_layer).quantized:  # the products the kernels' integer scores give
        qs = fallback.quantize_activations(qs)
    return _by_query(qs, k, v, mass, k.shape[1] - n_ctx, softcap, window, holes)


def _keys(layer: np.ndarray, block_table, n_ctx: int, extra, which: int) -> np.ndarray:
    """K or V of the table's first n_ctx tokens (extra's first) as one C-contiguous float32
    [kv_heads, n, hd]: the same layout whether the table is one run of blocks or not."""
    kv = gather_kv(layer, block_table, n_ctx)
    if extra is not None:
        return np.concatenate((f32(extra[which]), kv), axis=1)
    return np.ascontiguousarray(kv)


def _by_query(q: np.ndarray, k: np.ndarray, v: np.ndarray, mass, ne: int, softcap: float, window: int, holes):
    """paged_attention one query token at a time (q scaled; keys k, v [kvh, n, hd]: ne extra keys, then
    the table's, the last T of them the queries' own): each query's scores, softmax and
    weighted sum over exactly the keys it sees, in matmuls over its heads whose shapes depend on
    its position alone, so that its result does not depend on the tokens that share its pass
    (the one-answer rule)."""
    T, H, hd = q.shape
    kvh, n = k.shape[0], k.shape[1]
    g = H // kvh
    qg = q.reshape(T, kvh, g, hd)
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
