"""Quantized weights on the GPU (localkv/backends/cuda_quant.py, cuda/quant_matvec.cu) against
gguf's own dequantizer (test_quant_kernels.reference) in float64: on a GPU when CuPy sees one,
else on the CPU (the host code through the CuPy stand-in, the kernels on the CUDA emulator, which
also counts their launches).

Tolerances: the kernels decode each weight in fp32 (d * q exact for every format, + m or - dmin *
mn rounded once) and sum in fp32 in their own order, so an fp32 output is within 4e-6 of the sum of
|terms| of the float64 reference; an fp16 output is that rounded once more (2^-11 relative). A
dequantized fp16 value is the reference rounded to fp16 (1 ulp for values that land on a tie)."""

import numpy as np
import pytest
from cuda_emu import LAUNCHED
from test_quant_kernels import BLOCK, random_weight, reference

from localkv.backends.cpu.quant import QStack, QTensor

ROWS = 37  # not a multiple of the matvec kernels' rows per thread block
ULP16 = 2.0**-10  # an fp16 step, relative


@pytest.fixture(scope="module")
def emulated(cuda_device):
    return cuda_device[1]


@pytest.fixture(scope="module")
def cq(cp):
    from localkv.backends import cuda_quant

    return cuda_quant


@pytest.fixture(scope="module")
def backend(cp):
    from localkv.backends import cuda

    return cuda


def cols_for(qtype: str) -> int:
    """5 groups of 32 (lanes of a row get 2 or 1 of them), or 3 super-blocks of 256."""
    return 160 if qtype in BLOCK[:5] else 768


def _check_product(got, x, w_ref, out_dtype, slack=0.0):
    """got [R, N] against x [R, K] @ w_ref.T in float64 (see the module docstring), plus slack."""
    xf = x.astype(np.float64)
    ref = xf @ w_ref.T
    bound = 4e-6 * (np.abs(xf) @ np.abs(w_ref).T) + slack
    if out_dtype == np.float16:
        bound = bound + ULP16 * np.abs(ref)
    got = np.asarray(got, np.float64)
    bad = np.abs(got - ref) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, worst {np.abs(got - ref)[bad].max():.3g}"


@pytest.mark.parametrize("R", [1, 3, 8])
@pytest.mark.parametrize("qtype", BLOCK)
def test_matvec_matches_gguf(cp, cq, emulated, qtype, R):
    """Decode-step rows (1-8) through quant_matvec_<type>, fp16 and fp32 outputs."""
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=R)
    dw = cq.upload(w)
    assert isinstance(dw, cq.DeviceQ) and dw.blocks.dtype == np.uint8
    x = np.random.default_rng(R).standard_normal((R, w.cols)).astype(np.float16)
    before = LAUNCHED[f"quant_matvec_{qtype.lower()}"]
    for out_dtype in (np.float16, np.float32):
        got = cq.matmul(cp.asarray(x), dw, out_dtype)
        assert got.dtype == out_dtype and got.shape == (R, ROWS)
        _check_product(got.get(), x, reference(w), out_dtype)
    assert LAUNCHED[f"quant_matvec_{qtype.lower()}"] == before + 2 * emulated


@pytest.mark.parametrize("qtype", BLOCK)
def test_dequantize_rows_matches_gguf(cp, cq, qtype):
    """dequant_f16_<type>: any rows, in any order (embedding lookups), repeated ids."""
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=7)
    ids = np.array([36, 0, 5, 5, 17], np.int32)
    got = cq.rows(cq.upload(w), cp.asarray(ids)).get()
    ref = reference(w)[ids]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float16).astype(np.float64), rtol=ULP16, atol=0)
    with pytest.raises(ValueError, match="token ids"):
        cq.rows(cq.upload(w), cp.asarray(np.array([ROWS], np.int32)))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_many_rows_go_through_fp16_tiles(cp, cq, emulated, monkeypatch, qtype):
    """More than 8 rows (prefill): tiles of W dequantized to fp16, multiplied by cuBLAS (the
    stand-in: fp32 accumulation, one fp16 rounding); small tiles force several per weight."""
    monkeypatch.setattr(cq, "TILE_VALUES", cols_for(qtype) * 10)
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=11)
    x = np.random.default_rng(12).standard_normal((20, w.cols)).astype(np.float16)
    before = LAUNCHED[f"dequant_f16_{qtype.lower()}"]
    got = cq.matmul(cp.asarray(x), cq.upload(w)).get()
    assert LAUNCHED[f"dequant_f16_{qtype.lower()}"] == before + 4 * emulated  # 37 rows in tiles of 10
    w16 = reference(w).astype(np.float16).astype(np.float64)  # the tile's one rounding
    # a GPU's dequantizer may land a value 1 fp16 step from w16 (a tie rounded through fp32)
    tie = ULP16 * (np.abs(x.astype(np.float64)) @ np.abs(w16).T)
    _check_product(got, x, w16, np.float16, slack=tie)


