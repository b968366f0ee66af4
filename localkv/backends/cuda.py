"""The CuPy backend: the CPU backend's op set on an NVIDIA GPU, same functions, same shapes.

Dtypes, and why:
- weights fp16 (upload_weights; 1-D norm weights stay fp32): `x @ w` in the model runs through
  cuBLAS on tensor cores with fp32 accumulation;
- activations fp16 (act_dtype): the model is backend-neutral and multiplies activations by the
  weights as they are, so fp16 activations keep every matmul fp16 x fp16 (fp32 activations would
  make CuPy upcast the weight on every call). The residual stream is therefore fp16, unlike
  llama.cpp's fp32; every fused kernel (RMSNorm, RoPE, SiLU, attention) computes in fp32;
- the KV pool is fp16 (kv_dtype); attention accumulates in fp32 (online softmax).

Kernels live in cuda/*.cu (NVRTC-compatible, extern "C"), compiled on first use by CuPy's
RawModule and cached by CuPy on disk. Paged attention: a split-K decode kernel (one query token per
sequence, batched over sequences, flash-decoding partials + a reduce kernel), a prefill kernel for a
chunk (causal within the chunk, attends to every cached block), an attention-mass kernel (H2O).
Head dims with kernels: KERNEL_HEAD_DIMS; other head dims, or arrays of other dtypes/layouts, fall
back to plain CuPy array code with the numpy backend's algorithm (correct, slower).

Beyond the CPU's op set: paged_decode (one launch for a batch of single-token sequences, used for
every decode step without extra keys) and copy_blocks (the pool's copy-on-write in one launch).

UNVERIFIED: written and compile-checked (nvcc and NVRTC, sm_80/sm_90) without a GPU; nothing here
has run on one yet. tests/test_gpu.py and scripts/gpu_check.sh are the checks to run on a GPU.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import cupy as cp
import numpy as np

xp = cp
name = "CUDA"
act_dtype = np.float16  # activations (see the module docstring)
kv_dtype = np.float16  # the KV pool

KERNEL_HEAD_DIMS = (32, 64, 96, 128, 256)
_GMAX = {32: 8, 64: 8, 96: 8, 128: 8, 256: 4}  # query heads per thread block (per KV head), as in the .cu
DECODE_WARPS, PREFILL_WARPS, PREFILL_TILE, MASS_WARPS = 4, 8, 32, 4
_DEFINES = (
    f"-DLKV_DECODE_WARPS={DECODE_WARPS}",
    f"-DLKV_PREFILL_WARPS={PREFILL_WARPS}",
    f"-DLKV_PREFILL_TILE={PREFILL_TILE}",
    f"-DLKV_MASS_WARPS={MASS_WARPS}",
)

# every kernel this module launches, by source file (tests/test_cuda_compile.py checks the names)
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
    "kv_cache.cu": ("write_kv_f16", "write_kv_f32", "copy_blocks_f16"),
    "fused_ops.cu": ("rmsnorm_f16", "rmsnorm_f32", "rope_f16", "rope_f32", "silu_mul_f16", "silu_mul_f32"),
}

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_THREADS = 256


# ---------------------------------------------------------------- kernel loading


def cuda_source_dir():
    """The folder holding the .cu files: the installed package data (the repo's cuda/ folder
    packaged as localkv.cuda), else the cuda/ folder of a source checkout."""
    from importlib.resources import files

    for package in ("localkv.cuda", "localkv.kernels"):
        try:
            root = files(package)
            if (root / "paged_attention.cu").is_file():
                return root
        except (ModuleNotFoundError, TypeError):
            continue
    return Path(__file__).resolve().parent.parent / "cuda"


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
def _module(fname: str) -> cp.RawModule:
    code = (cuda_source_dir() / fname).read_text(encoding="utf-8")
    return cp.RawModule(code=code, options=("--std=c++17", *_DEFINES, *_include_options()))


@cache
def _kernel(fname: str, kname: str):
    if kname not in KERNELS[fname]:
        raise RuntimeError(f"kernel {kname} is not listed in KERNELS[{fname!r}] (a bug in the caller's logic)")
    return _module(fname).get_function(kname)


def compile_all():
    """Compile and load every kernel now (first use otherwise); returns the kernel names."""
    names = []
    for fname, knames in KERNELS.items():
        for kname in knames:
            _kernel(fname, kname)
            names.append(kname)
    return names


@cache
def _sm_count(dev: int) -> int:
    return cp.cuda.Device(dev).attributes["MultiProcessorCount"]


def _grid1d(total: int) -> tuple[int]:
    return (max(1, min(65535, -(-total // _THREADS))),)


def _dev(a, dtype=None) -> cp.ndarray:
    """a as a C-contiguous device array (no copy when it already is one of that dtype)."""
    return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))


def _ptr(a) -> int:
    return a.data.ptr


def _elem_strides(a) -> tuple[int, ...] | None:
    """Strides in elements, or None when one is negative or not a whole number of elements."""
    out = []
    for s in a.strides:
        if s < 0 or s % a.itemsize:
            return None
        out.append(s // a.itemsize)
    return tuple(out)


# ---------------------------------------------------------------- element-wise ops


def rmsnorm(x, w, eps: float):
    if x.ndim != 2 or x.dtype not in (_F16, _F32) or x.shape[0] == 0 or x.shape[1] == 0:
        return _rmsnorm_xp(x, w, eps)
    x = cp.ascontiguousarray(x)
    w = _dev(w, np.float32)
    R, D = x.shape
    out = cp.empty_like(x)
    threads = _THREADS if D >= _THREADS else -(-D // 32) * 32
    k = _kernel("fused_ops.cu", "rmsnorm_f16" if x.dtype == _F16 else "rmsnorm_f32")
    k((R,), (threads,), (out, x, w, np.int32(D), np.float32(eps)))
    return out


def _rmsnorm_xp(x, w, eps):
    xf = x.astype(cp.float32)
    ms = (xf * xf).mean(axis=-1, keepdims=True)
    return (xf / cp.sqrt(ms + eps) * cp.asarray(w, dtype=cp.float32)).astype(x.dtype)


def rope_tables(head_dim: int, max_pos: int, theta: float):
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))


def rope(x, cos, sin):
    """Rotate halves ("NEOX" order) of x [T, heads, hd] in place (x may be a strided view, as the
    model's q/k slice of qkv is); cos/sin [T, hd/2]."""
    T, heads, hd = x.shape
    st = _elem_strides(x)
    if x.dtype not in (_F16, _F32) or hd % 2 or st is None or st[2] != 1 or x.size == 0:
        return _rope_xp(x, cos, sin)
    half = hd // 2
    c, s = _dev(cos, np.float32), _dev(sin, np.float32)
    if c.shape != (T, half) or s.shape != (T, half):
        raise ValueError(f"rope: cos/sin must be [{T}, {half}], got {c.shape} and {s.shape}")
    k = _kernel("fused_ops.cu", "rope_f16" if x.dtype == _F16 else "rope_f32")
    k(
        _grid1d(T * heads * half),
        (_THREADS,),
        (x, c, s, np.int32(T), np.int32(heads), np.int32(half), np.int64(st[0]), np.int64(st[1])),
    )
    return x


def _rope_xp(x, cos, sin):
    h = x.shape[-1] // 2
    c, s = cp.asarray(cos)[:, None, :], cp.asarray(sin)[:, None, :]
    x1, x2 = x[..., :h].astype(cp.float32), x[..., h:].astype(cp.float32)
    x[..., :h] = x1 * c - x2 * s
    x[..., h:] = x2 * c + x1 * s
    return x


def linear(x, w, kind: str):
    """x [T, in] @ w.T for a weight stored [out, in]: one cuBLAS gemm at any T (it takes the
    transpose as a flag); kind is for the CPU backend."""
    return x @ w.T


def begin_forward(rows: int):
    """Nothing to set up per forward pass on the GPU (the CPU backend picks BLAS threads)."""


def uses_kernels(rows: int) -> bool:
    """The CPU backend's few-row kernels: not used here."""
    return False


def silu_mul(gu):
    if gu.ndim != 2 or gu.dtype not in (_F16, _F32) or gu.shape[1] % 2 or gu.size == 0:
        f = gu.shape[-1] // 2
        g, u = gu[..., :f].astype(cp.float32), gu[..., f:].astype(cp.float32)
        return (g / (1.0 + cp.exp(-g)) * u).astype(gu.dtype)
    gu = cp.ascontiguousarray(gu)
    T, F = gu.shape[0], gu.shape[1] // 2
    out = cp.empty((T, F), gu.dtype)
    k = _kernel("fused_ops.cu", "silu_mul_f16" if gu.dtype == _F16 else "silu_mul_f32")
    k(_grid1d(T * F), (_THREADS,), (out, gu, np.int32(T), np.int32(F)))
    return out


# ---------------------------------------------------------------- the KV pool


def _pool_layer_ok(layer) -> bool:
    return (
        layer.dtype == _F16
        and layer.ndim == 4
        and layer.flags.c_contiguous
        and _ptr(layer) % 4 == 0
        and layer.shape[3] % 2 == 0
    )


def _token_rows(a, row: int):
    """a [T, kvh, hd] as (array, token stride in elements) with each token's kvh*hd values
    contiguous: a itself when it already is (a slice of qkv is), else a contiguous copy."""
    st = _elem_strides(a)
    if st is not None and st[2] == 1 and st[1] == a.shape[2]:
        return a, st[0]
    return cp.ascontiguousarray(a), row


def write_kv(k_layer, v_layer, slots, k, v):
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool.
    Negative slots are skipped (padding rows of a fixed-size batch)."""
    T = k.shape[0]
    if T == 0:
        return
    fast = (
        _pool_layer_ok(k_layer)
        and _pool_layer_ok(v_layer)
        and k.dtype in (_F16, _F32)
        and k.shape == v.shape
        and k.shape[1:] == k_layer.shape[2:]
    )
    if not fast:
        nb, bs = k_layer.shape[:2]
        idx = cp.asarray(slots)
        k_layer.reshape(nb * bs, *k_layer.shape[2:])[idx] = k
        v_layer.reshape(nb * bs, *v_layer.shape[2:])[idx] = v
        return
    row = k.shape[1] * k.shape[2]
    if v.dtype != k.dtype:
        v = v.astype(k.dtype)
    kk, ks = _token_rows(k, row)
    vv, vs = _token_rows(v, row)
    sl = _dev(slots, np.int64)
    kern = _kernel("kv_cache.cu", "write_kv_f16" if k.dtype == _F16 else "write_kv_f32")
    kern(
        _grid1d(T * row),
        (_THREADS,),
        (k_layer, v_layer, sl, kk, vv, np.int32(T), np.int32(row), np.int64(ks), np.int64(vs)),
    )


def gather_kv(layer, block_table, n_ctx: int):
    """The first n_ctx tokens of a sequence's K or V [n_ctx, kvh, hd], read through its block table."""
    return layer[cp.asarray(block_table)].reshape(-1, *layer.shape[2:])[:n_ctx]


def frozen_table(block_table):
    """A block table on the device as int32, once per forward pass (every layer reads it)."""
    return _dev(block_table, np.int32)


def copy_blocks(k_pool, v_pool, src, dst, n_tokens: int | None = None):
    """Copy block src[i] onto block dst[i] in every layer of the pools [layers, blocks, block_size,
    kvh, hd] (fp16), the first n_tokens tokens (default: the whole block): copy-on-write of a
    shared partial block, or recall of a block into a new place. Destinations must be distinct
    and not among the sources."""
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    L, nb, bs = k_pool.shape[:3]
    n = bs if n_tokens is None else int(n_tokens)
    if len(src) != len(dst):
        raise ValueError("copy_blocks: src and dst differ in length")
    if not len(src) or n == 0:
        return
    if not 0 <= n <= bs:
        raise ValueError(f"copy_blocks: n_tokens {n} outside [0, {bs}]")
    if src.min() < 0 or dst.min() < 0 or max(src.max(), dst.max()) >= nb:
        raise ValueError(f"copy_blocks: block id outside [0, {nb})")
    if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
        raise ValueError("copy_blocks: destinations must be distinct and not among the sources")
    if not (k_pool.dtype == _F16 == v_pool.dtype and k_pool.flags.c_contiguous and v_pool.flags.c_contiguous):
        si, di = cp.asarray(src), cp.asarray(dst)
        k_pool[:, di, :n] = k_pool[:, si, :n]
        v_pool[:, di, :n] = v_pool[:, si, :n]
        return
    row = k_pool.shape[3] * k_pool.shape[4]
    kern = _kernel("kv_cache.cu", "copy_blocks_f16")
    kern(
        (len(src), L),
        (_THREADS,),
        (
            k_pool,
            v_pool,
            _dev(src, np.int32),
            _dev(dst, np.int32),
            np.int64(nb * bs * row),
            np.int64(bs * row),
            np.int64(n * row),
        ),
    )


# ---------------------------------------------------------------- attention


def _q_rows(q):
    """q [T, H, hd] as (fp16 array, token stride in elements) that the kernels can read with
    half2 loads: q itself when it already is one (the model's slice of qkv), else a copy."""
    T, H, hd = q.shape
    st = _elem_strides(q)
    if q.dtype == _F16 and st is not None and st[2] == 1 and st[1] == hd and st[0] % 2 == 0 and _ptr(q) % 4 == 0:
        return q, st[0]
    return cp.ascontiguousarray(q, dtype=cp.float16), H * hd


def _kernels_ok(hd, k_layer, v_layer) -> bool:
    return hd in KERNEL_HEAD_DIMS and _pool_layer_ok(k_layer) and _pool_layer_ok(v_layer)


def _decode_partition(work_blocks: int, max_ctx: int) -> tuple[int, int]:
    """(partition size, partitions) for split-K decode: about 4 thread blocks per SM in all,
    partitions of at least 256 tokens (multiples of 64), one partition for short contexts."""
    want = max(1, -(-4 * _sm_count(cp.cuda.Device().id) // max(1, work_blocks)))
    part = max(256, -(-max_ctx // want))
    part = -(-part // 64) * 64
    return part, max(1, -(-max_ctx // part))


def _launch_decode(
    out, lse, q16, q_stride, k_layer, v_layer, tables, bt_stride, ctx_lens, ctx_fixed, B, H, kvh, scale, max_ctx
):
    hd, bs = k_layer.shape[3], k_layer.shape[1]
    hchunks = -(-(H // kvh) // _GMAX[hd])
    part, nparts = _decode_partition(B * kvh * hchunks, max_ctx)
    if nparts == 1:
        part_acc = part_ml = lse  # never touched by the kernel when num_parts == 1
    else:
        part_acc = cp.empty((B, H, nparts, hd), cp.float32)
        part_ml = cp.empty((B, H, nparts, 2), cp.float32)
    _kernel("paged_attention.cu", f"paged_decode_hd{hd}")(
        (kvh * hchunks, B, nparts),
        (DECODE_WARPS * 32,),
        (
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
        ),
    )
    if nparts > 1:
        _kernel("paged_attention.cu", "paged_decode_reduce")(
            (H, B),
            (min(_THREADS, -(-hd // 32) * 32),),
            (
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
            ),
        )


def paged_attention(q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, extra=None):
    """Causal attention of q [T, H, hd] — the last T tokens of an n_ctx context — over the
    K/V found through block_table. Returns [T, H, hd] in q's dtype. If mass is given (numpy
    or CuPy), the attention weight each key received, summed over queries, is added to it:
    [n_ctx] summed over heads (the kernel path), or [kv_heads, n_extra + n_ctx] per kv head
    (the CPU backend's layout; the CuPy fallback). T == 1 runs the split-K decode kernel, T > 1 the
    prefill kernel. extra = (K, V) [kv_heads, n, hd] (h2o's heavy hitters, offload's read-back
    blocks; before the whole table) takes the CuPy fallback path."""
    T, H, hd = q.shape
    nb, bs, kvh, hd_k = k_layer.shape
    n_ctx = int(n_ctx)
    if hd_k != hd or H % kvh or not 1 <= T <= n_ctx:
        raise ValueError(f"paged_attention: q {q.shape} does not fit K/V {k_layer.shape} with n_ctx {n_ctx}")
    if len(block_table) * bs < n_ctx:
        raise ValueError(f"paged_attention: {len(block_table)} blocks of {bs} cannot hold {n_ctx} tokens")
    if extra is not None or (mass is not None and mass.ndim == 2) or not _kernels_ok(hd, k_layer, v_layer):
        return _paged_attention_xp(q, k_layer, v_layer, block_table, n_ctx, scale, mass, extra)
    bt = _dev(block_table, np.int32)
    q16, qs = _q_rows(q)
    out = cp.empty((T, H, hd), cp.float16)
    lse = cp.empty((T, H), cp.float32)
    if T == 1:
        _launch_decode(out, lse, q16, qs, k_layer, v_layer, bt, len(bt), bt, n_ctx, 1, H, kvh, scale, n_ctx)
    else:
        hchunks = -(-(H // kvh) // _GMAX[hd])
        _kernel("paged_attention.cu", f"paged_prefill_hd{hd}")(
            (-(-T // PREFILL_WARPS), kvh * hchunks),
            (PREFILL_WARPS * 32,),
            (
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
            ),
        )
    if mass is not None:
        _add_mass(mass, lse, q16, qs, k_layer, bt, n_ctx, T, H, kvh, scale)
    return out if q.dtype == _F16 else out.astype(q.dtype)


def _add_mass(mass, lse, q16, qs, k_layer, bt, n_ctx, T, H, kvh, scale):
    direct = isinstance(mass, cp.ndarray) and mass.dtype == _F32 and mass.flags.c_contiguous and mass.shape == (n_ctx,)
    target = mass if direct else cp.zeros(n_ctx, cp.float32)
    hd, bs = k_layer.shape[3], k_layer.shape[1]
    _kernel("paged_attention.cu", f"attention_mass_hd{hd}")(
        (-(-n_ctx // MASS_WARPS),),
        (MASS_WARPS * 32,),
        (
            target,
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
        ),
    )
    if direct:
        return
    if isinstance(mass, cp.ndarray):
        mass += target.astype(mass.dtype)
    else:
        mass += cp.asnumpy(target).astype(mass.dtype, copy=False)


def paged_decode(q, k_layer, v_layer, block_tables, context_lens, scale: float, max_ctx: int | None = None, out=None):
    """Batched decode: one query token per sequence. q [B, H, hd]; block_tables [B, max_blocks]
    int32 and context_lens [B] int32 on the device (each >= 1); returns [B, H, hd] fp16 (into
    `out` when given). max_ctx, a host-side bound on context_lens, sizes the split-K partitions
    (default max_blocks * block_size). No device-to-host reads on the kernel path, so it can be
    captured in a CUDA graph."""
    B, H, hd = q.shape
    kvh, bs = k_layer.shape[2], k_layer.shape[1]
    tables = _dev(block_tables, np.int32)
    lens = _dev(context_lens, np.int32)
    if tables.ndim != 2 or tables.shape[0] != B or lens.shape != (B,) or H % kvh:
        raise ValueError(f"paged_decode: q {q.shape}, block_tables {tables.shape}, context_lens {lens.shape}")
    if not _kernels_ok(hd, k_layer, v_layer):  # fallback: per sequence, reads the lengths back
        res = cp.stack(
            [
                _paged_attention_xp(q[b : b + 1], k_layer, v_layer, tables[b], int(n), scale)[0]
                for b, n in enumerate(cp.asnumpy(lens))
            ]
        ).astype(cp.float16)
        if out is None:
            return res
        out[...] = res
        return out
    q16, qs = _q_rows(q)
    if out is None:
        out = cp.empty((B, H, hd), cp.float16)
    lse = cp.empty((B, H), cp.float32)
    _launch_decode(
        out,
        lse,
        q16,
        qs,
        k_layer,
        v_layer,
        tables,
        tables.shape[1],
        lens,
        0,
        B,
        H,
        kvh,
        scale,
        int(max_ctx or tables.shape[1] * bs),
    )
    return out


def _paged_attention_xp(q, k_layer, v_layer, block_table, n_ctx, scale, mass=None, extra=None):
    """The CPU backend's algorithm on CuPy arrays in fp32: any head dim, dtype or layout."""
    T, H, hd = q.shape
    bt = cp.asarray(block_table)
    k = gather_kv(k_layer, bt, n_ctx).astype(cp.float32)
    v = gather_kv(v_layer, bt, n_ctx).astype(cp.float32)
    ne = 0
    if extra is not None:  # [kvh, n, hd] -> this function's [n, kvh, hd], placed before the table's keys
        ke, ve = (cp.asarray(a, cp.float32).transpose(1, 0, 2) for a in extra)
        ne = ke.shape[0]
        k, v = cp.concatenate((ke, k)), cp.concatenate((ve, v))
        n_ctx = n_ctx + ne
    kvh = k.shape[1]
    g = H // kvh
    qg = q.astype(cp.float32).reshape(T, kvh, g, hd).transpose(1, 2, 0, 3).reshape(kvh, g * T, hd)
    s = cp.matmul(qg, k.transpose(1, 2, 0)) * scale
    if T > 1:
        s = s.reshape(kvh, g, T, n_ctx)
        s += cp.triu(cp.full((T, n_ctx), -cp.inf, cp.float32), k=n_ctx - T + 1)
        s = s.reshape(kvh, g * T, n_ctx)
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    if mass is not None:
        m = s.reshape(kvh, g * T, n_ctx).sum(axis=1) if mass.ndim == 2 else s.sum(axis=(0, 1))[ne:]
        if isinstance(mass, cp.ndarray):
            mass += m.astype(mass.dtype)
        else:
            mass += cp.asnumpy(m).astype(mass.dtype, copy=False)
    o = cp.matmul(s, v.transpose(1, 0, 2))
    return o.reshape(kvh, g, T, hd).transpose(2, 0, 1, 3).reshape(T, H, hd).astype(q.dtype)


# ---------------------------------------------------------------- host <-> device


def to_host(x) -> np.ndarray:
    return cp.asnumpy(x) if isinstance(x, cp.ndarray) else x


def upload_weights(weights: dict[str, np.ndarray]) -> dict[str, cp.ndarray]:
    """The loader's fp32 weights on the device: matrices (and the embedding) fp16, 1-D weights
    (the norms) fp32. Converted on the host one tensor at a time, so the device never holds an
    fp32 copy."""
    out = {}
    for key, a in weights.items():
        a = np.asarray(a)
        out[key] = cp.asarray(np.ascontiguousarray(a, dtype=np.float32 if a.ndim == 1 else np.float16))
    return out


class DecodeBatch:
    """Block tables and context lengths of B single-token sequences, on the device, made once
    per forward pass and read by every layer's paged_decode."""

    def __init__(self, tables: list, n_ctx: list[int]):
        width = max(len(t) for t in tables)
        host = np.zeros((len(tables), width), np.int32)
        for b, t in enumerate(tables):
            host[b, : len(t)] = cp.asnumpy(t) if isinstance(t, cp.ndarray) else np.asarray(t)
        self.tables, self.lens = cp.asarray(host), cp.asarray(np.asarray(n_ctx, np.int32))
        self.max_ctx = int(max(n_ctx))


class CudaBackend:
    """The op set on an NVIDIA GPU through CuPy (see the module docstring for dtypes)."""

    name = "CUDA"
    xp = cp
    act_dtype = act_dtype
    kv_dtype = kv_dtype
    shared_prefix = False
    batched_decode = True

    rmsnorm = staticmethod(rmsnorm)
    rope_tables = staticmethod(rope_tables)
    rope = staticmethod(rope)
    linear = staticmethod(linear)
    silu_mul = staticmethod(silu_mul)
    write_kv = staticmethod(write_kv)
    frozen_table = staticmethod(frozen_table)
    paged_attention = staticmethod(paged_attention)
    copy_blocks = staticmethod(copy_blocks)
    uses_kernels = staticmethod(uses_kernels)
    begin_forward = staticmethod(begin_forward)
    to_host = staticmethod(to_host)
    prepare_weights = staticmethod(upload_weights)
    decode_batch = DecodeBatch

    def start(self, progress: bool) -> None:
        """Kernels compile on first use (CuPy caches them on disk)."""

    @staticmethod
    def embed(table, ids):
        return table[cp.asarray(ids)].astype(act_dtype, copy=False)

    @staticmethod
    def logits(h, w_out) -> np.ndarray:
        return cp.asnumpy(h @ w_out.T).astype(np.float32, copy=False)

    @staticmethod
    def decode(q, k_layer, v_layer, batch: DecodeBatch, scale: float):
        """One paged_decode launch for the batch's sequences (one query token each)."""
        return paged_decode(q, k_layer, v_layer, batch.tables, batch.lens, scale, batch.max_ctx)
