"""The CUDA backend's own launch code (localkv/backends/cuda*.py) for numpy arrays, on the
emulator: each function copies its inputs to the CuPy stand-in's device (a view, such as the
model's q slice of qkv, as the same view of a copy of its whole array), calls the backend's
function and copies the results back. The stand-in's fresh memory is NaN, so an element a kernel
fails to write shows. Call them inside `standin()`, which imports the backend against the
stand-in (as test_gpu.py and test_cuda_engine.py do, for the backend's other host code).

The backend's constants (warps, tile, query heads per block, threads, kernel list) are also read
here from cuda_kernels.py's source, for the tests that need them without importing it."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import cupy_standin
import numpy as np
from cupy_standin import swap

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


@contextlib.contextmanager
def standin():
    """The CUDA backend imported against the CuPy stand-in; with LKV_CUDA_EMU_SOURCES, its
    kernels compiled from that folder instead of cuda/."""
    with swap.standin():
        if os.environ.get("LKV_CUDA_EMU_SOURCES"):
            cuda_kernels = importlib.import_module("localkv.backends.cuda_kernels")
            cuda_kernels.cuda_source_dir = lambda: SOURCES
        yield


def backend(name: str):
    """A module of the CUDA backend (cuda, cuda_kv, cuda_attention), as standin() imported it."""
    module = importlib.import_module(f"localkv.backends.{name}")
    if module.cp is not cupy_standin:
        raise RuntimeError("cuda_emu.host runs the backend on the emulator: call it inside host.standin()")
    return module


def _device(a: np.ndarray):
    """(device array, its whole array's device copy, the whole host array): a view (of a
    C-contiguous array) becomes the same view, same offset and strides, of a copy of the whole."""
    whole = a
    while isinstance(whole.base, np.ndarray):
        whole = whole.base
    if whole is a or not whole.flags.c_contiguous:
        d = cupy_standin.asarray(a)
        return d, d, a
    w = cupy_standin.asarray(whole)
    offset = a.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    view = np.ndarray(a.shape, a.dtype, buffer=w._a, offset=offset, strides=a.strides)
    return cupy_standin.ndarray._of(view), w, whole


def _in_place(fn, *arrays: np.ndarray, rest=()):
    """fn on the device copies of arrays (and rest as they are), then the copies written back
    whole: what the kernel wrote outside a view shows too."""
    dev = [_device(a) for a in arrays]
    fn(*(d for d, _, _ in dev), *rest)
    for _, w, whole in dev:
        whole[...] = w.get()


def _host(*arrays):
    return tuple(a.get() for a in arrays)


# ---------------------------------------------------------------- element-wise (cuda.py: rmsnorm, rope, silu_mul)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return backend("cuda").rmsnorm(_device(x)[0], cupy_standin.asarray(w), eps).get()


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox") -> np.ndarray:
    """In place on x [T, heads, hd] (a strided view is fine, its last stride 1)."""
    _in_place(backend("cuda").rope, x, cos, sin, rest=(style,))
    return x


def silu_mul(gu: np.ndarray) -> np.ndarray:
    return backend("cuda").silu_mul(_device(gu)[0]).get()


# ---------------------------------------------------------------- the KV pool (cuda_kv.py: write_kv, copy_blocks)


def write_kv(k_layer, v_layer, slots, k, v) -> None:
    _in_place(backend("cuda_kv").write_kv, k_layer, v_layer, slots, k, v)


def copy_blocks(k_pool, v_pool, src, dst, n_tokens: int | None = None) -> None:
    _in_place(backend("cuda_kv").copy_blocks, k_pool, v_pool, rest=(src, dst, n_tokens))


# ---------------------------------------------------------------- attention (cuda_attention.py)


def decode(q, k_layer, v_layer, tables, lens, scale: float, max_ctx: int, **split):
    """cuda_attention.decode_kernels (paged_decode's kernel path): (out [B, H, hd] fp16, lse [B, H],
    partitions). split: cuda_attention.Split's knobs (part, sm_count) that the backend leaves
    to the device."""
    ca = backend("cuda_attention")
    d = [_device(a)[0] for a in (q, k_layer, v_layer, tables, lens)]
    r = ca.decode_kernels(*d, scale, max_ctx, split=ca.Split(**split))
    return (*_host(r.out, r.lse), r.parts)


def paged_attention(q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, **split):
    """cuda_attention.attention_kernels (paged_attention's kernel path): (out [T, H, hd] fp16, lse
    [T, H], partitions; 1 for prefill). mass [n_ctx] float32, if given, gets the attention each
    key received added; split as decode's."""
    ca = backend("cuda_attention")
    d = [_device(a)[0] for a in (q, k_layer, v_layer, block_table)]
    m = None if mass is None else cupy_standin.asarray(mass)
    r = ca.attention_kernels(*d, n_ctx, scale, m, split=ca.Split(**split))
    if mass is not None:
        mass[...] = m.get()
    return (*_host(r.out, r.lse), r.parts)
