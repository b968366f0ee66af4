"""The 16-row lanes kernel (kernels/matmul_wide) gives each activation row the bits the 8-lane
kernel (matmul_lanes) gives it: np.array_equal for every block type, on activations whose
float products round (large positive dots) and with an inf (its group nan in both), with
weight counts that leave a partial work chunk; and a pass of any row count (whole blocks of
16 here, then blocks of 8, then matmul_out's tail) gives each row the bits of a pass of 8."""

import platform
import sys

import numpy as np
import pytest

from localkv.backends.cpu import build, quant
from localkv.backends.cpu.formats.blocks import MARKERS
from localkv.backends.cpu.formats.types import BLOCK_TYPES, activation_group, block_size
from localkv.backends.cpu.quant.tensor import QStack, sample_weight

LANE_TYPES = [t for t in BLOCK_TYPES if t not in ("Q4_K", "Q6_K")]  # those two: superblock_packed, _amx


@pytest.fixture(scope="module")
def kernels():
    assert build.load(BLOCK_TYPES), {t: quant.why_not(t) for t in BLOCK_TYPES}
    from localkv.backends.cpu.kernels import matmul_few, matmul_wide

    return matmul_few, matmul_wide


def weights(qtype: str) -> QStack:
    """Matrices of 37 (two chunks of 16 and a tail of 5), 5 and 3 rows, of an odd number of blocks."""
    values = block_size(qtype)[0]
    cols = 5 * 32 if values == 32 else 3 * values
    return QStack(tuple(sample_weight(qtype, rows, cols, seed) for rows, seed in ((37, 1), (5, 2), (3, 3))))


def by_lanes(matmul_few, kernel, lanes: int, w: QStack, x: np.ndarray) -> np.ndarray:
    """x @ W.T by a lanes kernel taking blocks of `lanes` rows, whatever len(x)."""
    out = np.full((-(-len(x) // lanes) * lanes, w.rows), -1, np.float32)
    ((run,), qt) = w.runs, MARKERS[w.tensors[0].qtype]
    tail = () if lanes == 8 else (x[len(x) :], out[len(out) :])  # matmul_wide: no rows past the blocks
    kernel(qt, *matmul_few.lanes_inputs(qt, x, lanes), run.datas, run.offs, out, *tail)
    return out[: len(x)]


def activations(rng, rows: int, cols: int, positive: bool) -> np.ndarray:
    x = rng.uniform(0.5, 1, (rows, cols)) if positive else rng.standard_normal((rows, cols))
    return (x * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)


@pytest.mark.parametrize("qtype", LANE_TYPES)
def test_each_row_of_16_gets_the_8_lane_bits(kernels, qtype):
    matmul_few, matmul_wide = kernels
    w, rng = weights(qtype), np.random.default_rng(5)
    for rows, positive in ((16, False), (16, True), (40, True)):
        x = activations(rng, rows, w.cols, positive)
        x[3, 7] = np.inf
        wide = by_lanes(matmul_few, matmul_wide.matmul_wide, 16, w, x)
        assert np.isnan(wide[3]).all() and np.isfinite(wide[4]).all()
        assert np.array_equal(wide, by_lanes(matmul_few, matmul_few.matmul_lanes, 8, w, x), equal_nan=True), rows


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_K"])
def test_a_pass_of_any_row_count_gives_each_row_the_bits_of_one_block(kernels, qtype):
    """16k + 8j + t rows: matmul_wide, matmul_lanes and matmul_out each take a part, where the
    CPU has AVX-512 VNNI (elsewhere the wide kernel is not chosen, and this holds the same);
    50 and 64 rows of Q4_1 and Q8_0: matmul_amx, where the CPU has AMX-INT8."""
    matmul_few, _ = kernels
    w, rng = weights(qtype), np.random.default_rng(9)
    for rows in (9, 10, 12, 15, 16, 17, 25, 26, 33, 50, 64):  # 10, 12, 15, 26, 50: a padded block of 16
        x = activations(rng, rows, w.cols, True)
        want = np.concatenate([by_lanes(matmul_few, matmul_few.matmul_lanes, 8, w, x[r : r + 1]) for r in range(rows)])
        assert np.array_equal(quant.matmul_rows(x, w), want), rows


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_amx_int8_kernel_gives_each_row_the_row_kernels_bits(kernels, qtype):
    """kernels/superblock_amx (integer dots on AMX tiles, each weight of the packed form times
    its scale split in two bytes) against superblock.matmul_rows, on a CPU with AMX-INT8."""
    from localkv.backends.cpu.kernels import superblock, superblock_amx

    if not superblock_amx.chosen():
        pytest.skip("no AMX-INT8 here (or Linux refused the tile state)")
    matmul_few, _ = kernels
    w, rng = weights(qtype), np.random.default_rng(17)
    ((run,), qt) = w.runs, MARKERS[qtype]
    for positive in (False, True):
        x = activations(rng, 48, w.cols, positive)
        x[20, 300] = np.inf
        x[33] = -x[33]  # large negative sums: the signed side of every product
        want = np.empty((48, w.rows), np.float32)
        superblock.matmul_rows(qt, x, run.datas, run.offs, want)
        xi, dxv, _, _ = matmul_few.lanes_inputs(qt, x, 16)
        got = np.full((48, w.rows), -1, np.float32)
        sums = superblock_amx.prepared_sums(qt, xi)
        superblock_amx.matmul_super_amx(qt, xi, dxv, *sums, run.datas, run.packed(), run.offs, got)
        assert np.isnan(got[20]).all()
        assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("qtype", [t for t in BLOCK_TYPES if activation_group(t) == 32])
def test_the_amx_lanes_kernel_gives_each_row_the_wide_kernels_bits(kernels, qtype):
    """kernels/matmul_amx (a group's integer dot on AMX tiles, then group_step's float ops in
    walk's order) against matmul_wide, on a CPU with AMX-INT8: blocks of 16 and a padded one,
    rounding products, a nan group, large negative sums."""
    from localkv.backends.cpu.kernels import matmul_amx, superblock_amx

    if not superblock_amx.chosen():
        pytest.skip("no AMX-INT8 here (or Linux refused the tile state)")
    matmul_few, matmul_wide = kernels
    w, rng = weights(qtype), np.random.default_rng(23)
    for rows, positive in ((16, True), (41, False), (41, True)):
        x = activations(rng, rows, w.cols, positive)
        x[3, 7] = np.inf
        x[rows - 2] = -x[rows - 2]
        got = by_lanes(matmul_few, lambda qt, *a: matmul_amx.matmul_amx(qt, *a[:-2]), 16, w, x)
        assert np.isnan(got[3]).all() and np.isfinite(got[4]).all()
        assert np.array_equal(got, by_lanes(matmul_few, matmul_wide.matmul_wide, 16, w, x), equal_nan=True), rows


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="AMX is x86-64 Linux's")
def test_amx_switch_and_a_cpu_without_amx_int8(kernels, monkeypatch):
    """LOCALKV_AMX=0 and a CPU without AMX-INT8 leave the tile kernel unchosen, with why."""
    import llvmlite.binding as llvm

    from localkv.backends.cpu.kernels import superblock_amx

    monkeypatch.setenv("LOCALKV_AMX", "0")
    assert superblock_amx.enable() == "LOCALKV_AMX=0" and not superblock_amx.chosen()
    monkeypatch.delenv("LOCALKV_AMX")
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"avx512f": True, "amx-tile": True})
    assert superblock_amx.enable() == "the CPU has no AMX-INT8" and not superblock_amx.chosen()
