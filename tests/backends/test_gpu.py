"""The CUDA backend (localkv/backends/cuda*.py, kernels in cuda/*.cu) against the CPU backend,
kernel by kernel on random inputs and for a whole model; and backend selection.

Where to run: TestDecode and TestPrefill (the full grid of context lengths up to 4096) need a CUDA
GPU (gpu mark; skipped otherwise). Everything else runs on a GPU when CuPy sees one, else on the
CPU: the backend's host code through the CuPy stand-in (tests/cupy_standin), its kernels on the
CUDA emulator (tests/cuda_emu). The backend.select checks at the top need neither.
"""

import dataclasses
import sys
import types

import numpy as np
import pytest
from cupy_standin import swap

from localkv import backends as backend
from localkv.backends import cpu as ops_numpy
from localkv.backends.cpu import CpuBackend
from localkv.errors import LocalkvError

# ---------------------------------------------------------------- backend selection (CPU only)


def _fake_cupy(get_count):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count)))


def test_select_cpu():
    assert isinstance(backend.select("cpu"), CpuBackend)
    assert backend.select(" CPU ", threads=2).threads == 2
    assert "cpu" in backend.available_devices()


@pytest.mark.parametrize("device", ["tpu", "cuda:0", "metal", "gpu0"])
def test_select_unknown_device(device):
    with pytest.raises(LocalkvError, match=r"unknown device .*use one of auto, cpu, cuda"):
        backend.select(device)


def test_select_cuda_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(LocalkvError) as e:
        backend.select("cuda")
    assert str(e.value) == ("--device cuda needs CuPy: pip install -e '.[gpu]' (CUDA 12) or '.[gpu13]' (CUDA 13)")
    assert isinstance(backend.select("auto"), CpuBackend)
    assert isinstance(backend.select(), CpuBackend)
    assert backend.available_devices() == ["cpu"]


def test_select_cuda_with_cupy_but_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    with pytest.raises(LocalkvError, match=r"^--device cuda: no CUDA GPU visible \(0 devices"):
        backend.select("cuda")
    assert isinstance(backend.select("auto"), CpuBackend)
    assert backend.available_devices() == ["cpu"]


def test_select_cuda_when_the_driver_is_missing(monkeypatch):
    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    with pytest.raises(LocalkvError, match=r"^--device cuda: no CUDA GPU visible \(cudaErrorInsufficientDriver"):
        backend.select("cuda")
    assert isinstance(backend.select("auto"), CpuBackend)


# ---------------------------------------------------------------- on a GPU, or emulated
# (cp is conftest.py's: the real CuPy on a GPU, else the stand-in with the kernels on the emulator)

_SKIP = swap.real_gpu_reason()
GPU = [pytest.mark.gpu, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "GPU present")]


@pytest.fixture(scope="module")
def oc(cp):
    from localkv.backends import cuda

    return cuda


BLOCK_SIZES = [8, 16, 32]
CTXS = [1, 17, 1000, 4096]
HEADS = [(4, 4), (9, 3), (16, 2)]  # GQA ratios 1, 3, 8
HEAD_DIMS = [64, 128]


