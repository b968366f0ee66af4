"""Entry points into the compiled weight kernels (imported by build.load once numba has
imported): the kernel call for a run of weights of one type, the dequantizer, and the check
each type passes as it loads."""

import numpy as np

import localkv.backends.cpu.quant.fallback as fallback
from localkv.backends.cpu.formats.blocks import MARKERS
from localkv.backends.cpu.formats.types import BLOCK_TYPES, activation_group, block_size
from localkv.backends.cpu.kernels import self_check
from localkv.backends.cpu.kernels.float_few import matmul_few_float
from localkv.backends.cpu.kernels.matmul_amx import matmul_amx as _matmul_amx
from localkv.backends.cpu.kernels.matmul_few import CHUNK
from localkv.backends.cpu.kernels.matmul_few import LANES as OUT_LANES
from localkv.backends.cpu.kernels.matmul_few import dequantize as _dequantize
from localkv.backends.cpu.kernels.matmul_few import lanes_inputs as _lanes_inputs
from localkv.backends.cpu.kernels.matmul_few import matmul_lanes as _matmul_lanes
from localkv.backends.cpu.kernels.matmul_out import lanes_then_out as _lanes_then_out
from localkv.backends.cpu.kernels.matmul_out import matmul_out as _matmul_out
from localkv.backends.cpu.kernels.matmul_out import out_rows
from localkv.backends.cpu.kernels.matmul_packed import TYPES as PACKED_TYPES
from localkv.backends.cpu.kernels.matmul_packed import matmul_packed as _matmul_packed32
from localkv.backends.cpu.kernels.matmul_wide import LANES as WIDE_LANES
from localkv.backends.cpu.kernels.matmul_wide import chosen as _wide_chosen
from localkv.backends.cpu.kernels.matmul_wide import matmul_wide as _matmul_wide
from localkv.backends.cpu.kernels.superblock import TYPES as SUPER_TYPES
from localkv.backends.cpu.kernels.superblock_amx import chosen as _amx_int8_chosen
from localkv.backends.cpu.kernels.superblock_amx import matmul_super_amx as _matmul_super_amx
from localkv.backends.cpu.kernels.superblock_amx import prepared_sums as _prepared_sums
from localkv.backends.cpu.kernels.superblock_packed import matmul_packed as _matmul_packed
from localkv.backends.cpu.quant.tensor import QStack, sample_weight


