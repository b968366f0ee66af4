"""The CUDA kernels on q8_0 / q4_0 K/V pools, run on the CPU by the emulator (tests/cuda_emu, as
test_cuda_emu.py runs the f16 ones): rows quantized once on the device as they are written, into
exactly the bytes the CPU's kv_format.encode writes for the same rows, and attention (decode,
split-K, batched decode, prefill, attention mass, the CuPy fallback) reading them as stored.

Tolerances: the quantized rows decode exactly (an 8-bit integer times an f16 scale is exact in
fp32), so the kernels see the CPU's floats; outputs keep test_cuda_emu.py's tolerances (one fp16
rounding, fp32 accumulation order)."""

import cupy_standin
import numpy as np
import pytest
from cuda_emu import LAUNCHED, compiler, host

from localkv import kv_format
from localkv.backends import cpu as ops_numpy
from localkv.backends.cpu.quant import fallback

pytestmark = pytest.mark.skipif(
    compiler() is None, reason="no C++ compiler (g++, c++ or clang++; or set CXX): cannot emulate CUDA kernels"
)

F16 = dict(rtol=2**-10, atol=2e-5)  # as test_cuda_emu.py
FMT = kv_format.FORMATS
PAIRS = ["q8_0", "q4_0", "q8_0:q4_0"]  # the kernels' (cuda_kernels.KV_PAIRS); other pairs take the CuPy path
WRITES_RAN: set[str] = set()  # the write tests' cases that ran in this process


@pytest.fixture(scope="module", autouse=True)
def backend():
    with host.standin():
        yield


def _rows(rng, shape):
    """Float32 values [..., hd] at scales far apart per row, a block of zeros (scale 0) among them."""
    x = (rng.standard_normal(shape) * rng.uniform(0.05, 3, (*shape[:-1], 1))).astype(np.float32)
    x.reshape(-1, 32)[3] = 0
    return x


