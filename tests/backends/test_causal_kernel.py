"""The causal attention kernel (kernels/attention.paged_causal through compiled.causal_attention):
soft-capping, sliding windows and per-kv-head tables with holes and recalled blocks give numpy's
attention, and a row's bits depend on its own keys only: not on where a block is read from, nor on
the other rows of its pass."""

import numpy as np
import pytest

from localkv.backends.cpu import build
from localkv.backends.cpu import compiled as cpu_kernels

pytestmark = pytest.mark.skipif(not build.load(), reason="no numba kernels")

KVH, G, HD, BS = 2, 3, 64, 16
RNG = np.random.default_rng(7)


def pool(blocks: int) -> np.ndarray:
    return RNG.standard_normal((blocks, BS, KVH, HD)).astype(np.float16)


def reference(q, k, v, tables, n_ctx, scale, softcap=0.0, window=0, extra=None):
    """numpy's float64 attention over the keys each kv head's table maps (holes masked)."""
    T, H, _ = q.shape
    out = np.empty((T, H, HD))
    for h in range(KVH):
        keys, vals, seen = [], [], []
        for e in tables[h]:
            if e >= 0:
                kb, vb = k[e, :, h], v[e, :, h]
            elif e < -1:  # a recalled block
                kb, vb = extra[0][h, -2 - e], extra[1][h, -2 - e]
            else:  # a hole
                kb = vb = np.zeros((BS, HD), np.float16)
            keys.append(kb), vals.append(vb), seen.append(np.full(BS, e != -1))
        K, V = np.concatenate(keys)[:n_ctx].astype(np.float64), np.concatenate(vals)[:n_ctx].astype(np.float64)
        present = np.concatenate(seen)[:n_ctx]
        for t in range(T):
            p = n_ctx - T + t
            visible = present & (np.arange(n_ctx) <= p)
            if window:
                visible &= np.arange(n_ctx) > p - window
            for j in range(G):
                s = K @ q[t, h * G + j].astype(np.float64) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                s = np.where(visible, s, -np.inf)
                w = np.exp(s - s.max())
                out[t, h * G + j] = (w / w.sum()) @ V
    return out


def attend(q, k, v, tables, n_ctx, **kw):
    return cpu_kernels.causal_attention(q, k, v, np.asarray(tables, np.int64), n_ctx, 0.125, **kw)


@pytest.mark.parametrize("softcap, window", [(0.0, 0), (50.0, 0), (0.0, 40), (30.0, 100)])
def test_capped_and_windowed_scores_match_numpy(softcap, window):
    k, v = pool(12), pool(12)
    table = RNG.permutation(12)[:10]
    tables = np.stack([table] * KVH)
    q = RNG.standard_normal((37, KVH * G, HD)).astype(np.float32)
    got = attend(q, k, v, tables, 150, softcap=softcap, window=window)
    want = reference(q, k, v, tables, 150, 0.125, softcap, window)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_holes_are_keys_that_are_not_there():
    k, v = pool(10), pool(10)
    tables = np.stack([RNG.permutation(10)[:8] for _ in range(KVH)])
    tables[0, 2] = tables[1, 5] = tables[1, 6] = -1  # per kv head: offloaded, not recalled
    q = RNG.standard_normal((5, KVH * G, HD)).astype(np.float32)
    got = attend(q, k, v, tables, 120)
    np.testing.assert_allclose(got, reference(q, k, v, tables, 120, 0.125), atol=2e-5)


def test_a_block_recalled_into_extra_gives_the_bits_of_the_pool():
    """A block read from `extra` (recalled from an offload tier) instead of the pool: the same
    keys at the same positions, so bitwise the same attention."""
    k, v = pool(10), pool(10)
    tables = np.stack([RNG.permutation(10)[:9] for _ in range(KVH)])
    q = RNG.standard_normal((20, KVH * G, HD)).astype(np.float32)
    want = attend(q, k, v, tables, 140)
    moved = tables.copy()
    xk, xv = np.empty((KVH, 2, BS, HD), np.float16), np.empty((KVH, 2, BS, HD), np.float16)
    for h in range(KVH):
        for i, j in enumerate((1, 6)):  # blocks 1 and 6 of each head's table come from the tier
            xk[h, i], xv[h, i] = k[tables[h, j], :, h], v[tables[h, j], :, h]
            moved[h, j] = -2 - i
    got = attend(q, k, v, moved, 140, extra=(xk, xv))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("window", [0, 48])
def test_a_row_does_not_depend_on_the_rows_beside_it(window):
    """The last token's attention alone (a decode step: a tile of one token), in a pass of 9
    and in one of 40: bitwise equal."""
    k, v = pool(8), pool(8)
    table = np.arange(8)
    q = RNG.standard_normal((40, KVH * G, HD)).astype(np.float32)
    whole = attend(q, k, v, [table] * KVH, 120, window=window)
    for T in (1, 9):
        part = attend(q[-T:], k, v, [table] * KVH, 120, window=window)
        assert np.array_equal(part, whole[-T:]), T


@pytest.mark.parametrize("window", [0, 700])
def test_spans_on_their_own_threads_give_the_bits_of_a_tile_walking_them(window, monkeypatch):
    """A short pass deep in a context runs each (kv head, span) as a job and folds the spans
    after (split); a long one walks a tile's spans in turn. Which one ran changes no bit, and
    each matches numpy."""
    import numba

    k, v = pool(100), pool(100)
    tables = [RNG.permutation(100)] * KVH
    q = RNG.standard_normal((40, KVH * G, HD)).astype(np.float32)
    for T in (1, 9, 32, 40):
        got = {}
        for threads in (1, 64):  # 1: every pass walks its spans; 64: a pass of few tiles splits them
            monkeypatch.setattr(numba, "get_num_threads", lambda threads=threads: threads)
            got[threads] = attend(q[-T:], k, v, tables, 1590, window=window)
        assert np.array_equal(got[1], got[64]), T
        ref = reference(q[-T:], k, v, np.asarray(tables), 1590, 0.125, window=window)
        np.testing.assert_allclose(got[64], ref, atol=2e-5)
