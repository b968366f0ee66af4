"""The numpy path (LOCALKV_CPU_KERNELS=0, or a missing numba) gives each token row one answer:
its weight products, norms and attention are the same bits whatever rows share its call, how
a prompt is cut into passes and how its blocks lie in the pool. np.array_equal, never a
tolerance (tests/test_one_answer.py runs whole models this way in a child process)."""

import numpy as np
import pytest

import localkv.backends.cpu.attention as cpu_attention
import localkv.backends.cpu.backend as cpu_backend
from localkv.backends.cpu import quant
from localkv.backends.cpu.formats.types import BLOCK_TYPES, activation_group
from localkv.backends.cpu.quant import fallback
from localkv.backends.cpu.quant.tensor import sample_weight


@pytest.fixture
def numpy_path(monkeypatch):
    """The kernels off for this test, whether or not they loaded."""
    monkeypatch.setattr(quant, "active", lambda qtype: False)
    monkeypatch.setattr(cpu_backend.cpu_kernels, "active", lambda: False)
    monkeypatch.setattr(cpu_attention.cpu_kernels, "attends", lambda head_dim: False)


CUTS = [(0, 1), (5, 1), (39, 1), (3, 2), (0, 16), (7, 16), (2, 17), (11, 29)]  # (first row, rows)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "F16", "BF16", "F32"])
def test_a_row_gets_the_same_product_whatever_rows_share_its_call(numpy_path, qtype, monkeypatch):
    """linear's numpy product: 1 row (once OpenBLAS's gemv), a few, a block and a half; in
    tiles of 64 rows, the last one short."""
    monkeypatch.setattr(fallback, "ROWS_TILE_VALUES", 1)
    cols = 256
    w = quant.QStack((sample_weight(qtype, 150, cols, 1), sample_weight(qtype, 70, cols, 2)))
    x = np.random.default_rng(3).standard_normal((40, cols), dtype=np.float32)
    whole = cpu_backend.linear(x, w, "wqkv")
    for first, rows in CUTS:
        got = cpu_backend.linear(x[first : first + rows], w, "wqkv")
        assert np.array_equal(got, whole[first : first + rows]), (first, rows)
    dense = np.concatenate([quant.dequantize(t) for t in w.tensors])
    xa = fallback.quantize_activations(x, activation_group(qtype)) if qtype in BLOCK_TYPES else x
    np.testing.assert_allclose(whole, xa @ dense.T, rtol=1e-4, atol=1e-3)


def test_a_row_gets_the_same_norm_whatever_rows_share_its_call(numpy_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 576), dtype=np.float32)
    w = rng.standard_normal(576, dtype=np.float32)
    heads = rng.standard_normal((40, 9, 64), dtype=np.float32)
    whole = cpu_backend.rmsnorm(x, w, 1e-5)
    whole_heads = cpu_backend.head_rmsnorm(heads.copy()[:, :6], w[:64], 1e-5)
    for first, rows in CUTS:
        part = slice(first, first + rows)
        assert np.array_equal(cpu_backend.rmsnorm(x[part], w, 1e-5), whole[part]), (first, rows)
        got = cpu_backend.head_rmsnorm(heads[part].copy()[:, :6], w[:64], 1e-5)
        assert np.array_equal(got, whole_heads[part]), (first, rows)


def pool(k: np.ndarray, v: np.ndarray, bs: int, table: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """K/V [n, kvh, hd] scattered into pool layers through table (other blocks hold noise)."""
    n, kvh, hd = k.shape
    rng = np.random.default_rng(9)
    kl, vl = (rng.standard_normal((table.max() + 3, bs, kvh, hd)).astype(dtype) for _ in "kv")
    slots = table[np.arange(n) // bs] * bs + np.arange(n) % bs
    cpu_backend.write_kv(kl, vl, slots, k, v)
    return kl, vl


def by_passes(q, kl, vl, table, cut: int, **opts) -> np.ndarray:
    """Every token's attention, the prompt cut into passes of `cut` tokens."""
    out = [
        cpu_attention.paged_attention(q[t0 : t0 + cut], kl, vl, table, min(len(q), t0 + cut), 0.125, **opts)
        for t0 in range(0, len(q), cut)
    ]
    return np.concatenate(out)


def reference(q, k, v, softcap: float, window: int) -> np.ndarray:
    """Causal attention of every token in float64, one query and head at a time."""
    T, H, hd = q.shape
    g = H // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(T):
        keys = slice(max(0, t + 1 - window) if window else 0, t + 1)
        for h in range(H):
            s = k[keys, h // g].astype(np.float64) @ q[t, h] * 0.125
            s = softcap * np.tanh(s / softcap) if softcap else s
            p = np.exp(s - s.max())
            out[t, h] = p @ v[keys, h // g] / p.sum()
    return out


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (30.0, 0), (0.0, 21), (50.0, 40)])
@pytest.mark.parametrize("H,kvh", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_query_attends_the_same_in_any_pass(numpy_path, softcap, window, H, kvh, dtype):
    """Each token's attention output is the same bits in passes of 1 (decode steps), 7, 33 and
    all 90 tokens, through a table that is one run of blocks and through a shuffled one."""
    rng = np.random.default_rng(H * 10 + kvh)
    n, hd, bs = 90, 64, 8
    k, v = (rng.standard_normal((n, kvh, hd)).astype(dtype) for _ in "kv")
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    opts = dict(softcap=softcap, window=window)
    run = np.arange(2, 2 + -(-n // bs))
    shuffled = rng.permutation(len(run) + 4)[: len(run)]
    kl, vl = pool(k, v, bs, run, dtype)
    whole = by_passes(q, kl, vl, run, n, **opts)
    for table in (run, shuffled):
        kl, vl = pool(k, v, bs, table, dtype)
        for cut in (1, 7, 33, n):
            assert np.array_equal(by_passes(q, kl, vl, table, cut, **opts), whole), (cut, table is run)
    ref = reference(q, k.astype(np.float32), v.astype(np.float32), softcap, window)
    np.testing.assert_allclose(whole, ref, rtol=1e-4, atol=1e-5)


def test_extra_keys_attend_as_the_same_keys_in_the_table(numpy_path):
    """Blocks read back from an offload tier (extra keys, older than the table's) give the bits
    of the same keys held in the table; the table's mass is the same too."""
    rng = np.random.default_rng(5)
    n, ne, kvh, H, hd, bs = 60, 24, 2, 4, 64, 8
    k, v = (rng.standard_normal((n, kvh, hd)).astype(np.float16) for _ in "kv")
    q = rng.standard_normal((5, H, hd)).astype(np.float32)
    full = np.arange(-(-n // bs))
    kl, vl = pool(k, v, bs, full, np.float16)
    mass_full, mass = np.zeros((kvh, n), np.float32), np.zeros((kvh, n), np.float32)
    want = cpu_attention.paged_attention(q, kl, vl, full, n, 0.125, mass_full)
    extra = tuple(np.ascontiguousarray(a[:ne].transpose(1, 0, 2)) for a in (k, v))
    got = cpu_attention.paged_attention(q, kl, vl, full[ne // bs :], n - ne, 0.125, mass, extra)
    assert np.array_equal(got, want)
    assert np.array_equal(mass, mass_full)
