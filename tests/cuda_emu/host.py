"""The kernel launches of the CUDA backend (localkv/backends/cuda*.py), restated for numpy arrays
on the emulator: each function launches a kernel with the grid, block, argument list and dtypes
the backend uses (each says which function it follows), with knobs the backend does not expose
(the SM count, the split-K partition size) and outputs that start as NaN. The backend's own host
code runs on the emulator too, through the CuPy stand-in (tests/cupy_standin; test_cuda_backend.py,
test_cuda_engine.py). Its constants (warps, tile, query heads per block, threads, kernel list) are
read from cuda_kernels.py's source, not repeated here."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from . import build
from .launch import Module

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "localkv" / "backends" / "cuda_kernels.py"
# the kernels' folder; LKV_CUDA_EMU_SOURCES points the tests at a modified copy (mutation testing)
SOURCES = Path(os.environ.get("LKV_CUDA_EMU_SOURCES") or ROOT / "cuda")


@dataclass(slots=True, frozen=True)
class Constants:
    kernels: dict[str, tuple[str, ...]]
    head_dims: tuple[int, ...]
    gmax: dict[int, int]
    decode_warps: int
    prefill_warps: int
    prefill_tile: int
    mass_warps: int
    qmv_warps: int
    qmv_lanes: int
    threads: int

    @property
    def defines(self) -> tuple[str, ...]:
        """cuda_kernels.DEFINES."""
        return (
            f"-DLKV_DECODE_WARPS={self.decode_warps}",
            f"-DLKV_PREFILL_WARPS={self.prefill_warps}",
            f"-DLKV_PREFILL_TILE={self.prefill_tile}",
            f"-DLKV_MASS_WARPS={self.mass_warps}",
            f"-DLKV_QMV_WARPS={self.qmv_warps}",
            f"-DLKV_QMV_LANES={self.qmv_lanes}",
        )


@cache
def constants() -> Constants:
    """cuda_kernels.py's literal module constants, read from its source (importing it needs CuPy)."""
    vals = {}
    for node in ast.parse(BACKEND.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.Assign):
            continue
        target = node.targets[0]
        names = [t.id for t in target.elts] if isinstance(target, ast.Tuple) else [getattr(target, "id", "")]
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        vals.update(zip(names, value) if len(names) > 1 else [(names[0], value)])
    return Constants(
        vals["KERNELS"],
        vals["KERNEL_HEAD_DIMS"],
        vals["GMAX"],
        vals["DECODE_WARPS"],
        vals["PREFILL_WARPS"],
        vals["PREFILL_TILE"],
        vals["MASS_WARPS"],
        vals["QMV_WARPS"],
        vals["QMV_LANES"],
        vals["THREADS"],
    )


@cache
def modules() -> dict[str, Module]:
    """cuda/*.cu built with the backend's defines, by file name (as cuda_kernels._module)."""
    built = build.build_files(sorted(SOURCES.glob("*.cu")), constants().defines)
    return {name: Module.from_built(b) for name, b in built.items()}


def kernel(fname: str, kname: str):
    if kname not in constants().kernels[fname]:
        raise KeyError(f"{kname} is not in cuda_kernels.KERNELS[{fname!r}]")
    return modules()[fname].get_function(kname)


