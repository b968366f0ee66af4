"""Every kernel of cuda/*.cu run on the CPU and compared with the numpy backend.

tests/cuda_emu compiles the unchanged .cu files with the system C++ compiler against a shim of the
CUDA device API (each CUDA thread a fiber; barriers, warp shuffles, fp16, guard pages around every
buffer), and the backend's own launch code runs them through the CuPy stand-in (cuda_emu/host.py:
numpy arrays in and out). The pools are fp16 as on the GPU, other blocks of the pool hold garbage,
block tables are shuffled; outputs start as NaN so an element a kernel fails to write shows. The
emulator's own semantics: cuda_emu/test_emulator.py.

Tolerances: the kernels compute in fp32 from fp16 inputs and round each output once to fp16, so
an fp16 output differs from numpy's fp32 result by its rounding, at most 2^-11 relative (rtol
2^-10 allows for fp32 accumulation order and __expf), plus a little absolute room for outputs near
zero where fp32 sums cancel; fp32 outputs (lse, mass, fp32 element-wise ops) within 1e-5 to 1e-4;
K/V writes and block copies are exact."""

import math

import numpy as np
import pytest
from cuda_emu import LAUNCHED, compiler, host, settings

from localkv.backends import cpu as ops_numpy

pytestmark = pytest.mark.skipif(
    compiler() is None, reason="no C++ compiler (g++, c++ or clang++; or set CXX): cannot emulate CUDA kernels"
)

F16 = dict(rtol=2**-10, atol=2e-5)  # an fp16 output against numpy's fp32 (see the module docstring)
HEADS = [(4, 4), (9, 3), (8, 2), (16, 2)]  # GQA group sizes 1, 3 (SmolLM2), 4, 8
OTHER_HEAD_DIMS = [32, 96, 256]


@pytest.fixture(scope="module", autouse=True)
def backend():
    """The CUDA backend on the CuPy stand-in (kernels built on first use, cached across runs by a
    hash of the sources)."""
    with host.standin():
        yield


RAN: set[str] = set()  # this module's tests that ran in this process
LAUNCHED_HERE: set[str] = set()  # the kernels they launched


@pytest.fixture(autouse=True)
def _count_launches(request):
    before = LAUNCHED.copy()
    yield
    RAN.add(request.node.nodeid)
    LAUNCHED_HERE.update(k for k, n in LAUNCHED.items() if n > before[k])


