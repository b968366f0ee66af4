"""The GPU backend: the CPU backend's op set on an NVIDIA GPU through CuPy, same functions, same
shapes. This module: the element-wise ops, the weights on the device and CudaBackend; the
kernels (cuda_kernels), the KV pool (cuda_kv), attention (cuda_attention) and quantized
weights (cuda_quant) have their own modules.

Dtypes, and why:
- weights: GGUF blocks as they are for the types with kernels (cuda_quant: decoded inside the
  matvec kernels of decode steps, dequantized to fp16 tiles for cuBLAS in prefill); other
  matrices fp16, `x @ w.T` through cuBLAS on tensor cores with fp32 accumulation; 1-D weights
  (the norms) fp32;
- activations fp16 (act_dtype): the model is backend-neutral and multiplies activations by the
  weights as they are, so fp16 activations keep every matmul fp16 x fp16 (fp32 activations would
  make CuPy upcast the weight on every call). The residual stream is therefore fp16, unlike
  llama.cpp's fp32; every fused kernel (RMSNorm, RoPE, SiLU, attention) computes in fp32;
- the KV pool is fp16 by default (default_kv), or q8_0 / q4_0 (kernels for those and q8_0:q4_0,
  other K:V pairs on CuPy): quantized once as rows are written, read as stored by the attention
  kernels (cuda_kv, cuda_attention); attention accumulates in fp32 (online softmax).

Decode steps of single-token sequences run one paged_decode launch per layer for all of them
(CudaBackend.decode, through Llama.forward's decode batch).

UNVERIFIED on a GPU: written and compile-checked (nvcc and NVRTC, sm_80/sm_90), and run on the
CPU in the tests through a CuPy stand-in and a CUDA emulator (tests/cupy_standin,
tests/cuda_emu); nothing here has run on a GPU yet. tests/backends/test_gpu.py and scripts/gpu_check.sh
are the checks to run on one.
"""

from __future__ import annotations

import sys
import time

import cupy as cp
import numpy as np

import localkv.backends.cpu as cpu
import localkv.backends.cuda_quant as cuda_quant
from localkv.backends.base import Capabilities
from localkv.backends.cpu.quant import QStack, QTensor
from localkv.backends.cuda_attention import DecodeBatch, paged_attention, paged_decode
from localkv.backends.cuda_kernels import F16, F32, THREADS, compile_all, dev, elem_strides, grid1d, kernel
from localkv.backends.cuda_kv import frozen_table, write_kv

xp = cp
name = "CUDA"
act_dtype = np.float16  # activations (see the module docstring)


# ---------------------------------------------------------------- element-wise ops


