"""Weights kept in their GGUF encoding and multiplied in place: no float32 copy of a model.

A QTensor is one weight matrix [rows=out, cols=in] as the file stores it (a read-only view
into the mapped file). Four operations cover a Llama forward pass:
- matmul_few(x, w): x @ W.T for 1-8 activation rows (decode steps, forks), numba kernels that
  read the blocks directly, on all the kernels' threads (kernels/matmul_few, superblock,
  float_few);
- matmul_many(x, w): the same for many rows (prefill): tiles of W dequantized into a reused
  float32 scratch, each multiplied by BLAS; or, for block types on a CPU with AMX, bf16 tile
  kernels that decode the blocks themselves (kernels/amx, on all the kernels' threads; why_no_amx()
  says whether);
- dequantize_rows / get_rows: rows as float32 (embedding lookups, tests).

Thread rules (docs/ARCHITECTURE.md, backends/cpu/build): matmul_few starts numba's OpenMP workers, so
call it with BLAS held to one thread, as the model does for passes of up to 8 rows; everything
else here runs on the calling thread or in BLAS.

The kernels load with the others (build.load(types) prepares only the types a model uses):
LOCALKV_CPU_KERNELS=0, a missing numba or OpenMP runtime turn them off, and each type's
kernels are checked against the numpy path when they load (compiled.check). Without them
every operation runs the numpy path (`fallback`: gguf's dequantizer + BLAS) with the same
results within float rounding.

Modules: types (the weight types and their block sizes), formats (the block decoders the
kernels inline), tensor (QTensor, QStack), fallback (the numpy path), compiled (the entry
points into the kernels, imported by build.load), and this API.
"""

from collections.abc import Iterable, Sequence

import numpy as np

import localkv.backends.cpu.quant.fallback as fallback
from localkv.backends.cpu.build import state
from localkv.backends.cpu.quant.tensor import SUPPORTED, KernelRun, QStack, QTensor, from_gguf
from localkv.backends.cpu.quant.types import BLOCK_TYPES, activation_group
from localkv.backends.vm import reused_empty

__all__ = ["SUPPORTED", "QStack", "QTensor", "active", "dequantize", "dequantize_rows", "from_gguf", "get_rows",
           "matmul_few", "matmul_many", "matmul_rows", "on_amx", "scratch", "weight_types", "why_no_amx",
           "why_not"]  # fmt: skip
MAX_FEW = 8  # matmul_few's activation rows per kernel call; more go to matmul_many


# ---------------------------------------------------------------- what loaded (build.load)


def active(qtype: str) -> bool:
    """The kernels of this type are loaded and passed their check."""
    return qtype in state.types and state.types[qtype] is None  # absent: not loaded


def why_not(qtype: str) -> str | None:
    return state.types.get(qtype, "not loaded")


def why_no_amx() -> str | None:
    """None when matmul_many multiplies on AMX tiles in this process (the CPU and Linux allow
    it, and the kernels of some type loaded and passed their check), else why not."""
    if any(why is None for t, why in state.amx.items() if t):
        return None
    return state.amx.get("", "not loaded") or "no block type's AMX kernel loaded"


def on_amx(qtype: str) -> bool:
    """matmul_many multiplies weights of this type on AMX tiles (block types only: kernels/amx
    says why)."""
    return state.amx.get(qtype, "") is None


# ---------------------------------------------------------------- operations


def matmul_few(x: np.ndarray, w: "QTensor | QStack | Sequence[QTensor]") -> np.ndarray:
    """x [R, cols] float32 (1 <= R <= 8) @ W.T -> float32 [R, rows]. Given a QStack (or a
    list of QTensors, stacked on each call: make the QStack once instead), the outputs of its
    weights side by side [R, sum of rows]."""
    if not isinstance(w, (QTensor, QStack)):
        w = QStack(tuple(w))
    x = _activations(x, w)
    if not 0 < x.shape[0] <= MAX_FEW:
        return matmul_many(x, w)
    out = np.empty((x.shape[0], w.rows), np.float32)
    _by_runs("few", x, w, out)
    return out


