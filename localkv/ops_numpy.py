"""The numpy backend: the small op set the model is written in.

A GPU backend implements the same functions with the same shapes; the model never
knows which one runs it.
"""

import numpy as np

xp = np
name = "CPU"
act_dtype = np.float32  # activations
kv_dtype = np.float32  # the KV pool


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    if len(x) == 1:  # a decode row: a third of the calls
        return x * (w / np.sqrt(np.dot(x[0], x[0]) / x.shape[1] + eps)).astype(x.dtype, copy=False)
    ms = np.einsum("td,td->t", x, x) / x.shape[1]
    return x * (1.0 / np.sqrt(ms + eps))[:, None].astype(x.dtype) * w


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate halves ("NEOX" order) of x [T, heads, hd] in place; cos/sin [T, hd/2]."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :h].copy(), x[..., h:]
    x[..., :h] = x1 * c - x2 * s
    x[..., h:] = x2 * c + x1 * s
    return x


# Few rows: one gemv per row beats OpenBLAS's gemm, which copies (packs) the whole weight matrix
# at about 15 GB/s on this 2-core EPYC, while a gemv streams it from memory at about 35 GB/s and
# the later rows re-read it from the 32 MB L3. Up to how many rows, per weight (30 layers,
# gemv vs gemm): 2 rows 19.6 vs 30.1 ms, 4 rows 24.0 vs 28.6 ms, 8 rows gemm is faster.
GEMV_ROWS = {"wqkv": 8, "wo": 3, "w_gate_up": 6, "w_down_t": 6}


def linear(x: np.ndarray, w: np.ndarray, kind: str) -> np.ndarray:
    """x [T, in] @ w [in, out]; kind names the weight (a GEMV_ROWS key)."""
    if 1 < len(x) <= GEMV_ROWS.get(kind, 0):
        return (x[:, None, :] @ w)[:, 0]  # numpy's matmul loops a gemv per row
    return x @ w