def _layout(rng, n_ctx, bs, extra=7):
    """A shuffled block table over a pool with `extra` blocks the sequence skips; flat slots."""
    nb = -(-n_ctx // bs)
    num_blocks = nb + extra
    table = rng.permutation(num_blocks)[:nb]
    idx = np.arange(n_ctx)
    return num_blocks, table, table[idx // bs] * bs + idx % bs


def _pools(cp, oc, rng, n_ctx, kvh, hd, bs):
    """The same K/V (fp16 values) in a numpy fp32 pool and a GPU fp16 pool whose other blocks hold
    garbage, written with each backend's write_kv. Returns (np k, np v, gpu k, gpu v, table)."""
    num_blocks, table, slots = _layout(rng, n_ctx, bs)
    k = rng.standard_normal((n_ctx, kvh, hd)).astype(np.float16)
    v = rng.standard_normal((n_ctx, kvh, hd)).astype(np.float16)
    kn = np.zeros((num_blocks, bs, kvh, hd), np.float32)
    vn = np.zeros_like(kn)
    ops_numpy.write_kv(kn, vn, slots, k.astype(np.float32), v.astype(np.float32))
    kg = cp.asarray(rng.standard_normal(kn.shape).astype(np.float16))  # garbage in skipped blocks
    vg = cp.asarray(rng.standard_normal(kn.shape).astype(np.float16))
    oc.write_kv(kg, vg, cp.asarray(slots), cp.asarray(k), cp.asarray(v))
    return kn, vn, kg, vg, table


def _close(got, ref, rtol=2e-2, atol=3e-3):
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("pair", ["q8_0", "q4_0", "q8_0:q4_0"])
@pytest.mark.parametrize("T", [1, 40])
def test_quantized_pools_hold_the_cpu_encoders_bytes_and_attend_as_it_does(cp, oc, pair, T):
    """K/V written by the backend into q8_0 / q4_0 pools are kv_format.encode's bytes; decode (T 1,
    split-K over 1000 tokens) and prefill (T 40) read them as the CPU backend does."""
    from localkv import kv_format

    rng = np.random.default_rng(len(pair) + T)
    n_ctx, kvh, hd, bs, H = 1000, 2, 64, 16, 8
    num_blocks, table, slots = _layout(rng, n_ctx, bs)
    k, v = (rng.standard_normal((n_ctx, kvh, hd)).astype(np.float16) for _ in "kv")
    fk, fv = kv_format.parse(pair)
    kn, vn = (np.zeros((num_blocks, bs, kvh, f.row_len(hd)), f.dtype) for f in (fk, fv))
    ops_numpy.write_kv(kn, vn, slots, k.astype(np.float32), v.astype(np.float32))
    kg, vg = cp.zeros(kn.shape, kn.dtype), cp.zeros(vn.shape, vn.dtype)
    oc.write_kv(kg, vg, cp.asarray(slots), cp.asarray(k), cp.asarray(v))
    assert np.array_equal(oc.to_host(kg), kn) and np.array_equal(oc.to_host(vg), vn)
    q = rng.standard_normal((T, H, hd)).astype(np.float16)
    ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, n_ctx, 0.125)
    _close(oc.to_host(oc.paged_attention(cp.asarray(q), kg, vg, cp.asarray(table), n_ctx, 0.125)), ref)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("H,kvh", HEADS)
@pytest.mark.parametrize("n_ctx", CTXS)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
class TestDecode:
    pytestmark = GPU

    def test_decode_matches_numpy(self, cp, oc, bs, n_ctx, H, kvh, hd):
        rng = np.random.default_rng(bs * 7919 + n_ctx * 31 + H * 7 + hd)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, n_ctx, kvh, hd, bs)
        q = rng.standard_normal((1, H, hd)).astype(np.float16)
        scale = 1 / np.sqrt(hd)
        mass_ref = np.zeros(n_ctx, np.float32)
        ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, n_ctx, scale, mass_ref)
        mass = cp.zeros(n_ctx, cp.float32)
        got = oc.paged_attention(cp.asarray(q), kg, vg, cp.asarray(table), n_ctx, scale, mass)
        assert got.shape == (1, H, hd) and got.dtype == np.float16
        _close(oc.to_host(got), ref)
        np.testing.assert_allclose(oc.to_host(mass), mass_ref, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("H,kvh", HEADS)
@pytest.mark.parametrize("n_ctx,T", [(17, 17), (17, 5), (1000, 64), (4096, 100)])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
class TestPrefill:
    pytestmark = GPU

    def test_prefill_matches_numpy(self, cp, oc, bs, n_ctx, T, H, kvh, hd):
        rng = np.random.default_rng(bs * 104729 + n_ctx * 13 + T * 5 + H + hd)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, n_ctx, kvh, hd, bs)
        # q as the model hands it over: a strided slice of a fused qkv activation
        qkv = rng.standard_normal((T, H + 2 * kvh, hd)).astype(np.float16)
        scale = 1 / np.sqrt(hd)
        mass_ref = np.zeros(n_ctx, np.float32)
        ref = ops_numpy.paged_attention(qkv[:, :H].astype(np.float32), kn, vn, table, n_ctx, scale, mass_ref)
        mass = np.zeros(n_ctx, np.float32)  # a host mass array works too
        got = oc.paged_attention(cp.asarray(qkv)[:, :H], kg, vg, cp.asarray(table), n_ctx, scale, mass)
        _close(oc.to_host(got), ref)
        np.testing.assert_allclose(mass, mass_ref, rtol=2e-3, atol=1e-4)