def _pools(rng, pair: str, n_ctx: int, kvh: int, hd: int, bs: int, extra: int = 5):
    """K and V pools [blocks, bs, kvh, row] in the pair's formats (every block filled), a
    shuffled block table for n_ctx tokens that skips `extra` blocks."""
    nb = -(-n_ctx // bs)
    table = rng.permutation(nb + extra)[:nb].astype(np.int32)
    k_fmt, v_fmt = kv_format.parse(pair)
    shape = (nb + extra, bs, kvh, hd)
    return kv_format.encode(_rows(rng, shape), k_fmt), kv_format.encode(_rows(rng, shape), v_fmt), table


def _check(q, k, v, table, n_ctx, scale, **split):
    """The kernel path against the CPU backend's attention on the same pools (it reads
    quantized rows too), lse against float64 over the decoded keys; returns the partitions."""
    mass_ref = np.zeros(n_ctx, np.float32)
    ref = ops_numpy.paged_attention(np.ascontiguousarray(q, np.float32), k, v, table, n_ctx, scale, mass_ref)
    mass = np.ones(n_ctx, np.float32)
    out, lse, parts = host.paged_attention(q, k, v, table, n_ctx, scale, mass, **split)
    np.testing.assert_allclose(out.astype(np.float32), ref, **F16)
    np.testing.assert_allclose(lse, _lse_ref(q, k, table, n_ctx, scale), rtol=0, atol=1e-4)
    np.testing.assert_allclose(mass - 1, mass_ref, rtol=1e-4, atol=1e-5)
    return parts


def _lse_ref(q, k, table, n_ctx, scale):
    """float64 log-sum-exp of the scores over the decoded keys of pool k, the query scaled and
    rounded as a quantized K multiplies it."""
    T, H, hd = q.shape
    kvh = k.shape[2]
    keys = kv_format.decode(k)[table].reshape(-1, kvh, hd)[:n_ctx].astype(np.float64)
    qs = np.asarray(q, np.float32) * np.float32(scale)
    if kv_format.of(k).quantized:
        qs = fallback.quantize_activations(qs)
    s = np.einsum("thd,nhd->thn", qs.astype(np.float64), np.repeat(keys, H // kvh, axis=1))
    s = np.where(np.arange(T)[:, None, None] + n_ctx - T < np.arange(n_ctx), -np.inf, s)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


# ---------------------------------------------------------------- writes (write_rows_*)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("pair", ["q8_0", "q4_0", "q8_0:q4_0", "f16:q8_0"])
def test_written_rows_are_the_cpu_encoders_bytes(pair, dtype):
    """K/V as the model hands them over (strided slices of qkv, fp16 or fp32), one padding slot:
    the pool's bytes afterwards equal the CPU backend's write_kv (kv_format.encode) byte for
    byte, ties of q8_0's rounding (halves away from zero) and a q4_0 block's largest magnitude
    (the first, sign kept) included; slots not written keep their bytes."""
    rng = np.random.default_rng(len(pair) + np.dtype(dtype).itemsize)
    nb, bs, T, H, kvh, hd = 5, 8, 11, 4, 2, 64
    qkv = _rows(rng, (T, H + 2 * kvh, hd))
    qkv[0, H, :32] = np.r_[127, np.arange(31) - 15.5]  # q8_0 scale 1: every .5 rounds away from zero
    qkv[1, H, :32] = np.r_[-3.0, 3.0, np.zeros(30)]  # q4_0: -3 comes first, so d = 3 / 8
    qkv = qkv.astype(dtype)
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    slots[4] = -1
    k_fmt, v_fmt = kv_format.parse(pair)
    shape = (nb, bs, kvh, hd)
    k_ref, v_ref = kv_format.encode(_rows(rng, shape), k_fmt), kv_format.encode(_rows(rng, shape), v_fmt)
    kg, vg = k_ref.copy(), v_ref.copy()
    keep = slots >= 0
    k, v = qkv[:, H : H + kvh], qkv[:, H + kvh :]
    ops_numpy.write_kv(k_ref, v_ref, slots[keep], k[keep].astype(np.float32), v[keep].astype(np.float32))
    host.write_kv(kg, vg, slots, k, v)
    np.testing.assert_array_equal(kg.view(np.uint8), k_ref.view(np.uint8))
    np.testing.assert_array_equal(vg.view(np.uint8), v_ref.view(np.uint8))
    WRITES_RAN.add(f"{pair}-{np.dtype(dtype).name}")


@pytest.mark.parametrize("pair", ["q8_0", "q4_0", "q8_0:q4_0"])
def test_copied_blocks_keep_their_bytes(pair):
    """copy_blocks on quantized pools: the first n tokens of each source block, bytes as they
    are, in every layer (one format: the fp16 kernel over pairs of bytes; a K:V pair: CuPy)."""
    rng = np.random.default_rng(3)
    k_fmt, v_fmt = kv_format.parse(pair)
    shape = (3, 10, 8, 2, 64)
    k, v = kv_format.encode(_rows(rng, shape), k_fmt), kv_format.encode(_rows(rng, shape), v_fmt)
    kg, vg = k.copy(), v.copy()
    src, dst = [1, 4, 6], [0, 9, 2]
    host.copy_blocks(kg, vg, src, dst, 5)
    k[:, dst, :5], v[:, dst, :5] = k[:, src, :5], v[:, src, :5]
    np.testing.assert_array_equal(kg, k)
    np.testing.assert_array_equal(vg, v)


# ---------------------------------------------------------------- attention over quantized rows


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("hd,H,kvh", [(64, 9, 3), (128, 8, 2)])
def test_decode_reads_quantized_rows(pair, hd, H, kvh):
    """One query token: a short context in one partition, and 300 tokens in partitions of 64."""
    rng = np.random.default_rng(hd + H + len(pair))
    for n_ctx, split, parts in ((37, {}, 1), (300, {"part": 64}, 5)):
        k, v, table = _pools(rng, pair, n_ctx, kvh, hd, 16)
        q = rng.standard_normal((1, H, hd)).astype(np.float16)
        assert _check(q, k, v, table, n_ctx, 1 / np.sqrt(hd), **split) == parts


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("n_ctx,T,hd,H,kvh,bs", [(73, 13, 64, 9, 3, 16), (100, 40, 128, 16, 2, 32)])
def test_prefill_reads_quantized_rows(pair, n_ctx, T, hd, H, kvh, bs):
    """A chunk after cached tokens, q a strided slice of qkv; the second shape stages more keys
    than one 32-key tile for several query blocks."""
    rng = np.random.default_rng(n_ctx + T + len(pair))
    k, v, table = _pools(rng, pair, n_ctx, kvh, hd, bs)
    qkv = rng.standard_normal((T, H + 2 * kvh, hd)).astype(np.float16)
    _check(qkv[:, :H], k, v, table, n_ctx, 1 / np.sqrt(hd))


@pytest.mark.parametrize("pair", ["q8_0", "q4_0"])
@pytest.mark.parametrize("hd", [32, 96, 256])
def test_other_head_dims_read_quantized_rows(pair, hd):
    """One q block a row (32), three (96), eight (256, 4 query heads a thread block)."""
    rng = np.random.default_rng(hd)
    for n_ctx, T in ((300, 1), (70, 12)):
        k, v, table = _pools(rng, pair, n_ctx, 1, hd, 16)
        q = rng.standard_normal((T, 8, hd)).astype(np.float16)
        _check(q, k, v, table, n_ctx, 0.1)


def test_batched_decode_reads_quantized_rows():
    """paged_decode as DecodeBatch calls it, sequences of different lengths in one q8_0:q4_0 pool."""
    rng = np.random.default_rng(9)
    bs, lens, kvh, H, hd = 16, [1, 17, 300, 77], 2, 8, 64
    k, v, _ = _pools(rng, "q8_0:q4_0", sum(lens) + 9 * bs, kvh, hd, bs, extra=0)
    perm = rng.permutation(k.shape[0]).astype(np.int32)
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    bt = np.zeros((len(lens), max(map(len, tables))), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    q = rng.standard_normal((len(lens), H, hd)).astype(np.float16)
    out, lse, parts = host.decode(q, k, v, bt, np.array(lens, np.int32), 0.1, max(lens), part=64)
    assert parts == 5
    for i, n in enumerate(lens):
        ref = ops_numpy.paged_attention(q[i : i + 1].astype(np.float32), k, v, tables[i], n, 0.1)
        np.testing.assert_allclose(out[i : i + 1].astype(np.float32), ref, **F16)


def test_the_fallback_decodes_quantized_rows_and_extra_keys():
    """Extra keys (h2o's heavy hitters: rows in the pool's format) take the CuPy fallback, which
    decodes the rows with kv_format: the CPU backend's result on the same rows."""
    rng = np.random.default_rng(12)
    kvh, hd, n_ctx = 2, 64, 40
    k, v, table = _pools(rng, "q8_0:q4_0", n_ctx, kvh, hd, 16)
    extra = (
        kv_format.encode(_rows(rng, (kvh, 6, hd)), FMT["q8_0"]),
        kv_format.encode(_rows(rng, (kvh, 6, hd)), FMT["q4_0"]),
    )
    q = rng.standard_normal((3, 8, hd)).astype(np.float16)
    ref = ops_numpy.paged_attention(q.astype(np.float32), k, v, table, n_ctx, 0.1, extra=extra)
    ca = host.backend("cuda_attention")
    d = [cupy_standin.asarray(a) for a in (q, k, v, table, *extra)]
    got = ca.paged_attention(*d[:4], n_ctx, 0.1, extra=tuple(d[4:])).get()
    np.testing.assert_allclose(got.astype(np.float32), ref, **F16)


@pytest.mark.parametrize("pair", ["f16:q8_0", "q4_0:q8_0"])
def test_a_pair_without_kernels_takes_the_cupy_path(pair):
    """paged_attention and paged_decode on a K:V pair the kernels are not built for: the CuPy
    fallback, the CPU backend's result on the same pools."""
    rng = np.random.default_rng(len(pair))
    k, v, table = _pools(rng, pair, 50, 2, 64, 16)
    q = rng.standard_normal((4, 8, 64)).astype(np.float16)
    ref = ops_numpy.paged_attention(q.astype(np.float32), k, v, table, 50, 0.1)
    ca = host.backend("cuda_attention")
    d = [cupy_standin.asarray(a) for a in (q, k, v, table)]
    np.testing.assert_allclose(ca.paged_attention(*d, 50, 0.1).get().astype(np.float32), ref, **F16)
    ref1 = ops_numpy.paged_attention(q[:1].astype(np.float32), k, v, table, 50, 0.1)
    tables, lens = cupy_standin.asarray(table[None]), cupy_standin.asarray(np.array([50], np.int32))
    got = ca.paged_decode(d[0][:1], d[1], d[2], tables, lens, 0.1).get()
    np.testing.assert_allclose(got.astype(np.float32), ref1, **F16)


def test_every_write_rows_kernel_is_launched_here():
    """The write_rows_* kernels cuda_kernels.KERNELS lists (test_cuda_emu.py's coverage check
    leaves them to this module); run after the write test above in the same process."""
    if len(WRITES_RAN) < 8:
        pytest.skip("the write tests ran elsewhere or not at all")
    listed = {k for k in host.constants().kernels["kv_cache.cu"] if k.startswith("write_rows_")}
    assert listed and {k for k in listed if not LAUNCHED[k]} == set()
