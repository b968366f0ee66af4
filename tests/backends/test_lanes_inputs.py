"""kernels/matmul_few.lanes_inputs: activation rows quantized as _quantize does, laid out in
the lanes of the 8- and 16-row kernels, on the calling thread for one block and over the
threads for more: the same bytes as quantizing first and interleaving after."""

import numpy as np
import pytest
from numba import njit

from localkv.backends.cpu.formats.types import activation_group
from localkv.backends.cpu.kernels import matmul_few
from localkv.backends.cpu.quant import compiled


@njit
def _quantize(x, xq, dx, xs16, gs):
    matmul_few._quantize(x, xq, dx, xs16, gs)


def _reference(x: np.ndarray, L: int, gs: int):
    """_quantize's values, then each block of L rows interleaved: xi [g][dword][row][4 bytes]."""
    R, K = x.shape
    xq, dx, xs16 = np.empty((R, K), np.int8), np.empty((R, K // 32), np.float32), np.empty((R, K // 16), np.float32)
    _quantize(x, xq, dx, xs16, gs)
    nb, ng = -(-R // L), K // 32
    xi = np.zeros((nb, ng, 8, L, 4), np.int8)
    dxv, xsa, xsb = (np.zeros((nb, ng, L), np.float32) for _ in range(3))
    for r in range(R):
        b, lane = divmod(r, L)
        xi[b, :, :, lane] = xq[r].reshape(ng, 8, 4)
        dxv[b, :, lane], xsa[b, :, lane], xsb[b, :, lane] = dx[r], xs16[r, 0::2], xs16[r, 1::2]
    return xi.reshape(nb, -1), dxv.reshape(nb, -1), xsa.reshape(nb, -1), xsb.reshape(nb, -1)


def _numpy_quantize(x: np.ndarray, gs: int):
    """The rule in numpy, value by value: per gs values d = amax / 127 (float32), q = rint(x *
    (1 / d)); q = 0 and d = nan for a group holding inf or nan; xs16 = d * each 16 q's sum,
    or for groups of 32 d * the group's sum then a zero (the offsets' one sum per group)."""
    R, K = x.shape
    g = x.reshape(R, K // gs, gs)
    amax = np.abs(g).max(axis=2, keepdims=True)
    bad = ~np.isfinite(g).all(axis=2, keepdims=True)
    d = np.where(bad, np.float32(np.nan), amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(bad | (amax == 0), np.float32(0), np.float32(1) / d).astype(np.float32)
        q = np.where(inv > 0, np.rint(g * inv), 0).astype(np.int8).reshape(R, K)
    dx = np.repeat(d.reshape(R, -1), gs // 32, axis=1)
    sums = q.reshape(R, -1, 16).sum(axis=2, dtype=np.int32)
    if gs == 32:
        sums = np.stack([sums[:, 0::2] + sums[:, 1::2], np.zeros_like(sums[:, 1::2])], axis=2).reshape(R, -1)
    xs16 = np.repeat(d.reshape(R, -1), gs // 16, axis=1) * sums.astype(np.float32)
    if gs == 32:
        xs16[:, 1::2] = 0  # not d * 0: a nan d leaves the unread slot zero
    return q, dx, xs16


def _rows(seed: int, R: int, K: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((R, K)) * rng.uniform(0.01, 100, (R, 1))).astype(np.float32)
    x[0, 256:288] = 0  # a group of zeros
    if R > 2:
        x[2, 40] = np.inf  # a group holding inf: its q are 0 and its d nan
        x[1, 300] = np.nan
    return x


@pytest.mark.parametrize("gs", [32, 256])
def test_quantize_is_the_rule_value_by_value(gs):
    x = _rows(gs, 5, 512)
    x[3, :32] = [127] + [0.5, 1.5, 2.5, -0.5, -2.5, -3.5] * 5 + [1]  # d = 1: each x / d a tie, to even
    got = [np.empty((5, 512), np.int8), np.empty((5, 16), np.float32), np.empty((5, 32), np.float32)]
    _quantize(x, *got, gs)
    for g, w in zip(got, _numpy_quantize(x, gs)):
        assert np.array_equal(g, w, equal_nan=True)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
def test_lanes_inputs_are_the_quantized_rows_interleaved(qtype, lanes, rows):
    x = _rows(rows * lanes, rows, 512)
    gs = activation_group(qtype)
    got = matmul_few.lanes_inputs(compiled._GROUP_MARKERS[gs], x, lanes)
    want = _reference(x, lanes, gs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype != np.int8)