def test_stacks_fuse_runs_of_one_type(cp, cq):
    """QStack (q, k, v): weights of one type become one device matrix, rows stacked; a type
    change starts a new part, each written into its own columns of one output."""
    q, k = random_weight("Q4_K", 64, 768, 1), random_weight("Q4_K", 32, 768, 2)
    v, f = random_weight("Q6_K", 32, 768, 3), random_weight("F16", 16, 768, 4)
    same = cq.upload(QStack((q, k)))
    assert isinstance(same, cq.DeviceQ) and same.shape == (96, 768)
    mixed = cq.upload(QStack((q, k, v, f)))
    assert isinstance(mixed, cq.DeviceStack) and mixed.shape == (144, 768)
    assert [type(p).__name__ for p in mixed.parts] == ["DeviceQ", "DeviceQ", "ndarray"]
    assert mixed.parts[2].dtype == np.float16
    ref = np.concatenate([reference(t) for t in (q, k, v, f)])
    ref16 = ref.astype(np.float16).astype(np.float64)  # the fp16 part, and every part's tiles past 8 rows
    for R in (2, 12):
        x = np.random.default_rng(R).standard_normal((R, 768)).astype(np.float16)
        got = cq.matmul(cp.asarray(x), mixed).get()
        _check_product(got[:, :128], x, ref[:128] if R <= 8 else ref16[:128], np.float16)
        _check_product(got[:, 128:], x, ref16[128:], np.float16)


def test_prepare_weights_takes_arrays_and_quantized_weights(cp, cq, backend):
    """The loader's fp32 arrays (fp16 matrices, fp32 norms) and QTensor/QStack, in one dict."""
    norm = np.ones(768, np.float32)
    dense = np.random.default_rng(0).standard_normal((8, 768)).astype(np.float32)
    w = backend.upload_weights(
        {"n": norm, "d": dense, "q": random_weight("Q8_0", 8, 768, 1), "s": QStack((random_weight("Q5_K", 8, 768, 2),))}
    )
    assert w["n"].dtype == np.float32 and w["d"].dtype == np.float16
    assert isinstance(w["q"], cq.DeviceQ) and isinstance(w["s"], cq.DeviceQ) and w["s"].qtype == "Q5_K"
    x = cp.asarray(np.ones((1, 768), np.float16))
    assert backend.linear(x, w["q"], "wo").shape == (1, 8)
    want = dense.astype(np.float16).astype(np.float64).sum(1)[None]  # fp16 weights, fp32 sums
    np.testing.assert_allclose(backend.linear(x, w["d"], "wo").get(), want, rtol=ULP16, atol=1e-3)
    np.testing.assert_array_equal(backend.embed(w["q"], np.array([3])).get(), cq.rows(w["q"], [3]).get())
    logits = backend.logits(x, w["q"])
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, 8)


def test_float_weights_go_to_the_device_as_fp16(cp, cq):
    for qtype in ("F32", "F16", "BF16"):
        w = random_weight(qtype, 5, 64, 3)
        d = cq.upload(w)
        assert d.dtype == np.float16 and d.shape == (5, 64)
        np.testing.assert_array_equal(d.get(), reference(w).astype(np.float16))


def test_activations_must_match_the_weight(cp, cq):
    dw = cq.upload(random_weight("Q4_0", 8, 64, 0))
    with pytest.raises(ValueError, match="64 columns"):
        cq.matmul(cp.asarray(np.ones((1, 32), np.float16)), dw)
    assert isinstance(random_weight("Q4_0", 8, 64, 0), QTensor)


def test_every_quant_kernel_is_launched_here():
    """quant_matvec.cu's kernels in cuda_kernels.KERNELS against the types tested above."""
    from cuda_emu import host

    listed = set(host.constants().kernels["quant_matvec.cu"])
    assert listed == {f"{k}_{t.lower()}" for k in ("quant_matvec", "dequant_f16") for t in BLOCK}
