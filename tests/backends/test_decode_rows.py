"""The decode kernel (kernels/decode_rows.paged_decode through compiled.decode_rows) at depth
and within one span: its keys split over the threads by spans of positions (SPAN), each row still gets the causal
kernel's bits (decoded alone, or as any row of a prefill tile), for every K/V format, and
numpy's attention; the vector exp has the scalar one's bits."""

import numpy as np
import pytest

from localkv import kv_format
from localkv.backends.cpu import build
from localkv.backends.cpu import compiled as cpu_kernels
from localkv.backends.cpu.quant import fallback

pytestmark = pytest.mark.skipif(not build.load(), reason="no numba kernels")

KVH, G, HD, BS = 2, 3, 64, 16
RNG = np.random.default_rng(11)


def pools(blocks: int, fmt: str, hd: int = HD):
    kv = RNG.standard_normal((2, blocks, BS, KVH, hd)).astype(np.float32)
    k, v = (kv_format.encode(a, kv_format.FORMATS[fmt]) for a in kv)
    return k, v, kv_format.decode(k), kv_format.decode(v)


def frozen(a) -> np.ndarray:
    a = np.array(a, np.int64)
    a.flags.writeable = False
    return a


def batch():
    """Four sequences over 3-4 spans of keys: two that share their first 640 positions (forks),
    one that shares all of the first's blocks it reaches, one short."""
    lens = frozen([1500, 1100, 900, 40])
    blocks = RNG.permutation(200)
    tables = np.zeros((4, 94), np.int64)
    tables[0] = blocks[:94]
    tables[1, :40], tables[1, 40:] = blocks[:40], blocks[94:148]
    tables[2] = tables[0]
    tables[3, :3] = blocks[150:153]
    return frozen(tables), lens


def reference(q, k, v, table, n):
    """numpy's float64 attention of one token's heads q [H, hd] over the first n keys (of k, v:
    a pool's rows; a quantized K's scores with the query rounded as its integer products take it)."""
    hd = q.shape[-1]
    q = q * np.float32(0.125)
    if kv_format.of(k).quantized:
        q = fallback.quantize_activations(q)
    k, v = kv_format.decode(k), kv_format.decode(v)
    K = k[table].reshape(-1, KVH, hd)[:n].astype(np.float64)
    V = v[table].reshape(-1, KVH, hd)[:n].astype(np.float64)
    out = np.empty((KVH * G, hd))
    for j in range(KVH * G):
        s = K[:, j // G] @ q[j].astype(np.float64)
        w = np.exp(s - s.max())
        out[j] = w @ V[:, j // G] / w.sum()
    return out


# head sizes: 64 (one 64-value pass of decode_few's weighted sums), 96 (then 16 at a time), 72
# (and the last 8 alone; float pools only: a quantized row is whole blocks of 32)
@pytest.mark.parametrize("fmt,hd", [(f, 64) for f in ("f16", "f32", "q8_0", "q4_0")] + [("q8_0", 96), ("f16", 72)])
def test_a_decode_row_has_the_bits_of_the_causal_kernel_at_depth(fmt, hd):
    k, v, _, _ = pools(200, fmt, hd)
    tables, lens = batch()
    q = RNG.standard_normal((4, KVH * G, hd)).astype(np.float32)
    got = cpu_kernels.decode_rows(q, k, v, tables, lens, 0.125)
    for b in range(4):
        for T in (1, 45):  # the token decoded alone, or the last row of a prefill tile
            rows = RNG.standard_normal((T, KVH * G, hd)).astype(np.float32)
            rows[-1] = q[b]
            alone = cpu_kernels.causal_attention(rows, k, v, tables[b], int(lens[b]), 0.125)
            assert np.array_equal(alone[-1], got[b]), (b, T)
        np.testing.assert_allclose(got[b], reference(q[b], k, v, tables[b], int(lens[b])), atol=3e-5)


@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_a_context_of_one_span_has_the_bits_of_the_causal_kernel(fmt):
    """Every sequence within one span (the job that walks it also normalises it): each row the
    causal kernel's bits, alone or among others."""
    k, v, _, _ = pools(60, fmt)
    lens = frozen([65, 1, 200, 17])
    tables = frozen(RNG.permutation(60)[:52].reshape(4, 13))
    q = RNG.standard_normal((4, KVH * G, HD)).astype(np.float32)
    got = cpu_kernels.decode_rows(q, k, v, tables, lens, 0.125)
    for b in range(4):
        one = cpu_kernels.decode_rows(q[b : b + 1], k, v, tables[b : b + 1], lens[b : b + 1], 0.125)
        alone = cpu_kernels.causal_attention(q[b : b + 1], k, v, tables[b], int(lens[b]), 0.125)
        assert np.array_equal(alone[0], got[b]) and np.array_equal(one[0], got[b]), b
        np.testing.assert_allclose(got[b], reference(q[b], k, v, tables[b], int(lens[b])), atol=3e-5)


def test_spans_fold_in_position_order_whatever_the_window_start():
    """A long windowed pass: each row alone and in the pass gives the same bits, and numpy's
    attention, whether its window starts in the span of the tile's first row or a later one."""
    k, v, kf, vf = pools(100, "f16")
    table = RNG.permutation(100)
    tables = frozen(np.stack([table] * KVH))
    q = RNG.standard_normal((90, KVH * G, HD)).astype(np.float32)
    whole = cpu_kernels.causal_attention(q, k, v, tables, 1590, 0.125, window=700)
    for T in (1, 7, 50):
        part = cpu_kernels.causal_attention(q[-T:], k, v, tables, 1590, 0.125, window=700)
        assert np.array_equal(part, whole[-T:]), T
    K, V = (a[table].reshape(-1, KVH, HD)[:1590].astype(np.float64) for a in (kf, vf))
    p = 1589  # the last row: keys 890 .. 1589
    for j in range(KVH * G):
        s = K[p - 699 : p + 1, j // G] @ q[-1, j].astype(np.float64) * 0.125
        w = np.exp(s - s.max())
        np.testing.assert_allclose(whole[-1, j], w @ V[p - 699 : p + 1, j // G] / w.sum(), atol=3e-5)


def test_the_vector_exp_has_the_bits_of_the_scalar_one():
    from numba import njit

    from localkv.backends.cpu.kernels.attention import exp
    from localkv.backends.cpu.simd.f32x8 import fexp, fload, fstore, fweights

    @njit
    def both(x, one, eight, weights):
        for i in range(len(x)):
            one[i] = exp(x[i])
        for i in range(0, len(x), 8):
            fstore(eight, i, fexp(fload(x, i)))
            fstore(weights, i, fweights(fload(x, i), fload(np.zeros(8, np.float32), 0)))

    x = np.concatenate([-RNG.exponential(5, 1 << 16), -RNG.uniform(0, 120, 1 << 12)]).astype(np.float32)
    x[:8] = [0, -0.0, -87, -87.5, -1e-30, -86.9, -88.7, -np.inf]
    one, eight, weights = (np.empty_like(x) for _ in range(3))
    both(x, one, eight, weights)
    assert np.array_equal(one.view(np.uint32), eight.view(np.uint32))
    assert np.array_equal(weights[:7].view(np.uint32), one[:7].view(np.uint32)) and weights[7] == 0
    near = x > -80
    assert np.abs(one[near] / np.exp(x[near].astype(np.float64)) - 1).max() < 3e-7