class TestKernels:
    @pytest.mark.parametrize("hd", [32, 96, 256])
    @pytest.mark.parametrize("n_ctx,T", [(1, 1), (600, 1), (300, 40)])
    def test_other_head_dims(self, cp, oc, hd, n_ctx, T):
        rng = np.random.default_rng(hd + n_ctx + T)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, n_ctx, 2, hd, 16)
        q = rng.standard_normal((T, 8, hd)).astype(np.float16)
        ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, n_ctx, 0.1)
        _close(oc.to_host(oc.paged_attention(cp.asarray(q), kg, vg, cp.asarray(table), n_ctx, 0.1)), ref)

    def test_extra_keys_from_an_offload_tier(self, cp, oc):
        rng = np.random.default_rng(9)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, 40, 2, 64, 16)
        q = rng.standard_normal((3, 6, 64)).astype(np.float16)
        extra = tuple(rng.standard_normal((2, 32, 64)).astype(np.float32) for _ in range(2))
        mass_ref, mass = np.zeros(40, np.float32), np.zeros(40, np.float32)
        ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, 40, 0.125, mass_ref, extra)
        got = oc.paged_attention(
            cp.asarray(q), kg, vg, cp.asarray(table), 40, 0.125, mass, tuple(cp.asarray(a, cp.float16) for a in extra)
        )
        _close(oc.to_host(got), ref)
        np.testing.assert_allclose(mass, mass_ref, rtol=2e-3, atol=1e-4)

    @pytest.mark.parametrize("T", [1, 3])
    def test_per_kv_head_mass_with_heavy_hitters(self, cp, oc, T):
        """h2o's layout: mass [kv_heads, n_extra + n_ctx], extra keys first (CuPy fallback path)."""
        rng = np.random.default_rng(10 + T)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, 40, 2, 64, 16)
        q = rng.standard_normal((T, 6, 64)).astype(np.float16)
        extra = tuple(rng.standard_normal((2, 24, 64)).astype(np.float32) for _ in range(2))
        mass_ref, mass = np.zeros((2, 64), np.float32), cp.zeros((2, 64), cp.float32)
        ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, 40, 0.125, mass_ref, extra)
        got = oc.paged_attention(
            cp.asarray(q), kg, vg, cp.asarray(table), 40, 0.125, mass, tuple(cp.asarray(a, cp.float16) for a in extra)
        )
        _close(oc.to_host(got), ref)
        np.testing.assert_allclose(oc.to_host(mass), mass_ref, rtol=2e-3, atol=1e-4)
        assert np.isclose(mass_ref.sum(), T * 6, rtol=1e-4)

    @pytest.mark.parametrize("hd", [16, 80])
    def test_head_dims_without_kernels_fall_back(self, cp, oc, hd):
        from localkv.backends.cuda_kernels import KERNEL_HEAD_DIMS

        assert hd not in KERNEL_HEAD_DIMS
        rng = np.random.default_rng(hd)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, 50, 2, hd, 8)
        q = rng.standard_normal((5, 4, hd)).astype(np.float16)
        mass_ref, mass = np.zeros(50, np.float32), np.zeros(50, np.float32)
        ref = ops_numpy.paged_attention(q.astype(np.float32), kn, vn, table, 50, 0.2, mass_ref)
        _close(oc.to_host(oc.paged_attention(cp.asarray(q), kg, vg, cp.asarray(table), 50, 0.2, mass)), ref)
        np.testing.assert_allclose(mass, mass_ref, rtol=2e-3, atol=1e-4)

    def test_fp32_query_gives_fp32_output(self, cp, oc):
        rng = np.random.default_rng(3)
        kn, vn, kg, vg, table = _pools(cp, oc, rng, 40, 2, 64, 16)
        q = rng.standard_normal((3, 6, 64)).astype(np.float32)
        got = oc.paged_attention(cp.asarray(q), kg, vg, cp.asarray(table), 40, 0.125)
        assert got.dtype == np.float32
        q16 = q.astype(np.float16).astype(np.float32)
        _close(oc.to_host(got), ops_numpy.paged_attention(q16, kn, vn, table, 40, 0.125))

    @pytest.mark.parametrize("hd", HEAD_DIMS)
    def test_batched_decode(self, cp, oc, hd):
        """Several sequences of different lengths in one pool, one launch."""
        rng = np.random.default_rng(hd)
        bs, kvh, H = 16, 2, 8
        lens = [1, 17, 300, 1000, 4096]
        num_blocks = sum(-(-n // bs) for n in lens) + 9
        perm = rng.permutation(num_blocks)
        kn = rng.standard_normal((num_blocks, bs, kvh, hd)).astype(np.float16)
        vn = rng.standard_normal((num_blocks, bs, kvh, hd)).astype(np.float16)
        tables, used = [], 0
        for n in lens:
            nb = -(-n // bs)
            tables.append(perm[used : used + nb])
            used += nb
        width = max(len(t) for t in tables) + 2
        bt = np.zeros((len(lens), width), np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        q = rng.standard_normal((len(lens), H, hd)).astype(np.float16)
        got = oc.to_host(
            oc.paged_decode(
                cp.asarray(q), cp.asarray(kn), cp.asarray(vn), cp.asarray(bt), cp.asarray(np.array(lens, np.int32)), 0.1
            )
        )
        for i, n in enumerate(lens):
            ref = ops_numpy.paged_attention(
                q[i : i + 1].astype(np.float32), kn.astype(np.float32), vn.astype(np.float32), tables[i], n, 0.1
            )
            _close(got[i : i + 1], ref)

    @pytest.mark.parametrize("src_dtype", [np.float16, np.float32])
    def test_write_kv_strided_input_and_padding_slots(self, cp, oc, src_dtype):
        rng = np.random.default_rng(5)
        nb, bs, kvh, hd, T, H = 6, 8, 2, 64, 11, 4
        qkv = rng.standard_normal((T, H + 2 * kvh, hd)).astype(src_dtype)
        slots = rng.permutation(nb * bs)[:T].astype(np.int64)
        slots[3] = -1  # a padding row: skipped
        kn = np.zeros((nb, bs, kvh, hd), np.float32)
        vn = np.zeros_like(kn)
        keep = slots >= 0
        ops_numpy.write_kv(kn, vn, slots[keep], qkv[keep, H : H + kvh], qkv[keep, H + kvh :])
        kg, vg = cp.zeros(kn.shape, cp.float16), cp.zeros(kn.shape, cp.float16)
        g = cp.asarray(qkv)
        oc.write_kv(kg, vg, cp.asarray(slots), g[:, H : H + kvh], g[:, H + kvh :])
        np.testing.assert_array_equal(oc.to_host(kg), kn.astype(np.float16))
        np.testing.assert_array_equal(oc.to_host(vg), vn.astype(np.float16))

    def test_gather_kv(self, cp, oc):
        from localkv.backends.cuda_kv import gather_kv

        rng = np.random.default_rng(6)
        layer = rng.standard_normal((9, 8, 2, 64)).astype(np.float16)
        table = np.array([4, 0, 7])
        got = gather_kv(cp.asarray(layer), cp.asarray(table), 19)
        # ops_numpy returns [kvh, n, hd] (contiguous per head); the CuPy fallback keeps [n, kvh, hd]
        np.testing.assert_array_equal(oc.to_host(got), ops_numpy.gather_kv(layer, table, 19).transpose(1, 0, 2))

    @pytest.mark.parametrize("n_tokens", [None, 5])
    def test_copy_blocks(self, cp, oc, n_tokens):
        from localkv.backends.cuda_kv import copy_blocks

        rng = np.random.default_rng(7)
        shape = (3, 10, 8, 2, 64)
        k = rng.standard_normal(shape).astype(np.float16)
        v = rng.standard_normal(shape).astype(np.float16)
        kg, vg = cp.asarray(k), cp.asarray(v)
        src, dst = [1, 4, 6], [0, 9, 2]
        copy_blocks(kg, vg, src, dst, n_tokens)
        n = 8 if n_tokens is None else n_tokens
        k[:, dst, :n], v[:, dst, :n] = k[:, src, :n], v[:, src, :n]
        np.testing.assert_array_equal(oc.to_host(kg), k)
        np.testing.assert_array_equal(oc.to_host(vg), v)
        with pytest.raises(ValueError):
            copy_blocks(kg, vg, [1, 2], [2, 3])  # a destination is also a source

    @pytest.mark.parametrize("dtype", [np.float16, np.float32])
    @pytest.mark.parametrize("D", [64, 576, 4096])
    def test_rmsnorm(self, cp, oc, dtype, D):
        rng = np.random.default_rng(D)
        x = (3 * rng.standard_normal((7, D))).astype(dtype)
        w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        ref = ops_numpy.rmsnorm(x.astype(np.float32), w, 1e-5)
        got = oc.rmsnorm(cp.asarray(x), cp.asarray(w), 1e-5)
        assert got.dtype == dtype
        _close(
            oc.to_host(got), ref, rtol=2e-3 if dtype == np.float16 else 1e-5, atol=2e-3 if dtype == np.float16 else 1e-5
        )

    @pytest.mark.parametrize("dtype", [np.float16, np.float32])
    @pytest.mark.parametrize("hd", [64, 128])
    def test_rope_in_place_on_a_strided_view(self, cp, oc, dtype, hd):
        rng = np.random.default_rng(hd)
        T, H, K = 9, 6, 2
        cos, sin = ops_numpy.rope_tables(hd, 64, 10000.0)
        gcos, gsin = oc.rope_tables(hd, 64, 10000.0)
        np.testing.assert_allclose(oc.to_host(gcos), cos, atol=1e-6)
        pos = rng.integers(0, 64, T)
        qkv = rng.standard_normal((T, H + 2 * K, hd)).astype(dtype)
        ref = qkv.astype(np.float32)
        ops_numpy.rope(ref[:, : H + K], cos[pos], sin[pos])
        g = cp.asarray(qkv)
        gpos = cp.asarray(pos)
        out = oc.rope(g[:, : H + K], gcos[gpos], gsin[gpos])
        tol = 2e-3 if dtype == np.float16 else 1e-5
        _close(oc.to_host(g), ref, rtol=tol, atol=tol)  # rotated in place, v untouched
        assert out.shape == (T, H + K, hd)

    @pytest.mark.parametrize("dtype", [np.float16, np.float32])
    def test_silu_mul(self, cp, oc, dtype):
        rng = np.random.default_rng(8)
        gu = (4 * rng.standard_normal((5, 2 * 1536))).astype(dtype)
        ref = ops_numpy.silu_mul(gu.astype(np.float32))
        got = oc.silu_mul(cp.asarray(gu))
        assert got.dtype == dtype and got.shape == (5, 1536)
        tol = 5e-3 if dtype == np.float16 else 1e-5
        _close(oc.to_host(got), ref, rtol=tol, atol=tol)

    def test_upload_weights(self, cp, oc):
        w = {"a.attn_norm": np.ones(8, np.float32), "a.wqkv": np.ones((8, 24), np.float32)}
        g = oc.upload_weights(w)
        assert g["a.attn_norm"].dtype == np.float32 and g["a.wqkv"].dtype == np.float16
        assert isinstance(g["a.wqkv"], cp.ndarray)

    def test_select_cuda(self, oc):
        assert isinstance(backend.select("cuda"), oc.CudaBackend)
        assert isinstance(backend.select("auto"), oc.CudaBackend)
        assert backend.available_devices() == ["cpu", "cuda"]


# ---------------------------------------------------------------- whole model


def _step(model, kv, seqs, max_tokens=None, masses=None):
    """Engine.step without prefix caching: one forward pass over the pending tokens of seqs."""
    from localkv.kv.evict import AttendExtras
    from localkv.model.llama import Span

    tokens, positions, slots, spans, rows = [], [], [], [], []
    budget = max_tokens or sum(len(s.pending) for s in seqs)
    for _i, seq in enumerate(seqs):
        chunk = seq.pending[:budget]
        budget -= len(chunk)
        start = len(tokens)
        positions.extend(range(seq.num_computed, seq.num_computed + len(chunk)))
        slots.append(kv.append_slots(seq, len(chunk)))
        tokens.extend(chunk)
        mass = None
        if masses is not None:  # per layer, summed over heads (the kernels' layout)
            mass = np.zeros((model.cfg.n_layers, seq.num_stored), np.float32)
            masses.append(mass)
        extras = None if mass is None else AttendExtras(mass)
        spans.append(Span(start, len(chunk), np.asarray(seq.block_table), seq.num_stored, extras))
        rows.append(len(tokens) - 1)
    return model.forward(np.asarray(tokens), np.asarray(positions), np.concatenate(slots), spans, kv.pool, rows)


def _run_model(model, pool, prompts, chunk, decode_steps=3):
    """Prefill each prompt in chunks, then decode all sequences together; every step's logits and
    the attention masses of the last step."""
    from localkv.kv.block_tables import KVManager
    from localkv.sequence import Sequence

    kv = KVManager(pool)
    seqs = [Sequence(list(p)) for p in prompts]
    out = []
    for seq in seqs:
        while seq.pending:
            out.append(_step(model, kv, [seq], chunk))
    masses = None
    for t in range(decode_steps):
        for s in seqs:
            s.tokens.append(3 + 11 * t + len(s.tokens) % 7)
        masses = [] if t == decode_steps - 1 else None
        out.append(_step(model, kv, seqs, masses=masses))
    return out, masses, kv, seqs


def _assert_logits_close(got, ref, rel=1e-2):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < rel, f"max |gpu - cpu| is {err:.2e} of max |logit|"


@pytest.fixture(
    scope="module",
    params=[(256, 4, 2, "F32"), (384, 3, 1, "Q8_0"), (64, 4, 2, "F32"), (256, 4, 2, "Q4_K")],
    ids=["hd64", "hd128-q8_0", "hd16", "hd64-q4_k"],
)
def tiny_model(request, tmp_path_factory):
    """Tiny llama GGUFs: F32 matrices (fp16 on the GPU), or Q8_0 / Q4_K blocks (its kernels)."""
    from localkv.model.loader import load_model
    from tiny_model import write_gguf

    dim, heads, kv_heads, quant = request.param
    path = write_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny.gguf",
        quant=quant,
        ctx=512,
        dim=dim,
        ffn=2 * dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
    )
    return load_model(path)


class TestModel:
    def _models(self, cp, oc, loaded, num_blocks=64, bs=16):
        from localkv.kv.block_pool import BlockPool
        from localkv.model.llama import Llama

        cfg = loaded.config
        cuda = oc.CudaBackend()
        cpu = Llama(cfg, loaded.weights, CpuBackend(1))
        gpu = Llama(cfg, cuda.prepare_weights(loaded.weights), cuda)
        pc = BlockPool(cfg.n_layers, num_blocks, bs, cfg.n_kv_heads, cfg.head_dim)
        pg = BlockPool(cfg.n_layers, num_blocks, bs, cfg.n_kv_heads, cfg.head_dim, dtype=np.float16, xp=cp)
        return cpu, gpu, pc, pg

    def test_logits_match_cpu(self, cp, oc, tiny_model):
        cpu, gpu, pc, pg = self._models(cp, oc, tiny_model)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 261, n).tolist() for n in (45, 7, 130)]
        ref, mass_ref, _, _ = _run_model(cpu, pc, prompts, chunk=32)
        got, mass, _, _ = _run_model(gpu, pg, prompts, chunk=32)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            _assert_logits_close(g, r)
        for m, mr in zip(mass, mass_ref):
            np.testing.assert_allclose(m, mr, rtol=5e-2, atol=5e-3)

    def test_batched_decode_matches_per_sequence_attention(self, cp, oc, tiny_model):
        """Decode steps of single-token sequences take one paged_decode launch per layer; the
        per-sequence path must give the same logits."""
        _, gpu, _, pg = self._models(cp, oc, tiny_model)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 261, n).tolist() for n in (20, 33, 5)]
        batched, _, _, _ = _run_model(gpu, pg, prompts, chunk=64, decode_steps=3)
        _, gpu2, _, pg2 = self._models(cp, oc, tiny_model)
        gpu2.backend.caps = dataclasses.replace(gpu2.backend.caps, batched_decode=False)
        single, _, _, _ = _run_model(gpu2, pg2, prompts, chunk=64, decode_steps=3)
        for b, r in zip(batched, single):
            _assert_logits_close(b, r, rel=5e-3)
