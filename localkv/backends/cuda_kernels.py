"""The CUDA kernels of the GPU backend: which exist (KERNELS), the compile-time constants they
are built with, and loading them: the cuda/*.cu sources compiled by CuPy's RawModule (NVRTC)
on first use and cached by CuPy on disk.

The literal constants here (KERNELS, KERNEL_HEAD_DIMS, GMAX, the warp/tile counts, THREADS) are
also read from this file's source by tests/backends/test_cuda_compile.py and tests/cuda_emu/host.py,
without importing it: keep them literal.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import cupy as cp

KERNEL_HEAD_DIMS = (32, 64, 96, 128, 256)
GMAX = {32: 8, 64: 8, 96: 8, 128: 8, 256: 4}  # query heads per thread block (per KV head), as in the .cu
DECODE_WARPS, PREFILL_WARPS, PREFILL_TILE, MASS_WARPS = 4, 8, 32, 4
QMV_WARPS, QMV_LANES = 4, 4  # quant_matvec.cu: warps per thread block of the matvec kernels, lanes per weight row
THREADS = 256  # threads per block of the element-wise kernels
# K/V row formats the kernels write and read: kv_format name -> the kf / vf code (LKV_KV_* in the .cu)
KV_FORMATS = {"f16": 0, "q8_0": 1, "q4_0": 2}
KV_PAIRS = ("f16", "q8_0", "q4_0", "q8_0:q4_0")  # (K, V) pairs with kernels (lkv_kv_formats); others: CuPy
DEFINES = (
    f"-DLKV_DECODE_WARPS={DECODE_WARPS}",
    f"-DLKV_PREFILL_WARPS={PREFILL_WARPS}",
    f"-DLKV_PREFILL_TILE={PREFILL_TILE}",
    f"-DLKV_MASS_WARPS={MASS_WARPS}",
    f"-DLKV_QMV_WARPS={QMV_WARPS}",
    f"-DLKV_QMV_LANES={QMV_LANES}",
)

# weight types with kernels in quant_matvec.cu (GGUF names); other types go to the device as fp16
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# every kernel the backend launches, by source file (tests/backends/test_cuda_compile.py checks the names)
KERNELS = {
    "paged_attention.cu": (
        "paged_decode_hd32",
        "paged_decode_hd64",
        "paged_decode_hd96",
        "paged_decode_hd128",
        "paged_decode_hd256",
        "paged_decode_reduce",
        "paged_prefill_hd32",
        "paged_prefill_hd64",
        "paged_prefill_hd96",
        "paged_prefill_hd128",
        "paged_prefill_hd256",
        "attention_mass_hd32",
        "attention_mass_hd64",
        "attention_mass_hd96",
        "attention_mass_hd128",
        "attention_mass_hd256",
    ),
    "kv_cache.cu": (
        "write_kv_f16",
        "write_kv_f32",
        "copy_blocks_f16",
        "write_rows_q8_0_f16",
        "write_rows_q8_0_f32",
        "write_rows_q4_0_f16",
        "write_rows_q4_0_f32",
    ),
    "fused_ops.cu": (
        "rmsnorm_f16",
        "rmsnorm_f32",
        "rope_f16",
        "rope_f32",
        "rope_pairs_f16",
        "rope_pairs_f32",
        "silu_mul_f16",
        "silu_mul_f32",
    ),
    "quant_matvec.cu": (
        "quant_matvec_q4_0",
        "quant_matvec_q4_1",
        "quant_matvec_q5_0",
        "quant_matvec_q5_1",
        "quant_matvec_q8_0",
        "quant_matvec_q2_k",
        "quant_matvec_q3_k",
        "quant_matvec_q4_k",
        "quant_matvec_q5_k",
        "quant_matvec_q6_k",
        "dequant_f16_q4_0",
        "dequant_f16_q4_1",
        "dequant_f16_q5_0",
        "dequant_f16_q5_1",
        "dequant_f16_q8_0",
        "dequant_f16_q2_k",
        "dequant_f16_q3_k",
        "dequant_f16_q4_k",
        "dequant_f16_q5_k",
        "dequant_f16_q6_k",
    ),
}


def cuda_source_dir() -> Path:
    """The folder holding the .cu files: localkv/cuda in an installed package (the repo's cuda/
    folder is packaged as localkv.cuda), else the cuda/ folder of a source checkout (an
    editable install cannot import the namespace package localkv.cuda)."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "cuda", here.parent.parent / "cuda"):
        if (d / "paged_attention.cu").is_file():
            return d
    raise RuntimeError(f"the CUDA kernel sources (paged_attention.cu) are in neither {here.parent / 'cuda'} nor "
                       f"{here.parent.parent / 'cuda'}: reinstall localkv")  # fmt: skip


