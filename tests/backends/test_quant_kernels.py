"""Weights kept in their GGUF encoding (localkv.backends.cpu.quant): every type's kernels against
gguf's own dequantizer + float64 numpy, for every row count the kernels split differently
(matmul_rows), embedding rows, the numpy-only path, and the real SmolLM2 tensors. That a row's
outputs are the same bits whatever shares its call: test_matmul_out.py, test_matmul_wide.py,
test_superblock_rows.py, test_numpy_one_answer.py.

Tolerances: the kernels quantize the activations to int8 per 32 values, per 256 for the
K-quants (as llama.cpp does: Q8_0, Q8_K), so they are compared with the same math in float64
(weights from gguf.quants.dequantize, activations rounded the same way), within float32
accumulation error: 2e-6 of the sum of |terms|. Against the unrounded activations the
difference must stay inside the rounding bound itself (half a step per activation).
Dequantization is bit-exact.
"""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from localkv import gguf_py
from localkv.backends.cpu import build, quant
from localkv.backends.cpu.quant import QTensor

BLOCK = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
FLOAT = ["F32", "F16", "BF16"]
# byte offsets of the fp16 scales in each block (ggml-common.h), set to finite values below
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
          "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # fmt: skip
ROWS = 37  # odd, and not a multiple of the kernels' 16-row work chunks
MODEL = Path(os.environ.get("LOCALKV_REAL_HOME", Path.home() / ".cache/localkv")) / "models"
MODEL = MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def kernels():
    # numba is a dependency: the kernels must load here, not skip
    assert build.load(quant.SUPPORTED), {t: quant.why_not(t) for t in quant.SUPPORTED}
    return quant


def cols_for(qtype: str) -> int:
    """An odd number of 32-value groups (5), or 3 super-blocks of 256 for the K-quants."""
    return 160 if qtype in BLOCK[:5] else (768 if qtype in BLOCK else 200)


def random_weight(qtype: str, rows: int, cols: int, seed: int, writeable: bool = False) -> QTensor:
    """Random bytes (every bit pattern) with finite fp16 scales; floats for F32/F16/BF16."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        data = {"F32": w, "F16": w.astype(np.float16), "BF16": (w.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
    else:
        values, nbytes = gguf.constants.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
        for o in HALVES[qtype]:
            scale = (rng.standard_normal((rows, cols // values)) * 0.02).astype(np.float16)
            blocks[:, :, o : o + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
        data = blocks.reshape(rows, -1)
    data.flags.writeable = writeable
    return QTensor(data, qtype, (rows, cols))


def reference(w: QTensor) -> np.ndarray:
    """The weight as float64, from gguf's dequantizer."""
    if w.qtype == "BF16":
        return (w.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return gguf.quants.dequantize(w.data, GGMLQuantizationType[w.qtype]).astype(np.float64)


def group(qtype: str) -> int:
    """The values per activation scale: 256 for the K-quants (llama.cpp's Q8_K), else 32."""
    return 256 if qtype.endswith("_K") else 32


def rounded(x: np.ndarray, qtype: str) -> np.ndarray:
    """The activations as the kernels see them: int8 steps of amax/127 per group(qtype) values."""
    R, K = x.shape
    xb = x.reshape(R, K // group(qtype), group(qtype))
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(xb * inv)
    assert np.abs(q).max() <= 127
    return (q * d).reshape(R, K).astype(np.float64)


def assert_few_matches(got, x, w_ref, qtype: str | None):
    """got = x @ w_ref.T, x rounded for weights of qtype (None: not rounded)."""
    quantized = qtype is not None
    xr = rounded(x, qtype) if quantized else x.astype(np.float64)
    want = xr @ w_ref.T
    bound = 2e-6 * (np.abs(xr) @ np.abs(w_ref).T) + 1e-30
    assert got.dtype == np.float32 and got.shape == want.shape
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    if quantized:  # the rounding itself: at most half a step per activation
        n = group(qtype)
        step = np.repeat(np.abs(x.reshape(len(x), -1, n)).max(-1) / 127, n, axis=1)
        assert (np.abs(got - x @ w_ref.T) <= 0.5 * step @ np.abs(w_ref).T * 1.001 + bound).all()


@pytest.mark.parametrize("qtype", BLOCK + FLOAT)
def test_matmul_rows_matches_gguf(kernels, qtype):
    """Row counts that take each kernel: a decode row, the lanes' blocks of 8 and their tails,
    blocks of 16 (the wide kernels where this CPU has them) and their tails."""
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=BLOCK.index(qtype) if qtype in BLOCK else 50)
    w_ref = reference(w)
    rng = np.random.default_rng(7)
    for rows in (*range(1, 10), 16, 17, 33):
        x = rng.standard_normal((rows, w.cols), dtype=np.float32)
        assert_few_matches(kernels.matmul_rows(x, w), x, w_ref, qtype if qtype in BLOCK else None)


@pytest.mark.parametrize("qtype", BLOCK[:5])
def test_matmul_rows_on_gguf_quantized_weights(kernels, qtype):
    rng = np.random.default_rng(11)
    dense = rng.standard_normal((ROWS, 256), dtype=np.float32)
    w = QTensor(gguf.quants.quantize(dense, GGMLQuantizationType[qtype]), qtype, (ROWS, 256))
    x = rng.standard_normal((3, 256), dtype=np.float32)
    assert_few_matches(kernels.matmul_rows(x, w), x, reference(w), qtype)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 17])
