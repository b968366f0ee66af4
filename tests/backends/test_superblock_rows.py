"""Q4_K and Q6_K under the one-answer rule (kernels/superblock.matmul_rows): a row's outputs are
the same bits alone, in the 4-row blocks, in their remainder and across TILE boundaries, at any
place in a pass, nan where its activations hold inf; and close to float64 math on the same
int8-rounded activations."""

import numpy as np
import pytest

from localkv.backends.cpu import build, quant
from localkv.backends.cpu.quant import fallback
from localkv.backends.cpu.quant.tensor import QStack, sample_weight

TYPES = ("Q4_K", "Q6_K")


@pytest.fixture(scope="module")
def kernels():
    assert build.load(TYPES), {t: quant.why_not(t) for t in TYPES}


def weights(qtype: str) -> QStack:
    """Two matrices (37 rows: two work chunks and a tail; 5 rows) of 3 super-blocks."""
    return QStack(tuple(sample_weight(qtype, rows, 768, seed) for rows, seed in ((37, 1), (5, 2))))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("positive", [False, True])
def test_a_row_gets_its_bits_alone_and_in_any_pass(kernels, qtype, positive):
    w = weights(qtype)
    rng = np.random.default_rng(11)
    # positive activations: large integer sums whose float steps round, so that another order of
    # the float work would show
    x = rng.uniform(0.5, 1, (70, w.cols)) if positive else rng.standard_normal((70, w.cols))
    x = (x * rng.uniform(0.1, 10, (70, 1))).astype(np.float32)
    x[5, 300] = np.inf  # its super-block: nan
    alone = np.concatenate([quant.matmul_rows(x[r : r + 1], w) for r in range(len(x))])
    assert np.isnan(alone[5]).all() and not np.isnan(np.delete(alone, 5, 0)).any()
    for r0, r1 in ((0, 70), (3, 10), (1, 34), (31, 36), (68, 70)):
        assert np.array_equal(quant.matmul_rows(x[r0:r1], w), alone[r0:r1], equal_nan=True), (r0, r1)
    dense = np.concatenate([fallback.dequantize_rows(t.data, qtype, 0, t.rows, np.empty(t.shape, np.float32))
                            for t in w.tensors])  # fmt: skip
    want = fallback.quantize_activations(x, 256).astype(np.float64) @ dense.T.astype(np.float64)
    ok = ~np.isnan(alone[:, 0])
    np.testing.assert_allclose(alone[ok], want[ok], rtol=1e-4, atol=1e-4 * np.abs(want[ok]).max())