def ffn_down(a: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    """a [T, F] @ w_t.T for the down projection stored [D, F], computed as (w_t @ a.T).T:
    OpenBLAS runs that form faster than a @ W with W [F, D] at every size measured here
    (30 layers: 1 row 3.1 vs 4.5 ms, a decode step 23.0 -> 21.3 ms; 8 rows 8.2 vs 8.8 ms;
    512 rows 148 vs 166 ms). The result is a transposed view; `x += ...` takes it as is. Up to
    GEMV_ROWS rows (one row included) numpy's matmul loops a gemv per row, as in linear."""
    if a.shape[0] <= GEMV_ROWS["w_down_t"]:
        return (w_t @ a[:, :, None])[..., 0]
    return (w_t @ a.T).T


def silu_mul(gu: np.ndarray) -> np.ndarray:
    """silu(gate) * up for gu = [gate | up]; in place in one temporary (prefill is memory-bound here)."""
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    t = np.negative(g)
    np.exp(t, out=t)
    t += 1.0
    np.divide(g, t, out=t)
    t *= u
    return t


def write_kv(k_layer: np.ndarray, v_layer: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray):
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool."""
    nb, bs = k_layer.shape[:2]
    k_layer.reshape(nb * bs, *k_layer.shape[2:])[slots] = k
    v_layer.reshape(nb * bs, *v_layer.shape[2:])[slots] = v


Q_BLOCK = 64  # causal prefill runs in query blocks: each block scores only the keys it can see
# (64 vs 128: pp512 +1.5-2%, in-process A/B; the scores of a block stay nearer the cache)


def gather_kv(layer: np.ndarray, block_table: np.ndarray, n_ctx: int) -> np.ndarray:
    """The first n_ctx tokens of a sequence's K or V, read through its block table, as
    [kv_heads, n_ctx, hd]. A table that is one run of consecutive blocks (a fresh pool hands
    them out in order) is read in place: a strided view BLAS takes as it is. Otherwise one
    copy, contiguous per head."""
    nb, bs, kvh, hd = layer.shape
    b0 = getattr(block_table, "run_start", None)
    if b0 is None:
        b0 = _run_start(block_table)
    if b0 >= 0:
        n = len(block_table)
        return layer[b0:b0 + n].reshape(n * bs, kvh, hd)[:n_ctx].transpose(1, 0, 2)
    return layer.transpose(2, 0, 1, 3)[:, block_table].reshape(kvh, -1, hd)[:, :n_ctx]


def _run_start(block_table) -> int:
    """The first block if block_table is one run of consecutive blocks, else -1."""
    n = len(block_table)
    ok = n and int(block_table[-1]) - int(block_table[0]) == n - 1 and (n < 3 or (np.diff(block_table) == 1).all())
    return int(block_table[0]) if ok else -1


class Table(np.ndarray):
    """A read-only block table that carries its run check (see frozen_table)."""
    run_start: int | None = None  # views and results of it (numpy keeps the class) are checked when read


def frozen_table(block_table) -> Table:
    """A read-only copy of a block table for one forward pass, its run check done once: every
    layer reads K and V through it (60 checks a decode step before)."""
    t = np.array(block_table).view(Table)
    t.run_start = _run_start(t)
    t.flags.writeable = False
    return t


def paged_attention(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, block_table: np.ndarray,
                    n_ctx: int, scale: float, mass: np.ndarray | None = None, extra=None) -> np.ndarray:
    """Causal attention of q [T, H, hd] — the last T tokens of an n_ctx context — over the
    K/V found through block_table. Returns [T, H, hd]. extra = (K, V) [kv_heads, n, hd]: more
    keys every query sees (h2o's heavy hitters, blocks read back from an offload tier; older
    than the whole table), attended to with the table's. If mass is given, the attention
    weight each key received, summed over queries, is added to it: mass [kv_heads, n + n_ctx]
    per kv head (its query heads summed; extra keys first), or mass [n_ctx] summed over all
    heads (the table's keys only)."""
    T, H, hd = q.shape
    k = gather_kv(k_layer, block_table, n_ctx)
    v = gather_kv(v_layer, block_table, n_ctx)
    ne = 0
    if extra is not None:
        ne = extra[0].shape[1]
        k, v = np.concatenate((extra[0], k), axis=1), np.concatenate((extra[1], v), axis=1)
    kvh = k.shape[0]
    g = H // kvh  # query heads h*g .. h*g+g-1 share kv head h
    # scale the queries, not the scores, and (without mass) normalise the output rows, not the
    # scores: two passes fewer over the [kvh, g * tq, kend] scores (pp512 attention: 170 -> 157 ms)
    qg = (q * scale).reshape(T, kvh, g, hd).transpose(1, 2, 0, 3)  # [kvh, g, T, hd]
    out = np.empty((T, kvh, g, hd), q.dtype)
    past = ne + n_ctx - T
    for q0 in range(0, T, Q_BLOCK):
        q1 = min(T, q0 + Q_BLOCK)
        tq, kend = q1 - q0, past + q1  # keys past kend are in every query's future
        s = np.matmul(qg[:, :, q0:q1].reshape(kvh, g * tq, hd), k[:, :kend].transpose(0, 2, 1))
        if tq > 1:  # query i of the block sees keys up to past + q0 + i
            s.reshape(kvh, g, tq, kend)[..., past + q0:] += np.triu(np.full((tq, tq), -np.inf, s.dtype), k=1)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        total = _row_sums(s)
        if mass is None:
            o = np.matmul(s, v[:, :kend])
            o /= total
        else:
            s /= total
            if mass.ndim == 2:
                mass[:, :kend] += s.sum(axis=1)
            else:
                mass[:kend - ne] += s.sum(axis=(0, 1))[ne:]
            o = np.matmul(s, v[:, :kend])
        out[q0:q1] = o.reshape(kvh, g, tq, hd).transpose(2, 0, 1, 3)
    return out.reshape(T, H, hd)


def _row_sums(s: np.ndarray) -> np.ndarray:
    """s.sum(-1, keepdims=True) as a matrix-vector product with ones: BLAS's gemv does it about
    3x faster than numpy's pairwise sum here (scores [3, 24, 2000]: 7.8 vs 25 us)."""
    return np.matmul(s, np.ones(s.shape[-1], s.dtype))[..., None]


def _partial(q, k, v):
    """Unnormalised attention of q [..., R, hd] (already scaled) over k/v [..., n, hd] (leading
    dims batch, e.g. kv heads): (out, row max, row sum)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    m = s.max(axis=-1, keepdims=True)
    s -= m
    np.exp(s, out=s)
    return np.matmul(s, v), m, _row_sums(s)


def shared_prefix_decode(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, prefix_table: np.ndarray,
                         tails: "list[tuple[np.ndarray, int]] | tuple", scale: float) -> np.ndarray:
    """Decode attention for B sequences (one query each, q [B, H, hd]) whose block tables all
    begin with prefix_table (full blocks, e.g. the forks of one prompt). The prefix K/V are
    gathered and scored once for all B queries; each sequence's own tail (its table after the
    prefix, n tokens) is scored on its own (all tails in one batched pass when they are the
    same length, as branches decoding in lockstep are); the two softmax parts merge by their
    row maxima (cascade attention). Same result as paged_attention per sequence."""
    B, H, hd = q.shape
    kvh = k_layer.shape[2]
    g = H // kvh
    kp = gather_kv(k_layer, prefix_table, len(prefix_table) * k_layer.shape[1])
    vp = gather_kv(v_layer, prefix_table, len(prefix_table) * k_layer.shape[1])
    qg = (q * scale).reshape(B, kvh, g, hd).transpose(1, 0, 2, 3).reshape(kvh, B * g, hd)
    op, mp, lp = _partial(qg, kp, vp)  # rows ordered (sequence, group)
    tables = tails.stacked if isinstance(tails, Tails) else _stack_tails(tails)
    if tables is not None:
        n = tails[0][1]
        kt = k_layer.transpose(2, 0, 1, 3)[:, tables].reshape(kvh, B, -1, hd)[:, :, :n]  # [kvh, B, n, hd]
        vt = v_layer.transpose(2, 0, 1, 3)[:, tables].reshape(kvh, B, -1, hd)[:, :, :n]
        tail = _partial(qg.reshape(kvh, B, g, hd), kt, vt)  # [kvh, B, g, .]
        out = _merge((op.reshape(kvh, B, g, hd), mp.reshape(kvh, B, g, 1), lp.reshape(kvh, B, g, 1)), tail)
        return out.transpose(1, 0, 2, 3).reshape(B, H, hd)
    out = np.empty((B, kvh, g, hd), q.dtype)
    for b, (table, n) in enumerate(tails):
        rows = slice(b * g, (b + 1) * g)
        tail = _partial(qg[:, rows], gather_kv(k_layer, table, n), gather_kv(v_layer, table, n))
        out[b] = _merge((op[:, rows], mp[:, rows], lp[:, rows]), tail)
    return out.reshape(B, H, hd)


class Tails(tuple):
    """(table, tokens) per sequence after the shared prefix, with `stacked`: the tables as one
    [B, blocks] array when all tails hold the same number of tokens (branches decoding in
    lockstep), else None. Made once per forward (frozen_tails), read by every layer."""
    stacked: np.ndarray | None


def frozen_tails(tails) -> Tails:
    t = Tails(tails)
    t.stacked = _stack_tails(t)
    return t


def _stack_tails(tails) -> np.ndarray | None:
    n, blocks = tails[0][1], len(tails[0][0])
    return np.stack([t[0] for t in tails]) if all(t[1] == n and len(t[0]) == blocks for t in tails) else None


def _merge(first, second):
    """Normalised attention from two _partial results over disjoint key sets."""
    (o1, m1, l1), (o2, m2, l2) = first, second
    m = np.maximum(m1, m2)
    a, c = np.exp(m1 - m), np.exp(m2 - m)
    return (o1 * a + o2 * c) / (l1 * a + l2 * c)


def to_host(x) -> np.ndarray:
    return x
