"""Prefill matmuls on AMX tiles (localkv.backends.cpu.kernels.amx): the activation layout the tiles
read, each product against float64 within the bf16 bound (2^-8 of the sum of |terms|: both
factors rounded to bf16), every block type decoded inside the kernel against gguf's
dequantizer, the path matmul_many takes, and the switch. Tests that run tile instructions skip
on a CPU without AMX-BF16; the layout and the switches are checked everywhere."""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from test_quant_kernels import BLOCK, ROWS, cols_for, random_weight, reference, rounded

from localkv.backends.cpu import build, quant


@pytest.fixture(scope="module")
def kernels():
    assert build.load(quant.SUPPORTED), {t: quant.why_not(t) for t in quant.SUPPORTED}
    return quant


@pytest.fixture(scope="module")
def amx(kernels):
    """The kernels, where this CPU and Linux allow AMX (they must then have passed their check)."""
    from localkv.backends.cpu.kernels import amx as _amx

    if _amx.enable() is not None:
        pytest.skip(f"no AMX here: {_amx.enable()}")
    assert quant.why_no_amx() is None, quant.why_no_amx()
    return _amx


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (ties to even), as uint16."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_packed_activations_are_tiles_of_bf16_pairs(kernels):
    """Per 16 tokens and 32 inputs, a 1 KiB tile holding input pair r of token j at 32r + 2j;
    tokens past the end are zero. Both orders of x (prefill passes give either)."""
    from localkv.backends.cpu.kernels import amx as _amx

    x = np.random.default_rng(1).standard_normal((37, 96), dtype=np.float32)
    want = np.zeros((64, 96), np.uint16)  # 37 tokens -> 2 pairs of 16-token tiles
    want[:37] = bf16(x)
    want = want.reshape(4, 16, 3, 16, 2).transpose(0, 2, 3, 1, 4).reshape(-1)  # tile, pair, token, half
    for xs in (x, np.asfortranarray(x)):
        np.testing.assert_array_equal(_amx.packed(xs), want)


def test_bf16_rounding_is_to_nearest_even(kernels):
    from localkv.backends.cpu.kernels import amx as _amx

    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -(1 + 2**-7 + 2**-8)] + [0.0] * 28], np.float32)
    got = _amx.packed(x)[[0, 1, 32, 33]]
    np.testing.assert_array_equal(got, [0x3F80, 0x3F82, 0x3F80, 0xBF82])  # ties down, up; below half; negative


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="AMX is x86-64 Linux's")
def test_switch_and_cpu_without_amx(kernels, monkeypatch):
    from localkv.backends.cpu.kernels import amx as _amx

    monkeypatch.setenv("LOCALKV_AMX", "0")
    assert _amx.enable() == "LOCALKV_AMX=0"
    monkeypatch.delenv("LOCALKV_AMX")
    import llvmlite.binding as llvm

    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"avx512f": True})
    assert _amx.enable() == "the CPU has no AMX-BF16"


@pytest.mark.parametrize("tokens", [1, 16, 37, 64])
@pytest.mark.parametrize("rows", [1, 33, 128 + 45])
def test_gemm_within_the_bf16_bound(amx, tokens, rows):
    """Edges in both directions (a partial 32 x 32 block, a second work item)."""
    w = random_weight("Q8_0", rows, 96, seed=tokens * rows)
    dense = reference(w)
    x = np.random.default_rng(tokens * rows).standard_normal((tokens, 96), dtype=np.float32)
    out_t = np.full((rows, tokens), np.nan, np.float32)
    amx.multiply("Q8_0", w.data, w.cols, amx.packed(x), out_t)
    want = x.astype(np.float64) @ dense.T
    assert (np.abs(out_t.T - want) <= amx.bound(x, dense)).all()
    assert np.abs(out_t.T - want).max() > 0  # bf16, not float32: the bound is not loose by design


@pytest.mark.parametrize("qtype", BLOCK)
def test_each_block_type_within_the_bf16_bound(amx, qtype):
    """Every block type decoded inside the work items, against gguf's dequantizer in float64."""
    w = random_weight(qtype, ROWS + 128, cols_for(qtype), seed=11)
    x = rounded(np.random.default_rng(11).standard_normal((21, w.cols), dtype=np.float32), qtype)
    got = np.empty((w.rows, 21), np.float32)
    amx.multiply(qtype, w.data, w.cols, amx.packed(x.astype(np.float32)), got)
    assert (np.abs(got.T - x @ reference(w).T) <= amx.bound(x, reference(w))).all()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_matmul_many_runs_on_amx(amx, qtype, monkeypatch):
    """matmul_many takes the AMX path for block types (never BLAS), with the activations
    rounded to int8 steps first, as decode does."""
    monkeypatch.setattr(quant.fallback, "matmul_t", lambda *a: pytest.fail("BLAS path taken"))
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=5)
    x = np.random.default_rng(5).standard_normal((41, w.cols), dtype=np.float32)
    got = quant.matmul_many(x, w)
    assert got.shape == (41, ROWS) and got.dtype == np.float32
    xr = rounded(x, qtype)
    assert (np.abs(got - xr @ reference(w).T) <= amx.bound(xr, reference(w))).all()


def test_float_weights_stay_on_blas(amx):
    """F16 activations are not rounded to int8, and bf16 would be coarser than llama.cpp's f16."""
    assert not any(quant.on_amx(t) for t in ("F32", "F16", "BF16"))
    w = random_weight("F16", ROWS, 224, seed=5)
    x = np.random.default_rng(5).standard_normal((41, w.cols), dtype=np.float32)
    np.testing.assert_allclose(quant.matmul_many(x, w), x @ reference(w).T, rtol=1e-4, atol=1e-4)


def test_prefill_and_decode_agree_to_bf16(amx):
    w = random_weight("Q4_K", ROWS, 512, seed=9)
    x = np.random.default_rng(9).standard_normal((12, 512), dtype=np.float32)
    few = np.concatenate([quant.matmul_few(x[:8], w), quant.matmul_few(x[8:], w)])
    xr = rounded(x, "Q4_K")
    assert (np.abs(few - quant.matmul_many(x, w)) <= amx.bound(xr, reference(w))).all()


def test_switch_keeps_blas(amx):
    """LOCALKV_AMX=0: matmul_many on BLAS, the same numbers the BLAS path gives here."""
    code = """if True:
        import numpy as np
        from localkv.backends.cpu import build, quant
        build.load(["Q4_K"])
        w = quant.QTensor(np.random.default_rng(0).integers(0, 64, (40, 144), dtype=np.uint8), "Q4_K", (40, 256))
        x = np.random.default_rng(1).standard_normal((20, 256), dtype=np.float32)
        print(quant.why_no_amx()); np.save(__import__("sys").argv[1], quant.matmul_many(x, w))
    """
    outs = []
    for switch in ("0", "1"):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"amx_switch_{os.getpid()}_{switch}.npy")
        env = dict(os.environ, LOCALKV_AMX=switch)
        res = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        outs.append((res.stdout.strip().splitlines()[-1], np.load(path)))
        os.unlink(path)
    (why_off, off), (why_on, on) = outs
    assert why_off == "LOCALKV_AMX=0" and why_on == "None"
    assert not np.array_equal(off, on)  # two paths, each within its bound of the same product
    np.testing.assert_allclose(off, on, rtol=0.02, atol=0.02 * np.abs(off).max())
