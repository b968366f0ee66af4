"""Weights kept in their GGUF encoding and multiplied in place: no float32 copy of a model.

A QTensor is one weight matrix [rows=out, cols=in] as the file stores it (a read-only view
into the mapped file). Three operations cover a Llama forward pass:
- matmul_rows(x, w): x @ W.T for any number of activation rows, numba kernels that read the
  blocks directly, on all the kernels' threads, each row's outputs one arithmetic whatever
  rows share the call (kernels/matmul_few, matmul_out, matmul_wide, superblock, superblock_lanes,
  superblock_amx, float_few; docs/CPU.md);
- dequantize_rows / get_rows: rows as float32 (embedding lookups, tests).

Thread rules (docs/CPU.md, backends/cpu/build): the kernels start numba's OpenMP workers, so
call them with BLAS held to one thread, as the model does; everything else here runs on the
calling thread or in BLAS.

The kernels load with the others (build.load(types) prepares only the types a model uses):
LOCALKV_CPU_KERNELS=0, a missing numba or OpenMP runtime turn them off, and each type's
kernels are checked against the numpy path when they load (compiled.check). Without them
every operation runs the numpy path (`fallback`: gguf's dequantizer + BLAS on fixed blocks of
rows) with the same results within float rounding.

Modules: tensor (QTensor, QStack), fallback (the numpy path), compiled (the entry points into
the kernels, imported by build.load), pack_cache (the K-quants' packed form on disk), and this
API. The formats they share with the kernels lie below both (backends/cpu/formats).
"""

from collections.abc import Iterable

import numpy as np

import localkv.backends.cpu.quant.fallback as fallback
import localkv.backends.cpu.quant.pack_cache as pack_cache
from localkv.backends.cpu.formats.types import BLOCK_TYPES, activation_group
from localkv.backends.cpu.loaded import state
from localkv.backends.cpu.quant.tensor import SUPPORTED, KernelRun, QStack, QTensor, from_gguf

__all__ = ["SUPPORTED", "QStack", "QTensor", "active", "dequantize", "dequantize_rows", "from_gguf", "get_rows",
           "matmul_rows", "on_amx", "pack", "weight_types", "why_not"]  # fmt: skip


# ---------------------------------------------------------------- what loaded (build.load)


def active(qtype: str) -> bool:
    """The kernels of this type are loaded and passed their check."""
    return qtype in state.types and state.types[qtype] is None  # absent: not loaded


def why_not(qtype: str) -> str | None:
    return state.types.get(qtype, "not loaded")


def on_amx(qtype: str) -> bool:
    """matmul_rows multiplies weights of this type on AMX tiles in a long pass, where the CPU
    has AMX-INT8 (Q4_K and Q6_K: kernels/superblock_amx; the types of one scale per group:
    kernels/matmul_amx)."""
    return active(qtype) and state.weights.on_amx(qtype)


# ---------------------------------------------------------------- operations


def matmul_rows(x: np.ndarray, w: "QTensor | QStack") -> np.ndarray:
    """x [R, cols] @ W.T -> float32 [R, rows] for any R, each row's outputs computed by one
    arithmetic whatever R is, so that a token's result does not depend on the rows that share
    its pass: Q4_K and Q6_K by super-blocks (integer sums, then one float step per 256 values:
    kernels/superblock.matmul_rows), the other block types by the 8-lane kernel's
    (matmul_few.matmul_lanes; a decode row takes kernels/matmul_out, the same bits with outputs
    in the lanes). Without the kernels, BLAS on fixed blocks of rows (fallback.matmul_rows).
    Written flat: a decode step calls it for every weight, with caches the weights' stream has
    just emptied, where each Python call costs several times its time in a loop."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"activations {x.shape} do not match weights of {w.shape[1]} columns")
    R = x.shape[0]
    out = np.empty((-(-R // 16) * 16, w.shape[0]), np.float32)  # the lanes kernels write all 8 or 16 of a block
    for run in w.runs:  # each on the kernels where they take its type, else on the numpy path
        if active(run.qtype) and (run.qtype in BLOCK_TYPES or x.shape[1] % 8 == 0):
            state.weights.every_row(run, x, out)
        else:
            _rows_numpy(run, x, out)
    return out[:R]


def _numpy_activations(run: KernelRun, x: np.ndarray) -> np.ndarray:
    return fallback.quantize_activations(x, activation_group(run.qtype)) if run.qtype in BLOCK_TYPES else x


def _rows_numpy(run: KernelRun, x: np.ndarray, out: np.ndarray):
    """matmul_rows's numpy path: each row's outputs the same bits whatever rows share the call."""
    xa = _numpy_activations(run, x)
    for t, col in zip(run.tensors, run.offs):
        fallback.matmul_rows(xa, t.data, t.qtype, _dequant(t), out, col, t.rows)


def weight_types(weights: Iterable) -> set[str]:
    """The types of the QTensors (and of the QStacks' tensors) among weights: what build.load() needs."""
    types: set[str] = set()
    for w in weights:
        if isinstance(w, QTensor):
            types.add(w.qtype)
        elif isinstance(w, QStack):
            types.update(t.qtype for t in w.tensors)
    return types


def pack(weights: dict, fingerprint: str) -> None:
    """Give each weight of a packed type (formats/packed) whose kernels are loaded its packed form now,
    as the model loads, mapped from LOCALKV_HOME/packed (pack_cache), not in the first step."""
    pack_cache.attach(weights, fingerprint, active)


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