def test_several_weights_in_one_call(kernels, rows):
    """q, k, v side by side, including a run of two types (Q4_K_M's Q6_K attn_v)."""
    ws = [random_weight(t, n, 512, seed=i) for i, (t, n) in enumerate([("Q4_K", 33), ("Q4_K", 17), ("Q6_K", 17)])]
    x = np.random.default_rng(rows).standard_normal((rows, 512), dtype=np.float32)
    got = kernels.matmul_rows(x, quant.QStack(tuple(ws)))
    np.testing.assert_array_equal(got, np.concatenate([kernels.matmul_rows(x, w) for w in ws], axis=1))
    assert_few_matches(got, x, np.concatenate([reference(w) for w in ws]), "Q4_K")


@pytest.mark.parametrize("qtype", BLOCK + FLOAT)
def test_dequantize_rows_and_get_rows_are_exact(kernels, qtype):
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=3)
    w_ref = reference(w).astype(np.float32)
    np.testing.assert_array_equal(kernels.dequantize_rows(w, 0, ROWS), w_ref)
    out = np.full((10, w.cols), np.nan, np.float32)
    assert kernels.dequantize_rows(w, 5, 15, out) is out
    np.testing.assert_array_equal(out, w_ref[5:15])
    ids = [36, 0, 5, 5, 17]
    np.testing.assert_array_equal(kernels.get_rows(w, ids), w_ref[ids])
    assert kernels.get_rows(w, []).shape == (0, w.cols)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q2_K", "Q5_K", "F16"])
def test_numpy_path_gives_the_same_results(kernels, qtype, monkeypatch):
    """What LOCALKV_CPU_KERNELS=0 or a missing numba runs: gguf's dequantizer and BLAS."""
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=6)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((r, w.cols), dtype=np.float32) for r in (1, 3, 8, 20)]
    with_kernels = [kernels.matmul_rows(x, w) for x in xs], kernels.get_rows(w, [3, 1])
    monkeypatch.setattr(quant, "active", lambda qtype: False)
    calls = []
    reference_dequantize = gguf_py.dequantize
    monkeypatch.setattr(gguf_py, "dequantize", lambda *a: calls.append(1) or reference_dequantize(*a))
    without = [kernels.matmul_rows(x, w) for x in xs], kernels.get_rows(w, [3, 1])
    assert len(calls) >= 5 or qtype in FLOAT  # gguf's dequantizer did the work
    for x, a, b in zip(xs, with_kernels[0], without[0]):
        xr = rounded(x, qtype) if qtype in BLOCK else x
        bound = 2e-6 * (np.abs(xr) @ np.abs(reference(w)).T) + 1e-30
        assert (np.abs(a - b) <= 2 * bound).all()
    np.testing.assert_array_equal(with_kernels[1], without[1])


