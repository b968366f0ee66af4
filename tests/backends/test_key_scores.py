"""A quantized K's scores in integer form (kernels/key_scores.py) against a float64 reference
of the rule they promise, bit for bit: the query rows rounded per 32 values (d = amax / 127,
q = rint(x * (1 / d))), each key block's dot with them an exact integer, and

    s = 0; for each block b in order: s = fma(float(dot_b), dq_b * dk_b, s)

in float32, for rows in 8 or 16 lanes (scores_at) and for 16 keys in the lanes (scores_keys);
a block of zeros and one holding nan take the rule's values."""

import math

import numba
import numpy as np
import pytest

from localkv import kv_format
from localkv.backends.cpu import build
from localkv.backends.cpu.kernels.attention import KEYS
from localkv.backends.cpu.kernels.key_scores import ROWS, lanes_of, query_lanes, scores_at, scores_keys
from localkv.backends.cpu.quant import fallback

pytestmark = pytest.mark.skipif(not build.load(), reason="no numba kernels")

HD, QK = 64, kv_format.QK
NB = HD // QK
RNG = np.random.default_rng(5)


@numba.njit(cache=False)
def _at(pool, offs, gq, R):
    hd = gq.shape[0]
    nb = hd // 32
    xi, dq, qs = np.zeros(R * hd, np.int8), np.zeros(R * nb, np.float32), np.zeros(R * nb, np.int32)
    query_lanes(gq, R, lanes_of(R), xi, dq, qs, np.empty(hd, np.float32), np.empty(32, np.int8))
    st = np.zeros(KEYS * R, np.float32)
    scores_at(pool, offs, len(offs), xi, dq, qs, st, R, hd)
    return st.reshape(KEYS, R)[: len(offs)].T.copy()


@numba.njit(cache=False)
def _keys(pool, offs, n, gq):
    hd = gq.shape[0]
    nb = hd // 32
    xi, dq, qs = np.zeros(ROWS * hd, np.int8), np.zeros(ROWS * nb, np.float32), np.zeros(ROWS * nb, np.int32)
    query_lanes(gq, ROWS, 1, xi, dq, qs, np.empty(hd, np.float32), np.empty(32, np.int8))
    st = np.zeros(ROWS * len(offs), np.float32)
    scores_keys(pool, offs, n, xi, dq, qs, st, hd)
    return st.reshape(ROWS, len(offs))[:, :n].copy()


def _fma32(a: float, b: float, c: float) -> np.float32:
    """float32(a * b + c) rounded once: a * b is exact in float64 (two 24-bit significands);
    the sum is rounded to odd in float64 (TwoSum's error decides), then to float32, which is
    then the correctly rounded result (53 >= 24 + 2 bits)."""
    p = a * b
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))
    if err != 0 and math.isfinite(s) and (np.float64(s).view(np.int64) & 1) == 0:
        s = math.nextafter(s, math.inf if err > 0 else -math.inf)
    return np.float32(s)


def rounded(gq):
    """The rule's codes [R, blocks, 32] and scales [R, blocks] of the rows gq [hd, R]."""
    x = np.ascontiguousarray(gq.T).reshape(gq.shape[1], NB, QK)
    amax = np.abs(x).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        cq = np.rint(x * inv[..., None])
    bad = ~np.isfinite(amax)
    cq[bad], d[bad] = 0, np.nan
    return cq, d


def reference(pool, offs, gq):
    """The scores [R, keys] of the pool rows offs (flat row indices) for the rows gq [hd, R]."""
    cq, d = rounded(gq)
    rows = pool.reshape(-1, pool.shape[-1])[offs]
    blocks = rows.view(np.uint8).reshape(len(offs), NB, -1)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if pool.dtype == np.int8:  # q8_0: 32 int8 codes
        ck = blocks[..., 2:].view(np.int8)
    else:  # q4_0: values 0-15 in the low nibbles, 16-31 in the high, each nibble - 8
        ck = np.concatenate((blocks[..., 2:] & 15, blocks[..., 2:] >> 4), axis=-1).astype(np.int64) - 8
    out = np.empty((gq.shape[1], len(offs)), np.float32)
    for r in range(gq.shape[1]):
        for t in range(len(offs)):
            s = np.float32(0)
            for b in range(NB):
                dot = int(np.dot(cq[r, b].astype(np.int64), ck[t, b].astype(np.int64)))
                s = _fma32(float(dot), float(np.float32(d[r, b]) * scale[t, b]), float(s))
            out[r, t] = s
    return out


def _pool(fmt: str):
    x = RNG.standard_normal((6, 16, 2, HD)).astype(np.float32) * RNG.uniform(0.1, 4, (6, 16, 2, 1))
    x.reshape(-1, QK)[7] = 0  # a key block of zeros (scale 0)
    return kv_format.encode(x.astype(np.float32), kv_format.FORMATS[fmt])


def _queries(R: int) -> np.ndarray:
    gq = (RNG.standard_normal((HD, R)) * RNG.uniform(0.05, 3, R)).astype(np.float32)
    gq[:QK, 1] = 0  # a query block of zeros: d 0, codes 0
    gq[QK + 3, 2] = np.nan  # a block holding nan: its row's scores nan
    return gq


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("R", [8, 16])
def test_rows_in_the_lanes_give_the_rule_bits(fmt, R):
    pool = _pool(fmt)
    offs = RNG.choice(pool.shape[0] * 16 * 2, 50, replace=False).astype(np.int64)
    gq = _queries(R)
    got, want = _at(pool, offs, gq, R), reference(pool, offs, gq)
    assert np.isnan(got[2]).all() and np.isnan(want[2]).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_keys_in_the_lanes_give_the_rule_bits(fmt):
    pool = _pool(fmt)
    offs = np.zeros(KEYS, np.int64)
    offs[:37] = RNG.choice(pool.shape[0] * 16 * 2, 37, replace=False)
    gq = _queries(4)
    got, want = _keys(pool, offs, 37, gq), reference(pool, offs[:37], gq)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, _at(pool, offs[:37], np.pad(gq, ((0, 0), (0, 4))), 8)[:4])


def test_the_float_paths_round_the_query_by_the_same_rule():
    """fallback.quantize_activations (numpy's and CuPy's paths) gives q * d of the codes and scales the
    kernels multiply: nan for a block holding nan, 0 for one of zeros."""
    gq = _queries(8)
    cq, d = rounded(gq)
    got = fallback.quantize_activations(np.ascontiguousarray(gq.T))
    np.testing.assert_array_equal(got, (cq * d[..., None]).reshape(8, HD))
    assert (got[1, :QK] == 0).all() and np.isnan(got[2, QK:]).all() and not np.isnan(got[2, :QK]).any()
