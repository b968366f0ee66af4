"""The outputs-in-the-lanes kernel (kernels/matmul_out) gives each activation row the bits the
8-lane kernel (matmul_lanes) gives it in a batch: np.array_equal, for every block type, for
the row counts that take it and one more, with weight counts that leave a partial 8 at the end
of a work chunk and a matrix smaller than 8 rows."""

import numpy as np
import pytest

from localkv.backends.cpu import build, quant
from localkv.backends.cpu.formats.blocks import MARKERS
from localkv.backends.cpu.formats.types import BLOCK_TYPES, block_size
from localkv.backends.cpu.quant.tensor import QStack, sample_weight


@pytest.fixture(scope="module")
def kernels():
    """The kernels, imported once build.load has imported numba and loaded (and checked) them."""
    assert build.load(BLOCK_TYPES), {t: quant.why_not(t) for t in BLOCK_TYPES}
    from localkv.backends.cpu.kernels import matmul_few, matmul_out, superblock

    return matmul_few, matmul_out, superblock.TYPES


def weights(qtype: str) -> QStack:
    """Three matrices of 37, 5 and 3 rows (37: two chunks of 16 and a tail of 5), of an odd
    number of blocks: 5 groups of 32, or 3 super-blocks of 256 for the K-quants (the least they
    allow)."""
    values = block_size(qtype)[0]
    cols = 5 * 32 if values == 32 else 3 * values
    return QStack(tuple(sample_weight(qtype, rows, cols, seed) for rows, seed in ((37, 1), (5, 2), (3, 3))))


def lanes(matmul_few, w: QStack, x: np.ndarray) -> np.ndarray:
    """x @ W.T by the 8-lane kernel (activation rows in the lanes), whatever len(x)."""
    out = np.empty((-(-len(x) // 8) * 8, w.rows), np.float32)
    ((run,), qt) = w.runs, MARKERS[w.tensors[0].qtype]
    matmul_few.matmul_lanes(qt, *matmul_few.lanes_inputs(qt, x, 8), run.datas, run.offs, out)
    return out[: len(x)]


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_each_row_gets_the_lanes_kernels_bits(kernels, qtype):
    matmul_few, matmul_out, super_types = kernels
    w = weights(qtype)
    (run,) = w.runs
    rng = np.random.default_rng(7)
    for rows, positive in ((r, p) for r in range(1, matmul_out.out_rows(qtype) + 2) for p in (False, True)):
        # positive activations: large integer dots, whose float products round (a kernel that
        # multiplied in another order would differ there)
        x = rng.uniform(0.5, 1, (rows, w.cols)) if positive else rng.standard_normal((rows, w.cols))
        x = (x * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        x[0, 3] = np.inf if rows > 1 else x[0, 3]  # its group: nan in both kernels
        got = np.full((rows, w.rows), -1, np.float32)
        matmul_out.matmul_out(MARKERS[qtype], x, run.datas, run.offs, got)
        for batch in (8, 33):  # the rows inside a larger pass, not at its start
            xb = rng.standard_normal((batch, w.cols), dtype=np.float32)
            xb[batch - rows - 1 : batch - 1] = x
            want = lanes(matmul_few, w, xb)[batch - rows - 1 : batch - 1]
            assert np.array_equal(got, want, equal_nan=True), (rows, batch)
            if qtype not in super_types:  # those multiply by super-blocks (test_superblock_rows)
                assert np.array_equal(quant.matmul_rows(xb, w)[batch - rows - 1 : batch - 1], want, equal_nan=True)
        if qtype not in super_types:
            assert np.array_equal(quant.matmul_rows(x, w), got, equal_nan=True)  # the row counts that take it


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_K"])  # 2-row and 1-row tails
def test_a_short_tail_past_blocks_of_8_gets_the_lanes_bits(kernels, qtype):
    """A pass of 8k + t rows runs its last t <= out_rows rows through matmul_out (a 1 + 8
    verify pass: one block and one row): every row keeps the bits of a pass of 8 of its own."""
    matmul_few, matmul_out, _ = kernels
    w = weights(qtype)
    rng = np.random.default_rng(11)
    for rows in (9, 10, 11, 17, 18):
        x = rng.standard_normal((rows, w.cols), dtype=np.float32)
        want = np.concatenate([lanes(matmul_few, w, x[r : r + 1]) for r in range(rows)])
        assert np.array_equal(quant.matmul_rows(x, w), want), rows