def rmsnorm(x, w, eps: float):
    if x.ndim != 2 or x.dtype not in (F16, F32) or x.shape[0] == 0 or x.shape[1] == 0:
        return _rmsnorm_xp(x, w, eps)
    x = cp.ascontiguousarray(x)
    w = dev(w, np.float32)
    R, D = x.shape
    out = cp.empty_like(x)
    threads = THREADS if D >= THREADS else -(-D // 32) * 32
    k = kernel("fused_ops.cu", "rmsnorm_f16" if x.dtype == F16 else "rmsnorm_f32")
    k((R,), (threads,), (out, x, w, np.int32(D), np.float32(eps)))
    return out


def _rmsnorm_xp(x, w, eps):
    xf = x.astype(cp.float32)
    ms = (xf * xf).mean(axis=-1, keepdims=True)
    return (xf / cp.sqrt(ms + eps) * cp.asarray(w, dtype=cp.float32)).astype(x.dtype)


def rope_tables(head_dim: int, max_pos: int, theta: float, factors=None):
    """The CPU backend's tables (cos/sin [max_pos, head_dim/2] float32), on the device."""
    cos, sin = cpu.rope_tables(head_dim, max_pos, theta, factors)
    return cp.asarray(cos), cp.asarray(sin)


ROPE_KERNELS = {"neox": "rope", "normal": "rope_pairs"}  # ModelConfig.rope_style -> kernel name stem


def rope(x, cos, sin, style: str = "neox"):
    """RoPE in place on x [T, heads, hd] (x may be a strided view, as the model's q/k slice of
    qkv is); cos/sin [T, hd/2]. style "neox" rotates the halves (value i with i + hd/2),
    "normal" adjacent pairs (2i with 2i + 1)."""
    if style not in ROPE_KERNELS:
        raise ValueError(f"rope: unknown style {style!r}")
    T, heads, hd = x.shape
    st = elem_strides(x)
    if x.dtype not in (F16, F32) or hd % 2 or st is None or st[2] != 1 or x.size == 0:
        return _rope_xp(x, cos, sin, style)
    half = hd // 2
    c, s = dev(cos, np.float32), dev(sin, np.float32)
    if c.shape != (T, half) or s.shape != (T, half):
        raise ValueError(f"rope: cos/sin must be [{T}, {half}], got {c.shape} and {s.shape}")
    k = kernel("fused_ops.cu", f"{ROPE_KERNELS[style]}_{'f16' if x.dtype == F16 else 'f32'}")
    k(
        grid1d(T * heads * half),
        (THREADS,),
        (x, c, s, np.int32(T), np.int32(heads), np.int32(half), np.int64(st[0]), np.int64(st[1])),
    )
    return x


def _rope_xp(x, cos, sin, style: str):
    h = x.shape[-1] // 2
    first, second = (slice(0, h), slice(h, None)) if style == "neox" else (slice(0, None, 2), slice(1, None, 2))
    c, s = cp.asarray(cos)[:, None, :], cp.asarray(sin)[:, None, :]
    x1, x2 = x[..., first].astype(cp.float32), x[..., second].astype(cp.float32)
    x[..., first] = x1 * c - x2 * s
    x[..., second] = x2 * c + x1 * s
    return x


def begin_forward(rows: int):
    """Nothing to set up per forward pass on the GPU (the CPU backend picks BLAS threads)."""


def uses_kernels(rows: int) -> bool:
    """The CPU backend's few-row kernels: not used here."""
    return False


def add_residual(x, y):
    x += y
    return x


def silu_mul(gu):
    if gu.ndim != 2 or gu.dtype not in (F16, F32) or gu.shape[1] % 2 or gu.size == 0:
        f = gu.shape[-1] // 2
        g, u = gu[..., :f].astype(cp.float32), gu[..., f:].astype(cp.float32)
        return (g / (1.0 + cp.exp(-g)) * u).astype(gu.dtype)
    gu = cp.ascontiguousarray(gu)
    T, F = gu.shape[0], gu.shape[1] // 2
    out = cp.empty((T, F), gu.dtype)
    k = kernel("fused_ops.cu", "silu_mul_f16" if gu.dtype == F16 else "silu_mul_f32")
    k(grid1d(T * F), (THREADS,), (out, gu, np.int32(T), np.int32(F)))
    return out


GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_mul(gu):
    """gelu(gate) * up for gu = [gate | up] (GeGLU, tanh approximation), computed in fp32."""
    f = gu.shape[-1] // 2
    g, u = gu[..., :f].astype(cp.float32), gu[..., f:].astype(cp.float32)
    return (0.5 * g * (1.0 + cp.tanh(GELU_C * (g + 0.044715 * g * g * g))) * u).astype(gu.dtype)


def rotate(x, rotation, undo: bool = False):
    """kv/rotation's transform on the device: CuPy's element-wise adds, the same butterflies."""
    return rotation.undo(x, cp) if undo else rotation.apply(x, cp)


def rope_store(qkv, cos, sin, style, rotation, k_layer, v_layer, slots) -> bool:
    """No fused kernel here: the model calls rope, rotate and write_kv (each one launch)."""
    return False


def head_rmsnorm(x, w, eps: float):
    """RMSNorm of every head of x [T, heads, hd] (a view of the qkv rows) in place, times w [hd]."""
    xf = x.astype(cp.float32)
    ms = (xf * xf).mean(axis=-1, keepdims=True)
    x[...] = (xf / cp.sqrt(ms + eps) * dev(w, np.float32)).astype(x.dtype)
    return x


def linear(x, w, kind: str):
    """x [T, in] @ w.T for a weight stored [out, in]: one cuBLAS gemm at any T for an fp16 matrix
    (it takes the transpose as a flag), cuda_quant's kernels for GGUF blocks; kind is for the CPU
    backend."""
    if cuda_quant.is_device_quant(w):
        return cuda_quant.matmul(x, w)
    return x @ w.T


# ---------------------------------------------------------------- host <-> device


def to_host(x) -> np.ndarray:
    return cp.asnumpy(x) if isinstance(x, cp.ndarray) else x


def upload_weights(weights: dict, fingerprint: str = "") -> dict:
    """The loader's weights on the device. QTensor / QStack (GGUF blocks): see cuda_quant.upload.
    Arrays (fp32): matrices (and the embedding) fp16, 1-D weights (the norms) fp32, converted on
    the host one tensor at a time, so the device never holds an fp32 copy."""
    out = {}
    for key, a in weights.items():
        if isinstance(a, (QTensor, QStack)):
            out[key] = cuda_quant.upload(a)
            continue
        a = np.asarray(a)
        out[key] = cp.asarray(np.ascontiguousarray(a, dtype=np.float32 if a.ndim == 1 else np.float16))
    return out


def embed(table, ids):
    """Rows ids of the embedding table as activations [len(ids), dim]."""
    if cuda_quant.is_device_quant(table):
        return cuda_quant.rows(table, ids)
    return table[cp.asarray(ids)].astype(act_dtype, copy=False)


def logits(h, w_out) -> np.ndarray:
    """h [R, dim] @ w_out.T on the host as float32 [R, vocab]."""
    if cuda_quant.is_device_quant(w_out):
        return cp.asnumpy(cuda_quant.matmul(h, w_out, out_dtype=np.float32))
    return cp.asnumpy(h @ w_out.T).astype(np.float32, copy=False)


class CudaBackend:
    """The op set on an NVIDIA GPU through CuPy (see the module docstring for dtypes)."""

    name = "CUDA"
    xp = cp
    act_dtype = act_dtype

    @staticmethod
    def default_kv(head_dim: int) -> str:
        """The pool's format for --kv-dtype auto: f16 (q8_0 and q4_0 are not measured against
        it on a GPU yet)."""
        return "f16"

    @staticmethod
    def prepare_kv(pool: str) -> None:
        """Nothing: the kernels of every format compile at start (cuda_kernels.compile_all)."""

    caps = Capabilities(
        batched_decode=True,
        quant_weights=True,  # cuda_quant
        kv_dtypes=("f16", "q8_0", "q4_0"),  # the rows the CUDA kernels write and read (cuda_kernels.KV_FORMATS)
        attention_options=frozenset(),  # no soft-cap, no sliding window: Gemma is refused (model.llama.check_backend)
    )
    prefill_amx = False

    rmsnorm = staticmethod(rmsnorm)
    rope_tables = staticmethod(rope_tables)
    rope = staticmethod(rope)
    linear = staticmethod(linear)
    add_residual = staticmethod(add_residual)
    silu_mul = staticmethod(silu_mul)
    gelu_mul = staticmethod(gelu_mul)
    head_rmsnorm = staticmethod(head_rmsnorm)
    rotate = staticmethod(rotate)
    write_kv = staticmethod(write_kv)
    rope_store = staticmethod(rope_store)
    frozen_table = staticmethod(frozen_table)
    paged_attention = staticmethod(paged_attention)
    uses_kernels = staticmethod(uses_kernels)
    begin_forward = staticmethod(begin_forward)
    to_host = staticmethod(to_host)
    prepare_weights = staticmethod(upload_weights)
    embed = staticmethod(embed)
    logits = staticmethod(logits)
    decode_batch = DecodeBatch

    def prefetch(self) -> None:
        """Nothing: the CUDA kernels compile in start()."""

    def start(self, progress: bool) -> None:
        """Compile every kernel now (NVRTC; CuPy caches the result on disk), so no step pays for it."""
        t0 = time.perf_counter()
        compile_all()
        took = time.perf_counter() - t0
        if progress and took > 1.0:
            print(f"compiled the CUDA kernels in {took:.1f}s (cached for later runs)", file=sys.stderr)

    @staticmethod
    def decode(q, k_layer, v_layer, batch: DecodeBatch, scale: float):
        """One paged_decode launch for the batch's sequences (one query token each)."""
        return paged_decode(q, k_layer, v_layer, batch.tables, batch.lens, scale, batch.max_ctx)
