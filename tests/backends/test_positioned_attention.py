"""paged_attention over a KV policy's keys by position (head_tables=True): per kv head, pool
blocks, holes and blocks of extra K/V, each at its own positions (kv/evict/protocol.PositionedKV)."""

import numpy as np
import pytest

from localkv.backends.cpu import build, paged_attention
from localkv.backends.cpu import compiled as cpu_kernels
from localkv.sequence import HOLE, extra_entry

KVH, H, HD, BS = 2, 6, 16, 16
KERNELS = pytest.mark.skipif(not build.load(), reason="no numba kernels")


@pytest.fixture(params=[pytest.param("kernels", marks=KERNELS), "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(cpu_kernels, "attends", lambda head_dim: False)
    return request.param


def layout(rng, n_ctx: int, dtype, moved: list[list[int]], holes: list[list[int]]):
    """A pool holding n_ctx positions through a shuffled table, and the per-kv-head tables by
    position in which kv head h finds its blocks moved[h] in extra K/V and none of holes[h]."""
    nb = -(-n_ctx // BS)
    k, v = (rng.standard_normal((nb + 4, BS, KVH, HD)).astype(dtype) for _ in range(2))
    table = rng.permutation(nb + 4)[:nb]
    nx = max(len(m) for m in moved)
    xk, xv = np.zeros((KVH, nx, BS, HD), dtype), np.zeros((KVH, nx, BS, HD), dtype)
    tables = np.repeat(table[None], KVH, axis=0).astype(np.int64)
    for h in range(KVH):
        for i, j in enumerate(moved[h]):
            xk[h, i], xv[h, i] = k[table[j], :, h], v[table[j], :, h]
            tables[h, j] = extra_entry(i)
        tables[h, holes[h]] = HOLE
    return k, v, table, tables, (xk, xv)


def reference(q, k, v, table, n_ctx, scale, holes):
    """Causal attention by position in float64, kv head h without the positions of holes[h]."""
    T = len(q)
    keys = [a[table].reshape(-1, KVH, HD)[:n_ctx].astype(np.float64) for a in (k, v)]
    out = np.zeros(q.shape)
    for hq in range(H):
        h = hq // (H // KVH)
        there = np.ones(n_ctx, bool)
        for j in holes[h]:
            there[j * BS : (j + 1) * BS] = False
        for t in range(T):
            seen = there & (np.arange(n_ctx) <= n_ctx - T + t)
            s = keys[0][seen, h] @ q[t, hq] * scale
            p = np.exp(s - s.max())
            out[t, hq] = p @ keys[1][seen, h] / p.sum()
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_holes_weigh_nothing_and_recalled_blocks_count_where_they_were(path, T, dtype):
    rng = np.random.default_rng(T)
    n_ctx = 150  # 10 blocks, the last partial
    moved, holes = [[2, 5], [1, 4]], [[1, 3, 4], [2, 3, 5]]  # each kv head its own
    k, v, table, tables, extra = layout(rng, n_ctx, dtype, moved, holes)
    q = rng.standard_normal((T, H, HD)).astype(np.float32)
    got = paged_attention(q, k, v, tables, n_ctx, 0.3, extra=extra, head_tables=True)
    np.testing.assert_allclose(got, reference(q, k, v, table, n_ctx, 0.3, holes), rtol=2e-4, atol=2e-5)


@KERNELS
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_every_position_there_gives_the_bits_of_the_plain_table(T, dtype):
    """The kernel reads a key at its position whatever its source: with no holes, blocks read
    from extra K/V give the bits of the whole table in the pool."""
    rng = np.random.default_rng(T + 1)
    n_ctx = 150
    k, v, table, tables, extra = layout(rng, n_ctx, dtype, [[0, 3, 6], [2, 7, 8]], [[], []])
    q = rng.standard_normal((T, H, HD)).astype(np.float32)
    got = paged_attention(q, k, v, tables, n_ctx, 0.3, extra=extra, head_tables=True)
    assert np.array_equal(got, paged_attention(q, k, v, table, n_ctx, 0.3))


def test_head_tables_need_a_table_per_kv_head():
    k = np.zeros((2, BS, KVH, HD), np.float32)
    with pytest.raises(RuntimeError, match="bug in the caller's logic"):
        paged_attention(np.zeros((1, H, HD), np.float32), k, k, np.arange(2), 20, 0.3, head_tables=True)