def test_off_switch_turns_the_kernels_off():
    code = (
        "import numpy as np; from localkv.backends.cpu import build, quant;"
        "w = quant.QTensor(np.zeros((2, 20), np.uint8), 'Q4_1', (2, 32));"
        "print(build.load(['Q4_1']), quant.why_not('Q4_1'), quant.matmul_rows(np.ones((1, 32), np.float32), w))"
    )
    env = dict(os.environ, LOCALKV_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("False LOCALKV_CPU_KERNELS=0 [[0. 0.]]")


def test_weights_are_read_only_and_checked():
    data = np.zeros((3, 40), np.uint8)
    w = QTensor(data, "Q4_1", (3, 64))
    assert not w.data.flags.writeable and data.flags.writeable  # a read-only view, the caller's array untouched
    with pytest.raises(ValueError, match="needs C-contiguous uint8 data of shape"):
        QTensor(np.zeros((3, 41), np.uint8), "Q4_1", (3, 64))
    with pytest.raises(ValueError, match="not whole blocks"):
        QTensor(data, "Q4_K", (3, 64))
    with pytest.raises(ValueError, match="IQ4_NL is not supported"):
        QTensor(data, "IQ4_NL", (3, 64))
    with pytest.raises(ValueError, match="row ids"):
        quant.get_rows(w, [3])


@pytest.mark.model
@pytest.mark.skipif(not MODEL.exists(), reason="SmolLM2-135M Q4_1 not downloaded")
def test_real_smollm2_layer_and_embedding(kernels):
    reader = gguf.GGUFReader(MODEL)
    tensors = {t.name: t for t in reader.tensors}
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    ws = {n: quant.from_gguf(tensors[f"blk.7.{n}.weight"]) for n in names}
    assert all(w.qtype == "Q4_1" and not w.data.flags.writeable for w in ws.values())
    rng = np.random.default_rng(0)
    for rows in (1, 8):
        x = rng.standard_normal((rows, 576), dtype=np.float32)
        qkv = np.concatenate([reference(ws[n]) for n in names[:3]])
        qkv_stack = quant.QStack((ws["attn_q"], ws["attn_k"], ws["attn_v"]))
        assert_few_matches(kernels.matmul_rows(x, qkv_stack), x, qkv, "Q4_1")
        x2 = rng.standard_normal((rows, 1536), dtype=np.float32)
        assert_few_matches(kernels.matmul_rows(x2, ws["ffn_down"]), x2, reference(ws["ffn_down"]), "Q4_1")
    emb = quant.from_gguf(tensors["token_embd.weight"])
    assert emb.qtype == "Q8_0" and emb.shape == (49152, 576)
    ids = [0, 1, 49151, 1234]
    np.testing.assert_array_equal(kernels.get_rows(emb, ids), reference(emb)[ids].astype(np.float32))
    x = rng.standard_normal((2, 576), dtype=np.float32)
    logits = kernels.matmul_rows(x, emb)  # tied output: x @ token_embd.T
    np.testing.assert_allclose(logits, rounded(x, "Q8_0") @ reference(emb).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])  # the K-quants' super-block kernel too
@pytest.mark.parametrize("numpy_path", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_nan_and_inf_activations_give_nan_outputs(kernels, rows, numpy_path, qtype, monkeypatch):
    if numpy_path:
        monkeypatch.setattr(quant, "active", lambda qtype: False)
    w = random_weight(qtype, ROWS, cols_for(qtype), seed=8)
    x = np.ones((rows, w.cols), np.float32)
    x[0, 3], x[-1, 100] = np.nan, np.inf
    got = kernels.matmul_rows(x, w)
    assert np.isnan(got[0]).all() and np.isnan(got[-1]).all()
    if rows > 2:
        assert np.isfinite(got[1]).all()
