"""Quantized weights on the GPU: a GGUF weight's blocks go to the device as they are (uint8) and
are decoded inside the kernels of cuda/quant_matvec.cu:
- decode steps (1-8 activation rows): one matvec kernel reads the blocks once;
- more rows (prefill): tiles of the weight are dequantized to fp16 and multiplied by cuBLAS
  (x @ tile.T), so the device never holds a whole fp16 copy of a large matrix;
- embedding rows: dequantized by id.
Types without kernels (see QUANT_TYPES) and float weights go to the device as fp16 matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from localkv.backends.cpu.quant import QStack, QTensor, dequantize_rows
from localkv.backends.cuda_kernels import F16, F32, QMV_LANES, QMV_WARPS, QUANT_TYPES, THREADS, kernel, ptr

MAX_ROWS = 8  # activation rows of the matvec kernels (LKV_QMV_MAX_ROWS in the .cu)
ROWS_PER_BLOCK = QMV_WARPS * 32 // QMV_LANES  # weight rows per thread block of the matvec kernels
TILE_VALUES = 1 << 23  # weight values per dequantized fp16 tile (16 MiB)
DEQUANT_GROUPS = 4  # groups of 32 values per thread of the dequantize kernels


@dataclass(frozen=True, slots=True)
class DeviceQ:
    """A weight [rows, cols] as GGUF blocks on the device: blocks uint8 [rows, row_bytes]."""

    blocks: cp.ndarray
    qtype: str
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols


@dataclass(frozen=True, slots=True)
class DeviceStack:
    """Weights of one input multiplied together, outputs side by side: DeviceQ or fp16 [rows,
    cols] parts (a QStack whose weights differ in type, e.g. q/k Q4_K and v Q6_K)."""

    parts: tuple
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols


def upload(w: QTensor | QStack):
    """A QTensor or QStack on the device: DeviceQ for types with kernels, fp16 matrices for the
    others; a QStack's consecutive weights of one type become one matrix (their rows stacked)."""
    tensors = w.tensors if isinstance(w, QStack) else (w,)
    runs: list[list[QTensor]] = []
    for t in tensors:
        if runs and _kind(runs[-1][0]) == _kind(t):
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = tuple(_upload_run(run) for run in runs)
    if len(parts) == 1:
        return parts[0]
    return DeviceStack(parts, sum(p.shape[0] for p in parts), tensors[0].cols)


def _kind(t: QTensor) -> str:
    return t.qtype if t.qtype in QUANT_TYPES else "fp16"


def _upload_run(run: list[QTensor]):
    rows, cols = sum(t.rows for t in run), run[0].cols
    if _kind(run[0]) != "fp16":
        data = run[0].data if len(run) == 1 else np.concatenate([t.data for t in run])
        return DeviceQ(cp.asarray(data), run[0].qtype, rows, cols)
    out = cp.empty((rows, cols), cp.float16)
    r = 0
    for t in run:  # dequantized on the host a tile at a time: no fp32 copy of the whole weight
        step = max(1, TILE_VALUES // cols)
        for r0 in range(0, t.rows, step):
            r1 = min(t.rows, r0 + step)
            out[r + r0 : r + r1] = cp.asarray(dequantize_rows(t, r0, r1).astype(np.float16))
        r += t.rows
    return out


def is_device_quant(w) -> bool:
    return isinstance(w, (DeviceQ, DeviceStack))


def _fn(w: DeviceQ, kind: str):
    return kernel("quant_matvec.cu", f"{kind}_{w.qtype.lower()}")


def _activations(x):
    """x as the kernels read it: fp16, C-contiguous, 4-byte aligned."""
    if x.dtype == F16 and x.flags.c_contiguous and ptr(x) % 4 == 0:
        return x
    return cp.ascontiguousarray(x, dtype=cp.float16)


def matmul(x, w: DeviceQ | DeviceStack, out_dtype=np.float16):
    """x [R, cols] @ W.T -> [R, rows] in out_dtype (fp16 or fp32)."""
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"activations {x.shape} do not match a weight of {w.cols} columns")
    out = cp.empty((x.shape[0], w.rows), out_dtype)
    if x.shape[0] == 0:
        return out
    x = _activations(x)
    if isinstance(w, DeviceQ):
        _matmul_into(out, x, w)
        return out
    c = 0
    for p in w.parts:
        r = p.shape[0]
        if isinstance(p, DeviceQ):
            _matmul_into(out[:, c : c + r], x, p)
        else:
            out[:, c : c + r] = x @ p.T
        c += r
    return out


def _matmul_into(out, x, w: DeviceQ) -> None:
    """out [R, w.rows] (rows out.strides[0] apart, fp16 or fp32) = x @ W.T."""
    R = x.shape[0]
    if R <= MAX_ROWS:
        ld_out = out.strides[0] // out.itemsize
        args = (out, np.int32(out.dtype == F32), np.int64(ld_out), x, np.int64(x.shape[1]), np.int32(R))
        args += (w.blocks, np.int32(w.rows), np.int32(w.cols), np.int64(w.blocks.shape[1]))
        _fn(w, "quant_matvec")((-(-w.rows // ROWS_PER_BLOCK),), (QMV_WARPS * 32,), args)
        return
    step = max(1, TILE_VALUES // w.cols)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        tile = dequantize(w, cp.arange(r0, r1, dtype=cp.int32))
        out[:, r0:r1] = (x @ tile.T).astype(out.dtype, copy=False)


def dequantize(w: DeviceQ, ids) -> cp.ndarray:
    """Rows ids (device int32) of W as fp16 [len(ids), cols]."""
    ids = cp.ascontiguousarray(cp.asarray(ids, dtype=cp.int32))
    n = len(ids)
    out = cp.empty((n, w.cols), cp.float16)
    if n:
        args = (out, np.int64(w.cols), w.blocks, ids, np.int32(n), np.int32(w.cols), np.int64(w.blocks.shape[1]))
        groups = n * (w.cols // 32)  # a thread decodes DEQUANT_GROUPS of them (the kernel's grid-stride loop)
        _fn(w, "dequant_f16")((max(1, min(65535, -(-groups // (THREADS * DEQUANT_GROUPS)))),), (THREADS,), args)
    return out


def rows(w: DeviceQ | DeviceStack, ids) -> cp.ndarray:
    """Embedding lookup: rows ids of W as fp16 [len(ids), cols]."""
    if isinstance(w, DeviceStack):
        raise ValueError("an embedding table is one weight, not a stack")
    ids = cp.asarray(ids)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= w.rows):
        raise ValueError(f"token ids must be in 0..{w.rows - 1}")
    return dequantize(w, ids)