@cache
def _include_options() -> tuple[str, ...]:
    """-I for the folder with cuda_fp16.h: NVRTC has no default include path of its own."""
    dirs = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        dirs.append(find_nvidia_header_directory("cudart"))
    except Exception:
        pass
    try:
        dirs.append(os.path.join(cp.cuda.get_cuda_path() or "", "include"))
    except Exception:
        pass
    dirs += [os.path.join(os.environ.get(v, ""), "include") for v in ("CUDA_PATH", "CUDA_HOME")]
    dirs.append("/usr/local/cuda/include")
    try:
        major = cp.cuda.runtime.runtimeGetVersion() // 1000  # CuPy's CUDA major version
    except Exception:
        major = None
    for d in dirs:
        if d and os.path.isfile(os.path.join(d, "cuda_fp16.h")) and _headers_major(d) in (major, None):
            return (f"-I{d}",)
    return ()  # rely on the include path CuPy adds itself


def _headers_major(include_dir: str) -> int | None:
    """The CUDA major version of a toolkit include folder (from cuda.h), None when unknown: a
    CUDA 13 cuda_fp16.h does not belong in a CUDA 12 NVRTC compile."""
    try:
        with open(os.path.join(include_dir, "cuda.h"), encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("#define CUDA_VERSION"):
                    return int(line.split()[2]) // 1000
    except (OSError, ValueError, IndexError):
        pass
    return None


@cache
def _module(fname: str):
    code = (cuda_source_dir() / fname).read_text(encoding="utf-8")
    return cp.RawModule(code=code, options=("--std=c++17", *DEFINES, *_include_options()))


@cache
def kernel(fname: str, kname: str):
    """A kernel by source file and name (compiled with its file on first use)."""
    if kname not in KERNELS[fname]:
        raise RuntimeError(f"kernel {kname} is not listed in KERNELS[{fname!r}] (a bug in the caller's logic)")
    return _module(fname).get_function(kname)


def compile_all() -> list[str]:
    """Compile and load every kernel now (first use otherwise); returns the kernel names."""
    names = []
    for fname, knames in KERNELS.items():
        for kname in knames:
            kernel(fname, kname)
            names.append(kname)
    return names


@cache
def sm_count(dev: int) -> int:
    return cp.cuda.Device(dev).attributes["MultiProcessorCount"]


# ---------------------------------------------------------------- launch helpers

F16, F32 = cp.dtype(cp.float16), cp.dtype(cp.float32)


def grid1d(total: int) -> tuple[int]:
    """Blocks of THREADS for a grid-stride loop over `total` items."""
    return (max(1, min(65535, -(-total // THREADS))),)


def dev(a, dtype=None):
    """a as a C-contiguous device array (no copy when it already is one of that dtype)."""
    return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))


def ptr(a) -> int:
    return a.data.ptr


def elem_strides(a) -> tuple[int, ...] | None:
    """Strides in elements, or None when one is negative or not a whole number of elements."""
    out = []
    for s in a.strides:
        if s < 0 or s % a.itemsize:
            return None
        out.append(s // a.itemsize)
    return tuple(out)
