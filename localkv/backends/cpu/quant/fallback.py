"""The numpy-only path (no numba, or LOCALKV_CPU_KERNELS=0): gguf's dequantizer on tiles of
weight rows, then BLAS. Slower, same results as the kernels within float rounding: for block
types the activations are quantized to int8 exactly as the kernels do (`quantize_activations`,
per `types.activation_group` values), so both paths compute the same sums. `matmul_rows` is
the product, its rows independent of the rows beside them (the one arithmetic, docs/CPU.md).
"""

import numpy as np

from localkv import gguf_py

# Weights per dequantized tile (16 MiB of float32) of quant.dequantize
TILE_VALUES = 1 << 22
# matmul_rows multiplies blocks of this many activation rows: one BLAS call shape for every row
# count (a single row would otherwise take OpenBLAS's gemv, which sums in another order)
ROW_BLOCK = 16
ROWS_TILE_VALUES = 1 << 18  # its tiles: small enough to stay in cache for every block of rows


def tile_rows(cols: int, values: int | None = None) -> int:
    return max(64, (TILE_VALUES if values is None else values) // cols)


def quantize_activations(x, group: int = 32, xp=np):
    """x [..., K] float32 with each `group` values rounded to int8 steps of amax/127 (as float32:
    q * d, q = rint(x * (1 / d))); a group of zeros stays 0, one holding inf or nan becomes nan.
    Also the query rows a q8_0 / q4_0 K multiplies (group 32: the CPU kernels' integer scores,
    kernels/key_scores), for the numpy and CuPy attention; xp: the array module of x."""
    xb = x.reshape(*x.shape[:-1], -1, group)
    amax = xp.abs(xb).max(axis=-1, keepdims=True)  # inf or nan: d too, so q * d is nan
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = xp.where(amax > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        return (xp.rint(xb * inv) * d).astype(np.float32, copy=False).reshape(x.shape)


def dequantize_rows(data: np.ndarray, qtype: str, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows r0..r1 of a weight's data as float32 into out [r1 - r0, cols]."""
    rows = data[r0:r1]
    if qtype == "F32" or qtype == "F16":
        out[...] = rows
    elif qtype == "BF16":
        out[...] = (rows.astype(np.uint32) << 16).view(np.float32)
    else:
        out[...] = gguf_py.dequantize(rows, qtype)
    return out


def get_rows(data: np.ndarray, qtype: str, ids: np.ndarray, cols: int) -> np.ndarray:
    """Rows ids as float32 [len(ids), cols]: the picked rows copied out, then decoded at once."""
    return dequantize_rows(data[ids], qtype, 0, len(ids), np.empty((len(ids), cols), np.float32))


def matmul_rows(x: np.ndarray, data: np.ndarray, qtype: str, dequant, out: np.ndarray, col: int, rows: int):
    """out[:R, col : col + rows] = x @ W.T for x [R, cols] (C-contiguous float32), each row's
    outputs one function of that row alone: x padded with zero rows to blocks of ROW_BLOCK,
    W dequantized in tiles that depend only on its shape, and every BLAS call one tile times
    one block (W @ block.T, the faster order), whatever R is."""
    R, cols = x.shape
    if R % ROW_BLOCK:
        x = np.concatenate((x, np.zeros((ROW_BLOCK - R % ROW_BLOCK, cols), np.float32)))
    step = rows if qtype == "F32" else tile_rows(cols, ROWS_TILE_VALUES)
    tile = None if qtype == "F32" else np.empty((min(step, rows), cols), np.float32)
    block = np.empty((min(step, rows), ROW_BLOCK), np.float32)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = data[r0:r1] if tile is None else dequant(r0, r1, tile[: r1 - r0])
        for b in range(0, R, ROW_BLOCK):
            n = min(R - b, ROW_BLOCK)
            np.matmul(w, x[b : b + ROW_BLOCK].T, out=block[: r1 - r0])
            out[b : b + n, col + r0 : col + r1] = block[: r1 - r0, :n].T
    return out