def matmul_rows(x: np.ndarray, w: "QTensor | QStack") -> np.ndarray:
    """x [R, cols] @ W.T -> float32 [R, rows] for any R, each row's outputs computed by one
    arithmetic whatever R is, so that a token's result does not depend on the rows that share
    its pass: Q4_K and Q6_K by super-blocks (integer sums, then one float step per 256 values:
    kernels/superblock.matmul_rows), the other block types by the 8-lane kernel's (matmul_few's
    for 3-8 rows; a decode row takes kernels/matmul_out, the same bits with outputs in the
    lanes). Slower for many rows than the cut-dependent kernels (build.FAST_PATHS: matmul_many).
    Without the kernels, BLAS on fixed blocks of rows (fallback.matmul_rows)."""
    x = _activations(x, w)
    R = x.shape[0]
    out = np.empty((-(-R // 8) * 8, w.rows), np.float32)  # the lanes kernel writes all 8 of a block
    _by_runs("every_row", x, w, out)
    return out[:R]


def _activations(x: np.ndarray, w: "QTensor | QStack") -> np.ndarray:
    """x as the few-row kernels read it: C-contiguous float32 [R, w.cols]."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"activations {x.shape} do not match weights of {w.cols} columns")
    return x


def _by_runs(kernel: str, x: np.ndarray, w: "QTensor | QStack", out: np.ndarray):
    """Each run of w's weights into out: on the compiled entry point `kernel` (compiled.few or
    every_row) where it can take the run's type, else on the numpy path (out's first len(x) rows)."""
    for run in w.runs:
        if active(run.qtype) and (run.qtype in BLOCK_TYPES or w.cols % 8 == 0):
            getattr(state.weights, kernel)(run, x, out)
        elif kernel == "every_row":
            _rows_numpy(run, x, out)
        else:
            _few_numpy(run, x, out[: len(x)])


def _numpy_activations(run: KernelRun, x: np.ndarray) -> np.ndarray:
    return fallback.quantize_activations(x, activation_group(run.qtype)) if run.qtype in BLOCK_TYPES else x


def _few_numpy(run: KernelRun, x: np.ndarray, out: np.ndarray):
    xa = _numpy_activations(run, x)
    for t, col in zip(run.tensors, run.offs):
        out[:, col : col + t.rows] = fallback.matmul_t(xa, t.data, t.qtype, t.rows, t.cols, None, _dequant(t)).T


def _rows_numpy(run: KernelRun, x: np.ndarray, out: np.ndarray):
    """matmul_rows's numpy path: each row's outputs the same bits whatever rows share the call."""
    xa = _numpy_activations(run, x)
    for t, col in zip(run.tensors, run.offs):
        fallback.matmul_rows(xa, t.data, t.qtype, _dequant(t), out, col, t.rows)


def matmul_many(x: np.ndarray, w: "QTensor | QStack", scratch: np.ndarray | None = None) -> np.ndarray:
    """x [R, cols] @ W.T for many rows (prefill): float32 [R, rows], the transpose of a
    C-contiguous [rows, R] result (BLAS runs W @ x.T, the faster order; a QStack's weights fill
    consecutive rows of it). W is dequantized a tile of rows at a time into scratch (float32,
    reused when large enough: pass the same one each call, e.g. scratch()) and each tile
    multiplied by BLAS on its own threads. For block types x is first rounded to int8 steps per
    32 values (256 for the K-quants), as matmul_few does: a row gets the same result (up to float summation order)
    whichever path, batch or chunk computes it, as in llama.cpp."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"activations {x.shape} do not match a weight of {w.cols} columns")
    if not (x.flags.c_contiguous or x.flags.f_contiguous):  # BLAS takes either order as it is
        x = np.ascontiguousarray(x)
    out_t = reused_empty((w.rows, len(x)))  # a fresh 32 MiB mmap halves BLAS's speed
    r, rounded, packs = 0, {}, {}
    for t in w.tensors if isinstance(w, QStack) else (w,):
        xa, group = x, 0
        if t.qtype in BLOCK_TYPES:  # the activations matmul_few multiplies: both paths, one function
            group = activation_group(t.qtype)
            xa = rounded[group] = rounded[group] if group in rounded else _rounded(x, t.qtype)
        if on_amx(t.qtype):
            packs[group] = packs[group] if group in packs else state.amx_kernels.packed(xa)
            state.amx_kernels.multiply(t.qtype, t.data, t.cols, packs[group], out_t[r : r + t.rows])
        else:
            fallback.matmul_t(xa, t.data, t.qtype, t.rows, t.cols, scratch, _dequant(t), out_t[r : r + t.rows])
        r += t.rows
    return out_t.T


def _rounded(x: np.ndarray, qtype: str) -> np.ndarray:
    """x rounded to int8 steps per group (types.activation_group), as the few-row kernels
    quantize them for weights of qtype."""
    group = activation_group(qtype)
    return state.weights.quantize(x, group) if active(qtype) else fallback.quantize_activations(x, group)


def scratch() -> np.ndarray:
    """A float32 buffer that holds any tile matmul_many dequantizes (weights of up to
    fallback.TILE_VALUES / 64 columns): one per caller, passed to every call."""
    return np.empty(fallback.TILE_VALUES, np.float32)


def weight_types(weights: Iterable) -> set[str]:
    """The types of the QTensors (and of the QStacks' tensors) among weights: what build.load() needs."""
    types: set[str] = set()
    for w in weights:
        if isinstance(w, QTensor):
            types.add(w.qtype)
        elif isinstance(w, QStack):
            types.update(t.qtype for t in w.tensors)
    return types


def dequantize_rows(w: QTensor, r0: int, r1: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows r0..r1 of W as float32 into out [r1 - r0, cols] (a new array when None)."""
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"rows {r0}..{r1} are outside a weight of {w.rows} rows")
    if out is None:
        out = np.empty((r1 - r0, w.cols), np.float32)
    elif out.shape != (r1 - r0, w.cols) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 {(r1 - r0, w.cols)}, got {out.dtype.name} {out.shape}")
    return _dequant(w)(r0, r1, out)


def dequantize(w: "QTensor | QStack", dtype=np.float32) -> np.ndarray:
    """The whole weight as a [rows, cols] array of dtype (a QStack's weights one under the
    other): for a backend that computes on plain arrays. Converted a tile of rows at a time,
    so no float32 copy of the whole weight is made on the way to another dtype."""
    out = np.empty(w.shape, dtype)
    tensors = w.tensors if isinstance(w, QStack) else (w,)
    r = 0
    for t in tensors:
        step = fallback.tile_rows(t.cols)
        tile = None if out.dtype == np.float32 else np.empty((min(step, t.rows), t.cols), np.float32)
        for r0 in range(0, t.rows, step):
            r1 = min(t.rows, r0 + step)
            if tile is None:
                dequantize_rows(t, r0, r1, out[r + r0 : r + r1])
            else:
                out[r + r0 : r + r1] = dequantize_rows(t, r0, r1, tile[: r1 - r0])
        r += t.rows
    return out


def get_rows(w: QTensor, ids) -> np.ndarray:
    """Rows ids of W as float32 [len(ids), cols] (embedding lookup)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"row ids must be in 0..{w.rows - 1}, got {ids.min()}..{ids.max()}")
    if w.qtype in BLOCK_TYPES and active(w.qtype):
        out = np.empty((len(ids), w.cols), np.float32)
        state.weights.dequantize(w, ids, out)
        return out
    return fallback.get_rows(w.data, w.qtype, ids, w.cols)


def _dequant(w: QTensor):
    """dequant(r0, r1, out) for w: the serial kernel when loaded, else gguf's dequantizer."""
    if w.qtype in BLOCK_TYPES and active(w.qtype):

        def kernel(r0: int, r1: int, out: np.ndarray) -> np.ndarray:
            if not out.flags.c_contiguous:
                return fallback.dequantize_rows(w.data, w.qtype, r0, r1, out)
            state.weights.dequantize(w, np.arange(r0, r1), out)
            return out

        return kernel
    return lambda r0, r1, out: fallback.dequantize_rows(w.data, w.qtype, r0, r1, out)
