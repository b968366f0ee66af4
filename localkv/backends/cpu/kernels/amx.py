"""Prefill matmuls on Intel AMX (Sapphire Rapids and later): bf16 tile multiplies.

Why: a prefill pass is matrix products of many rows, and float32 GEMM in OpenBLAS is the limit
of a CPU without a faster unit. AMX's tile unit multiplies bf16 pairs into float32 sums several
times faster (figures in BENCHMARKS.md), so where the CPU has it and Linux grants the process
the tile state, matmul_many multiplies block-type weights here instead of in BLAS.

Precision: both factors are rounded to bf16 (8 significant bits, ties to even), so each product
is within 2^-8 of its float32 value; the sums are float32. For block types that is finer than
the int8 rounding the activations already had (steps of amax/127 per group, as in decode and in
llama.cpp), and it did not move the real model's perplexity or its agreement with llama.cpp
(BENCHMARKS.md). Summing three bf16 products per pair instead (head and remainder of each
factor, "bf16x3") comes within 2^-16, but was slower for the same perplexity. So on an
AMX CPU prefill and decode agree to bf16 rounding, elsewhere to float summation order.
F16/BF16/F32 weights stay on BLAS: their activations are not rounded to int8 first, and bf16
would be coarser than the f16 activations llama.cpp multiplies them with (gemma2 in F16 fell
below the agreement with llama.cpp its test asks; BENCHMARKS.md has the figures).

Layout. tdpbf16ps multiplies tile A (16 rows of 32 bf16) by tile B (16 rows of 16 bf16 pairs)
into tile C (16 x 16 float32): C[i, j] += sum over r of A[i, 2r:2r+2] . B[r, 2j:2j+2].
A holds weight rows (out features) and B the activations, so C is a block of the transposed
result out_t [out, tokens] that matmul_many returns. The activations are packed once per call
(`pack`: per 16 tokens and 32 inputs, a 1 KiB tile: pair r of token j at 32r + 2j); a work
item decodes NC weight rows and rounds them into a buffer where each tile of 16 rows x 32
inputs is 1 KiB too (`_round_row`), then runs 2 x 2 output tiles at a time through all inputs.
Tiles 0-3 hold the sums, 4-5 the weights, 6-7 the activations.
"""

import ctypes
import os
import platform
import sys

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from localkv.backends.cpu.kernels import PAR, self_check
from localkv.backends.cpu.kernels.matmul_few import dequantize
from localkv.backends.cpu.quant.formats import MARKERS
from localkv.backends.cpu.quant.tensor import sample_weight
from localkv.backends.cpu.simd.amx import (
    float_bits,
    tile_config,
    tile_dot,
    tile_load,
    tile_release,
    tile_store,
    tile_zero,
)

NC = 128  # weight rows per work item: their tiles (512 KiB at 2048 inputs) stay in L2
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def enable() -> str | None:
    """Ask Linux for the tile state (needed once per process, before any tile op): None when
    the kernels can run here, else why not. LOCALKV_AMX=0 turns them off."""
    if os.environ.get("LOCALKV_AMX", "1").strip().lower() in ("0", "false", "no", "off"):
        return "LOCALKV_AMX=0"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not Linux on x86-64"
    import llvmlite.binding as llvm
    import numba

    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return "numba compiles for a named CPU (NUMBA_CPU_NAME/NUMBA_CPU_FEATURES), not this one"
    features = llvm.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-bf16")):
        return "the CPU has no AMX-BF16"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"the kernel refused the AMX tile state ({os.strerror(ctypes.get_errno())})"
    return None


@register_jitable(inline="always")
def _bf16(v):
    """v (float32) rounded to the nearest bf16, ties to even, as its 16 bits."""
    u = float_bits(v)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**PAR)