def _grid1d(total: int) -> tuple[int]:
    return (max(1, min(65535, -(-total // constants().threads))),)


def _elem_strides(a: np.ndarray) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


# ---------------------------------------------------------------- element-wise (cuda.py: rmsnorm, rope, silu_mul)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = np.ascontiguousarray(x)
    R, D = x.shape
    out = np.full_like(x, np.nan)
    threads = constants().threads if constants().threads <= D else -(-D // 32) * 32
    k = kernel("fused_ops.cu", "rmsnorm_f16" if x.dtype == np.float16 else "rmsnorm_f32")
    k((R,), (threads,), (out, x, np.ascontiguousarray(w, np.float32), np.int32(D), np.float32(eps)))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox") -> np.ndarray:
    """In place on x [T, heads, hd] (a strided view is fine, its last stride 1); style "neox"
    (rope_*) or "normal" (rope_pairs_*)."""
    T, heads, hd = x.shape
    st = _elem_strides(x)
    half = hd // 2
    c, s = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
    stem = "rope" if style == "neox" else "rope_pairs"
    k = kernel("fused_ops.cu", f"{stem}_f16" if x.dtype == np.float16 else f"{stem}_f32")
    args = (x, c, s, np.int32(T), np.int32(heads), np.int32(half), np.int64(st[0]), np.int64(st[1]))
    k(_grid1d(T * heads * half), (constants().threads,), args)
    return x


def silu_mul(gu: np.ndarray) -> np.ndarray:
    gu = np.ascontiguousarray(gu)
    T, F = gu.shape[0], gu.shape[1] // 2
    out = np.full((T, F), np.nan, gu.dtype)
    k = kernel("fused_ops.cu", "silu_mul_f16" if gu.dtype == np.float16 else "silu_mul_f32")
    k(_grid1d(T * F), (constants().threads,), (out, gu, np.int32(T), np.int32(F)))
    return out


# ---------------------------------------------------------------- the KV pool (cuda_kv.py: write_kv, copy_blocks)


def _token_rows(a: np.ndarray, row: int) -> tuple[np.ndarray, int]:
    st = _elem_strides(a)
    if st[2] == 1 and st[1] == a.shape[2]:
        return a, st[0]
    return np.ascontiguousarray(a), row


def write_kv(k_layer, v_layer, slots, k, v) -> None:
    T = k.shape[0]
    row = k.shape[1] * k.shape[2]
    kk, ks = _token_rows(k, row)
    vv, vs = _token_rows(v.astype(k.dtype, copy=False), row)
    kern = kernel("kv_cache.cu", "write_kv_f16" if k.dtype == np.float16 else "write_kv_f32")
    args = (
        k_layer,
        v_layer,
        np.ascontiguousarray(slots, np.int64),
        kk,
        vv,
        np.int32(T),
        np.int32(row),
        np.int64(ks),
        np.int64(vs),
    )
    kern(_grid1d(T * row), (constants().threads,), args)


def copy_blocks(k_pool, v_pool, src, dst, n_tokens: int | None = None) -> None:
    L, nb, bs = k_pool.shape[:3]
    n = bs if n_tokens is None else n_tokens
    row = k_pool.shape[3] * k_pool.shape[4]
    args = (
        k_pool,
        v_pool,
        np.asarray(src, np.int32),
        np.asarray(dst, np.int32),
        np.int64(nb * bs * row),
        np.int64(bs * row),
        np.int64(n * row),
    )
    kernel("kv_cache.cu", "copy_blocks_f16")((len(src), L), (constants().threads,), args)


# ------------------------------------------------------- attention (cuda_attention.py: _launch_decode, paged_attention)


def q_rows(q: np.ndarray) -> tuple[np.ndarray, int]:
    """cuda_attention._q_rows: q itself when half2 loads can read it in place, else a contiguous copy."""
    T, H, hd = q.shape
    st = _elem_strides(q)
    if q.dtype == np.float16 and st[2] == 1 and st[1] == hd and st[0] % 2 == 0 and q.ctypes.data % 4 == 0:
        return q, st[0]
    return np.ascontiguousarray(q, np.float16), H * hd


def decode_partition(work_blocks: int, max_ctx: int, sm_count: int) -> tuple[int, int]:
    """cuda_attention._decode_partition for a GPU of sm_count SMs."""
    want = max(1, -(-4 * sm_count // max(1, work_blocks)))
    part = max(256, -(-max_ctx // want))
    part = -(-part // 64) * 64
    return part, max(1, -(-max_ctx // part))


def decode(
    q16,
    q_stride,
    k_layer,
    v_layer,
    tables,
    bt_stride,
    ctx_lens,
    ctx_fixed,
    scale,
    max_ctx,
    *,
    sm_count: int = 132,
    part: int | None = None,
):
    """cuda_attention._launch_decode: (out [B, H, hd] fp16, lse [B, H], partitions used). `part`
    overrides the partition size the backend would choose."""
    B, H, hd = q16.shape
    kvh, bs = k_layer.shape[2], k_layer.shape[1]
    c = constants()
    hchunks = -(-(H // kvh) // c.gmax[hd])
    if part is None:
        part, nparts = decode_partition(B * kvh * hchunks, max_ctx, sm_count)
    else:
        nparts = max(1, -(-max_ctx // part))
    out = np.full((B, H, hd), np.nan, np.float16)
    lse = np.full((B, H), np.nan, np.float32)
    if nparts == 1:
        part_acc = part_ml = lse  # never touched by the kernel when num_parts == 1
    else:
        part_acc = np.full((B, H, nparts, hd), np.nan, np.float32)
        part_ml = np.full((B, H, nparts, 2), np.nan, np.float32)
    args = (
        out,
        lse,
        part_acc,
        part_ml,
        q16,
        np.int64(q_stride),
        k_layer,
        v_layer,
        tables,
        np.int32(bt_stride),
        ctx_lens,
        np.int32(ctx_fixed),
        np.int32(H),
        np.int32(kvh),
        np.int32(bs),
        np.int32(part),
        np.int32(nparts),
        np.float32(scale),
    )
    kernel("paged_attention.cu", f"paged_decode_hd{hd}")((kvh * hchunks, B, nparts), (c.decode_warps * 32,), args)
    if nparts > 1:
        args = (
            out,
            lse,
            part_acc,
            part_ml,
            ctx_lens,
            np.int32(ctx_fixed),
            np.int32(H),
            np.int32(hd),
            np.int32(part),
            np.int32(nparts),
        )
        kernel("paged_attention.cu", "paged_decode_reduce")((H, B), (min(c.threads, -(-hd // 32) * 32),), args)
    return out, lse, nparts


def paged_attention(q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, **decode_kw):
    """cuda_attention.paged_attention on its kernel path: (out [T, H, hd] fp16, lse [T, H], partitions;
    1 for prefill). mass [n_ctx] float32, if given, gets the attention each key received added."""
    T, H, hd = q.shape
    kvh, bs = k_layer.shape[2], k_layer.shape[1]
    bt = np.ascontiguousarray(block_table, np.int32)
    q16, qs = q_rows(q)
    c = constants()
    if T == 1:
        out, lse, nparts = decode(q16, qs, k_layer, v_layer, bt, len(bt), bt, n_ctx, scale, n_ctx, **decode_kw)
    else:
        nparts = 1
        out = np.full((T, H, hd), np.nan, np.float16)
        lse = np.full((T, H), np.nan, np.float32)
        hchunks = -(-(H // kvh) // c.gmax[hd])
        args = (
            out,
            lse,
            q16,
            np.int64(qs),
            k_layer,
            v_layer,
            bt,
            np.int32(n_ctx),
            np.int32(T),
            np.int32(H),
            np.int32(kvh),
            np.int32(bs),
            np.float32(scale),
        )
        grid = (-(-T // c.prefill_warps), kvh * hchunks)
        kernel("paged_attention.cu", f"paged_prefill_hd{hd}")(grid, (c.prefill_warps * 32,), args)
    if mass is not None:
        args = (
            mass,
            lse,
            q16,
            np.int64(qs),
            k_layer,
            bt,
            np.int32(n_ctx),
            np.int32(T),
            np.int32(H),
            np.int32(kvh),
            np.int32(bs),
            np.float32(scale),
        )
        kernel("paged_attention.cu", f"attention_mass_hd{hd}")((-(-n_ctx // c.mass_warps),), (c.mass_warps * 32,), args)
    return out, lse, nparts