def _pool(rng, n_ctx, kvh, hd, bs, extra=5):
    """K and V pools [blocks, bs, kvh, hd] fp16 full of garbage, a sequence's n_ctx tokens written
    through a shuffled block table that skips `extra` blocks. Returns (k, v, table)."""
    nb = -(-n_ctx // bs)
    table = rng.permutation(nb + extra)[:nb].astype(np.int32)
    k = rng.standard_normal((nb + extra, bs, kvh, hd)).astype(np.float16)
    v = rng.standard_normal((nb + extra, bs, kvh, hd)).astype(np.float16)
    return k, v, table


def _lse_ref(q, k, table, n_ctx, scale):
    """log-sum-exp [T, H] of each query row's scaled scores, in float64."""
    T, H, hd = q.shape
    kvh = k.shape[2]
    keys = k[table].reshape(-1, kvh, hd)[:n_ctx].astype(np.float64)
    s = np.einsum("thd,nhd->thn", q.astype(np.float64), np.repeat(keys, H // kvh, axis=1)) * scale
    s = np.where(np.arange(T)[:, None, None] + n_ctx - T < np.arange(n_ctx), -np.inf, s)  # causal
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def _check_attention(q, k, v, table, n_ctx, scale, **launch):
    """Runs the backend's paged_attention path (with mass) and compares out, lse and mass with numpy."""
    mass_ref = np.zeros(n_ctx, np.float32)
    ref = ops_numpy.paged_attention(
        np.ascontiguousarray(q, np.float32), k.astype(np.float32), v.astype(np.float32), table, n_ctx, scale, mass_ref
    )
    mass = np.ones(n_ctx, np.float32)  # the kernel adds to it
    out, lse, nparts = host.paged_attention(q, k, v, table, n_ctx, scale, mass, **launch)
    np.testing.assert_allclose(out.astype(np.float32), ref, **F16)
    np.testing.assert_allclose(lse, _lse_ref(q, k, table, n_ctx, scale), rtol=0, atol=1e-4)
    np.testing.assert_allclose(mass - 1, mass_ref, rtol=1e-4, atol=1e-5)
    return nparts


# ---------------------------------------------------------------- decode (paged_decode_hd*, paged_decode_reduce)
# (every attention test also runs attention_mass_hd* on the same inputs)


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("H,kvh", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("hd", [64, 128])
def test_decode_matches_numpy(bs, H, kvh, hd):
    """One query token: one block, a short last block, and 300 tokens (two split-K partitions of
    256, as the backend partitions for an H200's 132 SMs)."""
    rng = np.random.default_rng(bs * 1000 + H * 10 + hd)
    for n_ctx, parts in ((1, 1), (3 * bs + 5, 1), (300, 2)):
        k, v, table = _pool(rng, n_ctx, kvh, hd, bs)
        q = rng.standard_normal((1, H, hd)).astype(np.float16)
        assert _check_attention(q, k, v, table, n_ctx, 1 / np.sqrt(hd)) == parts


@pytest.mark.parametrize("part", [64, 100, 1 << 20])
@pytest.mark.parametrize("hd,H,kvh", [(64, 9, 3), (128, 8, 2)])
def test_decode_split_k_partitions(part, hd, H, kvh):
    """Many partitions (the last one short), or one that holds the whole context."""
    rng = np.random.default_rng(part + hd)
    k, v, table = _pool(rng, 333, kvh, hd, 16)
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    assert _check_attention(q, k, v, table, 333, 0.1, part=part) == -(-333 // part)


@pytest.mark.parametrize("part", [None, 64, 1 << 20])
@pytest.mark.parametrize("hd,H,kvh", [(64, 9, 3), (128, 16, 2)])
def test_batched_decode_with_different_context_lengths(part, hd, H, kvh):
    """The backend's paged_decode (as DecodeBatch calls it): one launch for sequences of different
    lengths in one pool, block tables zero-padded to a common width (here wider than the longest:
    bt_stride is the row width), partitions sized for the longest context; partitions past a short
    sequence's context are skipped, and the reduce merges only its own."""
    rng = np.random.default_rng(hd + (part or 0))
    bs, lens = 16, [1, 17, 300, 77, 520, 1]
    num_blocks = sum(-(-n // bs) for n in lens) + 9
    perm = rng.permutation(num_blocks).astype(np.int32)
    k = rng.standard_normal((num_blocks, bs, kvh, hd)).astype(np.float16)
    v = rng.standard_normal((num_blocks, bs, kvh, hd)).astype(np.float16)
    tables, used = [], 0
    for n in lens[:-1]:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    tables.append(np.zeros(1, np.int32))
    bt = np.zeros((len(lens), max(map(len, tables)) + 2), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    q = rng.standard_normal((len(lens), H, hd)).astype(np.float16)
    out, lse, nparts = host.decode(q, k, v, bt, np.array(lens, np.int32), 0.1, max(lens), part=part)
    assert nparts > 1 or part == 1 << 20
    for i, n in enumerate(lens):
        ref = ops_numpy.paged_attention(
            q[i : i + 1].astype(np.float32), k.astype(np.float32), v.astype(np.float32), tables[i], n, 0.1
        )
        np.testing.assert_allclose(out[i : i + 1].astype(np.float32), ref, **F16)
        np.testing.assert_allclose(lse[i], _lse_ref(q[i : i + 1], k, tables[i], n, 0.1)[0], atol=1e-4)


# ---------------------------------------------------------------- prefill (paged_prefill_hd*)


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("H,kvh", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("hd", [64, 128])
def test_prefill_matches_numpy(bs, H, kvh, hd):
    """A chunk of 13 tokens after 2 blocks + 24 cached ones: causal within the chunk, attending to
    every cached token; q as the model hands it over, a strided slice of the fused qkv activation."""
    rng = np.random.default_rng(bs * 1000 + H * 10 + hd + 1)
    n_ctx = 2 * bs + 37
    k, v, table = _pool(rng, n_ctx, kvh, hd, bs)
    qkv = rng.standard_normal((13, H + 2 * kvh, hd)).astype(np.float16)
    _check_attention(qkv[:, :H], k, v, table, n_ctx, 1 / np.sqrt(hd))


PREFILL_SHAPES = [  # (n_ctx, T, hd, H, kvh, bs)
    (17, 17, 64, 4, 4, 8),  # a whole prompt, one chunk
    (17, 5, 128, 9, 3, 16),  # a chunk after cached tokens, within one block
    (40, 33, 64, 8, 2, 32),  # T not a multiple of the 8 warps; a short last block
    (100, 9, 128, 16, 2, 8),
    (100, 40, 64, 9, 3, 32),  # more keys than one 32-token tile; several query blocks
    (130, 12, 128, 4, 4, 16),
    (150, 64, 64, 16, 2, 16),
    (90, 2, 128, 8, 2, 32),
]


@pytest.mark.parametrize("n_ctx,T,hd,H,kvh,bs", PREFILL_SHAPES)
def test_prefill_chunk_shapes(n_ctx, T, hd, H, kvh, bs):
    rng = np.random.default_rng(n_ctx * 100 + T)
    k, v, table = _pool(rng, n_ctx, kvh, hd, bs)
    qkv = rng.standard_normal((T, H + 2 * kvh, hd)).astype(np.float16)
    _check_attention(qkv[:, :H], k, v, table, n_ctx, 1 / np.sqrt(hd))


@pytest.mark.parametrize("hd", OTHER_HEAD_DIMS)
@pytest.mark.parametrize("n_ctx,T", [(1, 1), (300, 1), (70, 12)])
def test_other_head_dims(hd, n_ctx, T):
    """hd 256 runs 4 query heads per thread block: a group of 8 takes two head chunks."""
    rng = np.random.default_rng(hd + n_ctx + T)
    k, v, table = _pool(rng, n_ctx, 1, hd, 16)
    q = rng.standard_normal((T, 8, hd)).astype(np.float16)
    _check_attention(q, k, v, table, n_ctx, 0.1)


@pytest.mark.parametrize(
    "order", [dict(order="reverse"), dict(order="random", seed=5, workers=1)], ids=lambda o: o["order"]
)
def test_results_do_not_depend_on_thread_order(order):
    """The kernels have no races: threads taking turns in another order, or blocks on one worker
    instead of two, give bit-identical results (a missing __syncthreads would not)."""
    rng = np.random.default_rng(11)
    k, v, table = _pool(rng, 200, 2, 128, 16)
    q = rng.standard_normal((9, 16, 128)).astype(np.float16)
    runs = []
    for changes in ({}, order):
        with settings(**changes):
            prefill = host.paged_attention(q, k, v, table, 200, 0.1, np.zeros(200, np.float32))
            decode = host.paged_attention(q[:1], k, v, table, 200, 0.1, part=64)
            norm = host.rmsnorm(q.reshape(9, -1), np.ones(16 * 128, np.float32), 1e-5)
        runs.append([*prefill[:2], *decode[:2], norm])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- the KV pool (write_kv_*, copy_blocks_f16)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("kvh,hd", [(2, 64), (3, 128)])
def test_write_kv_from_strided_rows_skipping_padding_slots(dtype, kvh, hd):
    rng = np.random.default_rng(hd + kvh)
    nb, bs, T, H = 6, 8, 11, 4
    qkv = rng.standard_normal((T, H + 2 * kvh, hd)).astype(dtype)
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    slots[3] = -1  # a padding row: skipped
    k_ref = rng.standard_normal((nb, bs, kvh, hd)).astype(np.float32)
    v_ref = rng.standard_normal((nb, bs, kvh, hd)).astype(np.float32)
    kg, vg = k_ref.astype(np.float16), v_ref.astype(np.float16)
    keep = slots >= 0
    ops_numpy.write_kv(k_ref, v_ref, slots[keep], qkv[keep, H : H + kvh], qkv[keep, H + kvh :])
    host.write_kv(kg, vg, slots, qkv[:, H : H + kvh], qkv[:, H + kvh :])
    np.testing.assert_array_equal(kg, k_ref.astype(np.float16))  # one rounding, as numpy's
    np.testing.assert_array_equal(vg, v_ref.astype(np.float16))


@pytest.mark.parametrize("n_tokens", [None, 5, 1])
def test_copy_blocks_in_every_layer(n_tokens):
    rng = np.random.default_rng(7)
    shape = (3, 10, 8, 2, 64)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    kg, vg = k.copy(), v.copy()
    src, dst = [1, 4, 6], [0, 9, 2]
    host.copy_blocks(kg, vg, src, dst, n_tokens)
    n = 8 if n_tokens is None else n_tokens
    k[:, dst, :n], v[:, dst, :n] = k[:, src, :n], v[:, src, :n]
    np.testing.assert_array_equal(kg, k)
    np.testing.assert_array_equal(vg, v)


# ---------------------------------------------------------------- element-wise (rmsnorm_*, rope_*, silu_mul_*)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("D", [48, 64, 576, 4096])
def test_rmsnorm(dtype, D):
    """D below 256 runs one or two warps (48: a warp with lanes past D), else 256 threads."""
    rng = np.random.default_rng(D)
    x = (3 * rng.standard_normal((7, D))).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    ref = ops_numpy.rmsnorm(x.astype(np.float32), w, 1e-5)
    got = host.rmsnorm(x, w, 1e-5)
    assert got.dtype == dtype
    tol = F16 if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.astype(np.float32), ref, **tol)


@pytest.mark.parametrize("style", ["neox", "normal"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hd", [64, 128])
def test_rope_in_place_on_a_strided_view(dtype, hd, style):
    """Both orders: halves (rope_*) and adjacent pairs (rope_pairs_*, llama GGUFs' Q/K rows)."""
    rng = np.random.default_rng(hd)
    T, H, K = 9, 6, 2
    cos, sin = ops_numpy.rope_tables(hd, 64, 10000.0)
    pos = rng.integers(0, 64, T)
    qkv = rng.standard_normal((T, H + 2 * K, hd)).astype(dtype)
    ref = qkv.astype(np.float32)
    ops_numpy.rope(ref[:, : H + K], cos[pos], sin[pos], style)
    host.rope(qkv[:, : H + K], cos[pos], sin[pos], style)
    tol = F16 if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qkv[:, : H + K].astype(np.float32), ref[:, : H + K], **tol)
    np.testing.assert_array_equal(qkv[:, H + K :], ref[:, H + K :].astype(dtype))  # v untouched


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_silu_mul(dtype):
    rng = np.random.default_rng(8)
    gu = (4 * rng.standard_normal((5, 2 * 1536))).astype(dtype)
    ref = ops_numpy.silu_mul(gu.astype(np.float32))
    got = host.silu_mul(gu)
    assert got.dtype == dtype and got.shape == (5, 1536)
    tol = F16 if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.astype(np.float32), ref, **tol)


# ---------------------------------------------------------------- coverage


def test_every_kernel_the_backend_launches_is_tested_here(request):
    """cuda_kernels.KERNELS against the kernels the tests above launched: a kernel added there
    fails here until a test launches it (quant_matvec.cu's: test_cuda_quant.py; write_rows_*, the
    quantized K/V writes: test_cuda_kv_quant.py). Needs every
    test of the module run in this process (skipped when xdist or -k splits it)."""
    others = _tests_in(request.module) - 1
    if len(RAN) < others:
        pytest.skip(f"{others - len(RAN)} of this module's tests ran elsewhere or not at all")
    c = host.constants()
    want = {k for f, names in c.kernels.items() if f != "quant_matvec.cu" for k in names if "write_rows_" not in k}
    assert want - LAUNCHED_HERE == set()
    assert set(c.head_dims) == {64, 128, *OTHER_HEAD_DIMS}


def _tests_in(module) -> int:
    """The test items a module's test functions make, parametrizations multiplied out."""
    n = 0
    for name, f in vars(module).items():
        if name.startswith("test_") and callable(f):
            n += math.prod(len(m.args[1]) for m in getattr(f, "pytestmark", []) if m.name == "parametrize")
    return n
