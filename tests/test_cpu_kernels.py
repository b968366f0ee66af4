"""The compiled few-row CPU kernels (numba): same results as numpy, used by decode, BLAS kept
off the kernels' cores while they run, and a clean fallback when they are off."""

import numpy as np
import pytest

from localkv.backends import cpu as ops_numpy
from localkv.backends import cpu_kernels
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from tiny_model import write_gguf

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("kernels") / "tiny.gguf", ctx=256)


@pytest.fixture(scope="module")
def kernels():
    # numba is a dependency: the kernels must load here, not skip
    assert cpu_kernels.load(), cpu_kernels.why_not()
    return cpu_kernels


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 20])
@pytest.mark.parametrize("k,n", [(64, 48), (576, 960), (37, 5)])
def test_rowdot_matches_numpy(kernels, rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    w.flags.writeable = False  # weights mapped from the cache are read-only
    got = kernels.rowdot(x, w)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_rowdot_takes_a_strided_row_view(kernels):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 2, 32), dtype=np.float32)[:, 1]  # rows not contiguous
    w = rng.standard_normal((16, 32), dtype=np.float32)
    np.testing.assert_allclose(kernels.rowdot(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows,n", [(3, 16), (8, 160), (17, 33), (24, 2000)])
def test_scores_match_numpy(kernels, rows, n):
    rng = np.random.default_rng(rows + n)
    kvh, hd = 3, 64
    q = rng.standard_normal((kvh, rows, hd), dtype=np.float32)
    kf = rng.standard_normal((n, kvh * hd), dtype=np.float32)
    want = np.einsum("hrd,nhd->hrn", q, kf.reshape(n, kvh, hd))
    got = kernels.scores(q, kf)
    assert got.shape == (kvh, rows, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_off_switch(monkeypatch):
    monkeypatch.setenv("LOCALKV_CPU_KERNELS", "0")
    ok, why = cpu_kernels._load()
    assert not ok and "LOCALKV_CPU_KERNELS=0" in why


def test_blas_on_one_thread_while_kernels_run(tiny, kernels):
    from threadpoolctl import threadpool_info

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"}

    ops = Engine(EngineConfig(model=tiny, threads=2)).ops
    ops.begin_forward(1)
    assert blas_threads() == {1}
    ops.begin_forward(ops_numpy.KERNEL_ROWS + 1)  # prefill: BLAS gets the engine's threads
    assert blas_threads() == {2}


def test_decode_same_with_and_without_kernels(tiny, kernels, monkeypatch):
    """Greedy text and the logits of every step agree whether the matmuls (and the fork's
    prefix scores) run on the kernels or on numpy/BLAS."""

    def run():
        eng = Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False))
        logits = []
        forward = eng.model.forward

        def keep(*a, **k):
            out = forward(*a, **k)
            logits.append(np.array(out))
            return out

        eng.model.forward = keep
        solo = Generation(eng, PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).run()
        res = Generation(
            eng, PROMPT * 3, SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True), n=5
        ).run()
        return solo.tokens, [b.tokens for b in res.branches], logits

    with_kernels = run()
    monkeypatch.setitem(cpu_kernels._state, "ok", False)
    assert not ops_numpy.uses_kernels(1)
    without = run()
    assert with_kernels[0] == without[0]
    assert with_kernels[1] == without[1]
    assert len(with_kernels[2]) == len(without[2])
    for a, b in zip(with_kernels[2], without[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t,past", [(1, 40), (5, 0), (64, 0), (100, 37), (130, 300)])
@pytest.mark.parametrize("with_mass", [False, True])
def test_prefill_attention_same_with_and_without_kernels(kernels, monkeypatch, t, past, with_mass):
    """The causal mask + row max kernel gives paged_attention's numpy result (blocks of
    Q_BLOCK queries, a short last block, keys before the chunk, extra keys, h2o's mass)."""
    rng = np.random.default_rng(t + past)
    kvh, g, hd, bs = 3, 3, 64, 16
    n_ctx = past + t
    nb = -(-n_ctx // bs) + 2
    kl, vl = (rng.standard_normal((nb, bs, kvh, hd), dtype=np.float32) for _ in range(2))
    table = rng.permutation(nb)[: -(-n_ctx // bs)]
    q = rng.standard_normal((t, kvh * g, hd), dtype=np.float32)
    extra = tuple(rng.standard_normal((kvh, 7, hd), dtype=np.float32) for _ in range(2))

    def run():
        mass = np.zeros((kvh, 7 + n_ctx), np.float32) if with_mass else None
        out = ops_numpy.paged_attention(q, kl, vl, table, n_ctx, 0.125, mass, extra)
        return out, mass

    on = run()
    monkeypatch.setitem(cpu_kernels._state, "ok", False)
    off = run()
    np.testing.assert_allclose(on[0], off[0], rtol=1e-5, atol=1e-5)
    if with_mass:
        np.testing.assert_allclose(on[1], off[1], rtol=1e-4, atol=1e-5)


def test_rmsnorm_and_rope_match_numpy(kernels, monkeypatch):
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((37, 576), dtype=np.float32), rng.standard_normal(576, dtype=np.float32)
    qkv = rng.standard_normal((37, 15, 64), dtype=np.float32)
    cos, sin = ops_numpy.rope_tables(64, 37, 10000.0)
    got_norm, got_rope = ops_numpy.rmsnorm(x, w, 1e-5), ops_numpy.rope(qkv.copy()[:, :12], cos, sin)
    monkeypatch.setitem(cpu_kernels._state, "ok", False)
    np.testing.assert_allclose(got_norm, ops_numpy.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_rope, ops_numpy.rope(qkv.copy()[:, :12], cos, sin), rtol=1e-5, atol=1e-5)