def every_row(run, x: np.ndarray, out: np.ndarray):
    """out[:, run.col:] = x @ W.T for the weights of a KernelRun, side by side, for any number
    of rows in one arithmetic per row, whatever the count: Q4_K and Q6_K by super-blocks in
    integers with superblock.matmul_rows's bits (superblock_packed: 16 weight rows of their
    packed form in the lanes; a pass of AMX_ROWS rows or more in whole blocks of 16 on AMX-INT8
    tiles, superblock_amx, where the CPU has them), the types of one scale per group in a pass
    of AMX_LANE_ROWS rows or more on those tiles (matmul_amx, its last block padded with zero
    rows), the other block types and passes by the 8-lane kernel
    (whole blocks of 16 by matmul_wide where chosen; a tail of up to out_rows rows past the
    blocks, or a pass of so few, by matmul_out's arithmetic: the same bits with outputs in the
    lanes, faster for so few, in the same pass over the weights as the blocks before it; a 1 +
    8 verify pass is then one block and one row, one read of each weight; a last part of
    WIDE_PADDED rows or more goes to matmul_wide as a block of 16 padded with zero rows), the
    float kernel (a dot per row) for the others. Every part gives a row the same bits. out: at
    least the rows rounded up to 16 (the lanes kernels write whole blocks)."""
    qt = MARKERS[run.qtype]
    if run.qtype in SUPER_TYPES:
        R = len(x)
        wide = R - R % WIDE_LANES if _AMX_INT8 and R >= AMX_ROWS else 0  # whole blocks of 16 on AMX tiles
        if wide:
            xi, dxv, _, _ = _lanes_inputs(_GROUP_MARKERS[activation_group(run.qtype)], x[:wide], WIDE_LANES)
            _matmul_super_amx(qt, xi, dxv, *_prepared_sums(qt, xi), run.datas, run.packed(), run.offs, out)
        if wide < R:
            _matmul_packed(qt, x[wide:], run.datas, run.packed(), run.offs, out[wide:])
    elif run.qtype in PACKED_TYPES and len(x) <= PACKED_ROWS:
        _matmul_packed32(qt, x, run.datas, run.packed(), run.offs, out)
    elif _AMX_INT8 and run.qtype in AMX_LANE_TYPES and len(x) >= AMX_LANE_ROWS:
        xw = _lanes_inputs(_GROUP_MARKERS[32], x, WIDE_LANES)  # the last block padded with zero rows
        _matmul_amx(qt, *xw, run.datas, run.offs, out)
    elif run.qtype in BLOCK_TYPES:
        R = len(x)
        wide = R - R % WIDE_LANES if _WIDE else 0  # whole blocks of 16: matmul_wide's
        if _WIDE and R - wide >= WIDE_PADDED:  # and a last block this full, padded with zero rows
            wide = R
        tail = (R - wide) % OUT_LANES
        lanes = R - tail if tail <= out_rows(run.qtype) else R  # a short tail: matmul_out's
        group = _GROUP_MARKERS[activation_group(run.qtype)]
        # the tail x[lanes:] rides in the pass of the part just before it (each chunk of weights
        # read once): the 8-lane part's when there is one, else the wide part's
        if wide:
            t = R if lanes > wide else lanes
            xw = _lanes_inputs(group, x[:wide], WIDE_LANES)
            _matmul_wide(qt, *xw, run.datas, run.offs, out, x[t:], out[t:])
        if lanes > wide:
            xl = _lanes_inputs(group, x[wide:lanes], OUT_LANES)
            if lanes == R:
                _matmul_lanes(qt, *xl, run.datas, run.offs, out[wide:])
            else:
                _lanes_then_out(qt, *xl, run.datas, run.offs, out[wide:], x[lanes:], out[lanes:])
        elif not wide and lanes < R:  # a pass of so few rows: the tail alone
            _matmul_out(qt, x, run.datas, run.offs, out)
    else:
        matmul_few_float(qt, x, run.datas, run.offs, out)


_WIDE = _wide_chosen()  # blocks of 16 rows go to matmul_wide (same bits, faster with AVX-512 VNNI)
# from this many rows past the whole blocks of 16, one more wide block (zero rows after them)
# costs less than the 8-lane kernel and matmul_out's tail (BENCHMARKS.md, "q8_0 K/V by default")
WIDE_PADDED = 10
_AMX_INT8 = _WIDE and _amx_int8_chosen()  # Q4_K / Q6_K's to superblock_amx (same bits)
AMX_ROWS = 128  # from this many rows the tiles beat superblock_packed (BENCHMARKS.md, "Packed K-quants")
# the types of one scale per group to matmul_amx (same bits) from this many rows: it decodes a
# chunk's weights once per call, which fewer rows do not repay (BENCHMARKS.md, "One scale per
# 32-value group")
AMX_LANE_TYPES = frozenset(t for t in BLOCK_TYPES if activation_group(t) == 32)
AMX_LANE_ROWS = 48
# Q4_0, Q4_1 and Q8_0 from their packed form up to this many rows (a decode step, a few
# sequences' or a verify pass): faster than matmul_out and the lanes kernels there
# (BENCHMARKS.md, "One scale per 32-value group")
PACKED_ROWS = 16
# lanes_inputs reads only the activations' group from its type: one build (one compile on an
# empty cache, one load at a start) serves every block type of a group
_GROUP_MARKERS = {activation_group(t): MARKERS[t] for t in reversed(BLOCK_TYPES)}  # the first type of each