def pack(x, xt):
    """x [M, K] float32 (any layout) into xt [ceil(M / 32) * 2, K / 32, 512] uint16: the
    activation tiles; tokens past M are zero."""
    M, K = x.shape
    for mb in prange(xt.shape[0]):
        t = xt[mb].reshape(-1)
        for kb in range(K // 32):
            for j in range(16):  # a block of 16 tokens x 32 inputs: either order of x reads it by lines
                m = mb * 16 + j
                o = kb * 512 + 2 * j
                for k in range(32):
                    t[o + (k // 2) * 32 + k % 2] = _bf16(x[m, kb * 32 + k]) if m < M else 0


@register_jitable
def _config():
    """Palette 1, all eight tiles 16 rows of 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    return cfg


@register_jitable(inline="always")
def _round_row(row, i, wt):
    """A weight row (float32 [K]) as row i of a work item's tiles of 16 rows x 32 inputs:
    element k at (k // 32) * NC * 32 + i * 32 + k % 32."""
    for kb in range(len(row) // 32):
        o = kb * NC * 32 + i * 32
        for k in range(32):
            wt[o + k] = _bf16(row[kb * 32 + k])


@register_jitable(inline="always")
def _zero_rows(rows, K, wt):
    """Rows past the weight's end, in its last work item: zero."""
    for i in range(rows, NC):
        for kb in range(K // 32):
            o = kb * NC * 32 + i * 32
            wt[o : o + 32] = 0


@register_jitable(inline="always")
def _products(wt, xt, wo, xo0, xo1, KB):
    """Tiles 0-3 = the 2 x 2 blocks of 16 weight rows x 16 tokens, summed over all inputs."""
    tile_zero(0)
    tile_zero(1)
    tile_zero(2)
    tile_zero(3)
    for kb in range(KB):
        tile_load(4, wt, kb * NC * 32 + wo, 64)
        tile_load(5, wt, kb * NC * 32 + wo + 512, 64)
        tile_load(6, xt, xo0 + kb * 512, 64)
        tile_load(7, xt, xo1 + kb * 512, 64)
        tile_dot(0, 4, 6)
        tile_dot(1, 4, 7)
        tile_dot(2, 5, 6)
        tile_dot(3, 5, 7)


@register_jitable(inline="always")
def _store(out_t, n, m, tmp):
    """Tiles 0-3 into out_t[n:n + 32, m:m + 32]; through tmp where that block crosses an edge."""
    N, M = out_t.shape
    if n + 32 <= N and m + 32 <= M:
        tile_store(0, out_t, n * M + m, M * 4)
        tile_store(1, out_t, n * M + m + 16, M * 4)
        tile_store(2, out_t, (n + 16) * M + m, M * 4)
        tile_store(3, out_t, (n + 16) * M + m + 16, M * 4)
        return
    tile_store(0, tmp, 0, 128)
    tile_store(1, tmp, 16, 128)
    tile_store(2, tmp, 512, 128)
    tile_store(3, tmp, 528, 128)
    for i in range(min(32, N - n)):
        for j in range(min(32, M - m)):
            out_t[n + i, m + j] = tmp[i * 32 + j]


@register_jitable
def _item(wt, xt, out_t, n0, rows, K):
    """The outputs of a work item's weight rows (rounded into wt) for all tokens."""
    KB = K // 32
    xs = KB * 512  # elements per 16 tokens of packed activations
    tmp = np.empty(1024, np.float32)
    tile_config(_config())
    for mb in range(0, len(xt) // xs, 2):
        for nb in range((rows + 31) // 32):
            _products(wt, xt, nb * 1024, mb * xs, mb * xs + xs, KB)
            _store(out_t, n0 + nb * 32, mb * 16, tmp)
    tile_release()


@njit(**PAR)
def gemm(qt, w, K, xt, out_t):
    """out_t [N, M] = W @ x.T for a weight of block type qt (its blocks w [N, bytes per row], K
    values a row) and activations packed by `packed`. Each row is decoded (matmul_few.dequantize)
    just before it is rounded: the work items decode on all threads, and no float32 copy of
    the weight leaves the cache. N need not be a multiple of anything."""
    N = w.shape[0]
    ids = np.arange(N)
    for c in prange((N + NC - 1) // NC):
        n0 = c * NC
        rows = min(NC, N - n0)
        wt = np.empty(K * NC, np.uint16)
        row = np.empty((1, K), np.float32)
        for i in range(rows):
            dequantize(qt, w, ids[n0 + i : n0 + i + 1], row)
            _round_row(row[0], i, wt)
        _zero_rows(rows, K, wt)
        _item(wt, xt, out_t, n0, rows, K)


def packed(x: np.ndarray) -> np.ndarray:
    """The activations x [M, K] as the gemms take them (flat)."""
    M, K = x.shape
    xt = np.empty(((M + 31) // 32 * 2, K // 32, 512), np.uint16)
    pack(x, xt)
    return xt.reshape(-1)


def multiply(qtype: str, data: np.ndarray, cols: int, xt: np.ndarray, out_t: np.ndarray):
    """out_t = W @ x.T for a block-type weight W (its blocks `data`, `cols` values a row) and
    packed activations."""
    gemm(MARKERS[qtype], data, cols, xt, out_t)


def bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """How far x @ w.T here may be from exact, per output: each product within 2^-8 (both
    factors rounded to bf16, 2^-9 each), float32 sums."""
    return 2.0**-8 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)) + 1e-30


@self_check("amx")
def check(qtype: str) -> bool:
    """Compile (or load) pack, for both orders of x, and this type's gemm, and check them
    against float64 products on the decoded weight: shapes that are not multiples of the
    tiles, more than one work item, a read-only weight (as the mapped file's are: the build
    the model runs)."""
    w = sample_weight(qtype, NC + 45, 256, 3)
    w.data.flags.writeable = False
    dense = np.empty(w.shape, np.float32)
    dequantize(MARKERS[qtype], w.data, np.arange(w.rows), dense)
    x = np.random.default_rng(8).standard_normal((37, w.cols), dtype=np.float32)
    xt = packed(x)
    if not np.array_equal(packed(np.asfortranarray(x)), xt):  # prefill passes give either order
        return False
    out_t = np.full((w.rows, len(x)), np.nan, np.float32)
    multiply(qtype, w.data, w.cols, xt, out_t)
    return bool((np.abs(out_t.T - x.astype(np.float64) @ dense.T.astype(np.float64)) <= bound(x, dense)).all())
