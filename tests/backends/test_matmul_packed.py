"""Q4_0, Q4_1 and Q8_0 on their packed form (formats/packed, kernels/matmul_packed): every row
the bits matmul_out gives it (lanes of 8 weight rows on the file's blocks), for row counts of
a decode step and of a verify pass, partial row groups, several weights in one call, groups
holding inf, and large sums whose float steps round; and every_row, which takes such passes
to the packed kernel, the bits of a pass of one row."""

import numpy as np
import pytest

from localkv.backends.cpu import build, quant
from localkv.backends.cpu.formats.blocks import MARKERS
from localkv.backends.cpu.quant.tensor import QStack, sample_weight
from tests.backends.test_matmul_wide import activations

TYPES = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="module")
def kernels():
    assert build.load(TYPES), {t: quant.why_not(t) for t in TYPES}
    from localkv.backends.cpu.kernels import matmul_out, matmul_packed

    return matmul_out, matmul_packed


def weights(qtype: str) -> QStack:
    """Matrices of 37 rows (two row groups of 16 and 5), 16 and 3, of 5 blocks (an odd count)."""
    return QStack(tuple(sample_weight(qtype, rows, 160, seed) for rows, seed in ((37, 1), (16, 2), (3, 3))))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_kernel_gives_every_row_matmul_outs_bits(kernels, qtype):
    matmul_out, matmul_packed = kernels
    w, rng = weights(qtype), np.random.default_rng(7)
    (run,), qt = w.runs, MARKERS[qtype]
    for rows in (1, 2, 5, 9):
        for positive in (False, True):
            x = activations(rng, rows, w.cols, positive)
            x[rows // 2, 70] = np.inf  # its group: nan
            want = np.empty((rows, w.rows), np.float32)
            matmul_out.matmul_out(qt, x, run.datas, run.offs, want)
            got = np.full((rows, w.rows), -1, np.float32)
            matmul_packed.matmul_packed(qt, x, run.datas, run.packed(), run.offs, got)
            assert np.isnan(got[rows // 2]).all()
            assert np.array_equal(got, want, equal_nan=True), (rows, positive)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_row_gives_a_few_rows_the_bits_of_one(kernels, qtype):
    w, rng = weights(qtype), np.random.default_rng(11)
    for rows in (2, 9, 16):
        x = activations(rng, rows, w.cols, True)
        alone = np.concatenate([quant.matmul_rows(x[r : r + 1], w) for r in range(rows)])
        assert np.array_equal(quant.matmul_rows(x, w), alone), rows