def on_amx(qtype: str) -> bool:
    """every_row multiplies weights of this type on AMX tiles in a long pass (superblock_amx:
    Q4_K and Q6_K; matmul_amx: the types of one scale per group)."""
    return _AMX_INT8 and (qtype in SUPER_TYPES or qtype in AMX_LANE_TYPES)


def dequantize(w, rows: np.ndarray, out: np.ndarray):
    """out[i] = row rows[i] of the block-type weight w, as float32 (out C-contiguous)."""
    _dequantize(MARKERS[w.qtype], w.data, rows, out)


def _samples(qtype: str):
    """Two weights of qtype (the first not a multiple of the work chunk) and their float32 values."""
    values = block_size(qtype)[0] if qtype in BLOCK_TYPES else 32
    cols = 3 * values if values == 32 else 2 * values
    ws = (sample_weight(qtype, CHUNK + 3, cols, 1), sample_weight(qtype, 5, cols, 2))
    return ws, [fallback.dequantize_rows(w.data, qtype, 0, w.rows, np.empty(w.shape, np.float32)) for w in ws]


def _close(got: np.ndarray, x: np.ndarray, qtype: str, dense: list) -> bool:
    """got = x @ W.T for the weights dense side by side, within float32 sums of the exact products."""
    xa = fallback.quantize_activations(x, activation_group(qtype)) if qtype in BLOCK_TYPES else x
    want = xa.astype(np.float64) @ np.concatenate(dense).T.astype(np.float64)
    return bool(np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()))


@self_check("weights", cost=7.2)
def check(qtype: str) -> bool:
    """Compile (or load) this type's kernels of every pass (every_row, the dequantizer) now,
    not inside a timed step, and check them against the numpy path: several weights at once, a
    row count that is not a multiple of the work chunk, each row alone the bits it gets among
    others."""
    ws, dense = _samples(qtype)
    if qtype in BLOCK_TYPES:
        got = np.empty(dense[0].shape, np.float32)
        dequantize(ws[0], np.arange(ws[0].rows), got)
        if not np.array_equal(got, dense[0]):
            return False
    rng = np.random.default_rng(3)
    (run,) = QStack(ws).runs
    for rows in _check_rows(qtype):
        x = rng.standard_normal((rows, dense[0].shape[1]), dtype=np.float32)
        one = np.empty((-(-rows // 16) * 16, ws[0].rows + ws[1].rows), np.float32)  # whole blocks of 16
        every_row(run, x, one)
        one = one[: len(x)]
        if not all(np.array_equal(one[r : r + 1], _one_row(run, x[r : r + 1], one.shape[1])) for r in range(rows)):
            return False  # each row the bits it gets in a batch (the lanes kernel's) when alone
        if not _close(one, x, qtype, dense):
            return False
    return True


def _check_rows(qtype: str) -> tuple[int, ...]:
    """Row counts that reach every kernel every_row gives this type on this CPU, so that a
    start compiles (or loads) them all: 9, 17: 8 or 16 in the lanes + 1 (or packed); 23: 16 +
    the 8-lane kernel; 25: 16 + 8 + 1; 50: the AMX tiles. Without matmul_wide (no AVX-512
    VNNI), a packed type's 1-9 rows never reach the 8-lane kernel: 17 (8-lane + 1) and 24 do."""
    rows = (1, 2, 3, 8, 9)
    if _WIDE and qtype in BLOCK_TYPES:
        rows += (17, 23, 25)
    elif qtype in PACKED_TYPES:
        rows += (PACKED_ROWS + 1, PACKED_ROWS + 8)
    if _AMX_INT8 and qtype in AMX_LANE_TYPES:
        rows += (AMX_LANE_ROWS + 2,)
    return rows


def _one_row(run, x: np.ndarray, n: int) -> np.ndarray:
    out = np.empty((8, n), np.float32)
    every_row(run, x, out)
    return out[:1]
