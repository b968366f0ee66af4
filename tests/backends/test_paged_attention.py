"""Paged attention through a block table equals dense attention over contiguous K/V."""

import numpy as np
import pytest

from localkv.backends import cpu as ops


def dense_attention(q, k, v, scale):
    """Reference: q [T, H, hd] are the last T positions of k/v [n, kvh, hd]; causal."""
    T, H, hd = q.shape
    n, kvh, _ = k.shape
    out = np.zeros_like(q)
    for h in range(H):
        kh, vh = k[:, h // (H // kvh)], v[:, h // (H // kvh)]
        for t in range(T):
            visible = n - T + t + 1
            s = (kh[:visible] @ q[t, h]) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vh[:visible]
    return out


def paged_copy(k, v, block_size, num_blocks, rng):
    """Scatter contiguous K/V into a shuffled set of pool blocks; return pool layers and table."""
    n = k.shape[0]
    nb = -(-n // block_size)
    table = rng.permutation(num_blocks)[:nb]
    kl = rng.standard_normal((num_blocks, block_size, *k.shape[1:])).astype(np.float32)  # garbage elsewhere
    vl = rng.standard_normal((num_blocks, block_size, *k.shape[1:])).astype(np.float32)
    slots = table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
    ops.write_kv(kl, vl, slots, k, v)
    return kl, vl, table


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 32])
@pytest.mark.parametrize("n_ctx,T", [(1, 1), (7, 1), (16, 1), (33, 1), (50, 5), (64, 64), (100, 17)])
@pytest.mark.parametrize("H,kvh", [(4, 4), (9, 3), (8, 1)])
def test_paged_equals_dense(block_size, n_ctx, T, H, kvh):
    rng = np.random.default_rng(block_size * 1000 + n_ctx * 10 + T + H)
    hd = 8
    k = rng.standard_normal((n_ctx, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n_ctx, kvh, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kl, vl, table = paged_copy(k, v, block_size, num_blocks=-(-n_ctx // block_size) + 5, rng=rng)
    got = ops.paged_attention(q, kl, vl, table, n_ctx, 0.3)
    np.testing.assert_allclose(got, dense_attention(q, k, v, 0.3), rtol=1e-4, atol=1e-5)


def test_attention_mass_sums_to_queries_times_heads():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((20, 2, 8)).astype(np.float32)
    q = rng.standard_normal((4, 6, 8)).astype(np.float32)
    kl, vl, table = paged_copy(k, k, 4, 8, rng)
    mass = np.zeros(20, np.float32)
    ops.paged_attention(q, kl, vl, table, 20, 0.5, mass)
    assert mass.sum() == pytest.approx(4 * 6, rel=1e-5)
    assert mass[-1] > 0 and mass[:16].min() > 0  # every visible key got some weight


def test_rope_rotates_halves_and_keeps_norm():
    cos, sin = ops.rope_tables(8, 16, 10000.0)
    x = np.random.default_rng(2).standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 5])
    y = ops.rope(x.copy(), cos[pos], sin[pos])
    np.testing.assert_allclose(y[0], x[0], atol=1e-6)  # position 0: identity
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # position 1, first pair rotates by exactly 1 radian (theta^0)
    a, b = x[1, 0, 0], x[1, 0, 4]
    assert y[1, 0, 0] == pytest.approx(a * np.cos(1) - b * np.sin(1), rel=1e-5)


@pytest.mark.parametrize("T", [1, 6])
def test_extra_keys_are_older_context_every_query_sees(T):
    """extra = K/V read back from an offload tier: the same as having them at the start of
    the table; the mass still covers only the table's own tokens."""
    rng = np.random.default_rng(T)
    n_extra, n_ctx, kvh, H, hd = 12, 20, 2, 6, 8
    k = rng.standard_normal((n_extra + n_ctx, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n_extra + n_ctx, kvh, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kl, vl, table = paged_copy(k[n_extra:], v[n_extra:], 4, 10, rng)
    extra = (np.ascontiguousarray(k[:n_extra].transpose(1, 0, 2)), np.ascontiguousarray(v[:n_extra].transpose(1, 0, 2)))
    mass = np.zeros(n_ctx, np.float32)
    got = ops.paged_attention(q, kl, vl, table, n_ctx, 0.4, mass, extra)
    np.testing.assert_allclose(got, dense_attention(q, k, v, 0.4), rtol=1e-4, atol=1e-5)
    assert 0 < mass.sum() < T * H  # the extra keys took the rest of the weight


@pytest.mark.parametrize("T,n_extra", [(1, 0), (1, 12), (6, 12), (200, 5)])
def test_per_kv_head_mass_matches_dense_weights(T, n_extra):
    """mass [kv_heads, n_extra + n_ctx] (h2o's layout): per key, the softmax weight summed over
    the queries and the kv head's query heads; extra keys first. Checked against weights
    computed densely; T=200 crosses a query block."""
    rng = np.random.default_rng(T + n_extra)
    n_ctx, kvh, H, hd, scale = 230, 2, 6, 8, 0.4
    n = n_extra + n_ctx
    k = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kl, vl, table = paged_copy(k[n_extra:], v[n_extra:], 4, 64, rng)
    extra = None if not n_extra else tuple(np.ascontiguousarray(a[:n_extra].transpose(1, 0, 2)) for a in (k, v))
    mass = np.zeros((kvh, n), np.float32)
    ops.paged_attention(q, kl, vl, table, n_ctx, scale, mass, extra)
    want = np.zeros((kvh, n))
    g = H // kvh
    for h in range(H):
        for t in range(T):
            visible = n - T + t + 1
            s = (k[:visible, h // g] @ q[t, h]) * scale
            p = np.exp(s - s.max())
            want[h // g, :visible] += p / p.sum()
    np.testing.assert_allclose(mass, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("first,n_ctx,T", [(0, 1, 1), (3, 20, 1), (5, 33, 7), (2, 64, 64)])
def test_a_run_of_consecutive_blocks_is_read_in_place(first, n_ctx, T):
    """gather_kv returns a view for a table of consecutive blocks; attention through it
    (and through a copy of the same table that is not one run) equals dense attention."""
    rng = np.random.default_rng(first + n_ctx)
    bs, kvh, H, hd = 4, 2, 6, 8
    nb = -(-n_ctx // bs)
    kl = rng.standard_normal((first + nb + 2, bs, kvh, hd)).astype(np.float32)
    vl = rng.standard_normal(kl.shape).astype(np.float32)
    table = np.arange(first, first + nb)
    k = kl[first : first + nb].reshape(-1, kvh, hd)[:n_ctx]
    v = vl[first : first + nb].reshape(-1, kvh, hd)[:n_ctx]
    assert np.shares_memory(ops.gather_kv(kl, table, n_ctx), kl)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    np.testing.assert_allclose(
        ops.paged_attention(q, kl, vl, table, n_ctx, 0.3), dense_attention(q, k, v, 0.3), rtol=1e-4, atol=1e-5
    )
    if nb >= 4:  # same first and last ids, not consecutive: the copying path
        odd = table.copy()
        odd[1], odd[-2] = odd[-2], odd[1]
        assert not np.shares_memory(ops.gather_kv(kl, odd, n_ctx), kl)


def test_frozen_table_carries_its_run_check():
    """The model hands every layer one frozen table whose run check was done once; a plain
    table changed in place between calls is checked again, and a view of a frozen table
    (numpy keeps its class) is checked when read, never given the whole table's answer."""
    rng = np.random.default_rng(3)
    bs, kvh, hd = 4, 2, 8
    kl = rng.standard_normal((8, bs, kvh, hd)).astype(np.float32)
    table = np.arange(2, 6)
    assert np.shares_memory(ops.gather_kv(kl, table, 16), kl)
    table[1], table[2] = table[2], table[1]  # same object, no longer one run
    got = ops.gather_kv(kl, table, 16)
    assert not np.shares_memory(got, kl)
    np.testing.assert_array_equal(got, kl[table].reshape(-1, kvh, hd).transpose(1, 0, 2))
    frozen = ops.frozen_table([2, 3, 4, 5])
    assert frozen.run_start == 2 and not frozen.flags.writeable
    with pytest.raises(ValueError):
        frozen[0] = 7
    np.testing.assert_array_equal(ops.gather_kv(kl, frozen, 16), kl[2:6].reshape(-1, kvh, hd).transpose(1, 0, 2))
    assert ops.frozen_table([5, 1]).run_start == -1
    np.testing.assert_array_equal(
        ops.gather_kv(kl, ops.frozen_table([5, 1]), 8), kl[[5, 1]].reshape(-1, kvh, hd).transpose(1, 0, 2)
    )
    tail = frozen[1:]  # a view: blocks 3..5 start at 3, not at the whole table's 2
    assert tail.run_start is None
    np.testing.assert_array_equal(ops.gather_kv(kl, tail, 12), kl[3:6].reshape(-1, kvh, hd).transpose(1, 0, 2))
