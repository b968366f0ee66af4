"""The CPU backend: numpy and OpenBLAS, the quantized-weight kernels (quant) for every matmul,
and numba kernels (compiled) for attention and a few fused one-pass element-wise ops.

Every op computes a token row's outputs by one arithmetic, whatever else shares its pass
(docs/CPU.md, "One arithmetic"): one answer per prompt.

The ops are module functions (tests call them directly); CpuBackend bundles them with the state
one engine owns: its thread count and the BLAS thread controllers.
"""

import numpy as np

import localkv.backends.cpu.build as build
import localkv.backends.cpu.compiled as cpu_kernels
import localkv.backends.cpu.quant as quant
from localkv import kv_format
from localkv.backends.base import Capabilities, missing_ability
from localkv.backends.cpu.attention import frozen_table, paged_attention
from localkv.backends.cpu.threads import CoreShare

act_dtype = np.float32  # activations


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """One arithmetic per row whatever the row count (the kernel's, or numpy's einsum)."""
    if cpu_kernels.active():  # one pass and no temporaries
        return cpu_kernels.rmsnorm(x, w, eps)
    ms = np.einsum("td,td->t", x, x) / x.shape[1]
    return x * (1.0 / np.sqrt(ms + eps))[:, None].astype(x.dtype) * w


def rope_tables(head_dim: int, max_pos: int, theta: float, factors=None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_pos, head_dim/2]; factors divide the frequencies (Llama 3's rope_freqs)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv = inv / np.asarray(factors, np.float64)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str = "neox") -> np.ndarray:
    """RoPE in place on x [T, heads, hd]; cos/sin [T, hd/2]. style "neox" rotates the halves
    (value i with i + hd/2), "normal" adjacent pairs (2i with 2i+1): ModelConfig.rope_style."""
    if cpu_kernels.active():  # one pass instead of seven
        cpu_kernels.rope(x, cos, sin, style)
        return x
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h].copy(), x[..., h:]
    else:
        x1, x2 = x[..., 0::2].copy(), x[..., 1::2]
    first = x1 * c - x2 * s
    x2 *= c
    x2 += x1 * s
    if style == "neox":
        x[..., :h] = first
    else:
        x[..., 0::2] = first
    return x


def linear(x: np.ndarray, w, kind: str) -> np.ndarray:
    """x [T, in] @ W.T for a weight stored [out, in] as a QTensor (or a QStack: the outputs of
    its weights side by side); kind names it (wqkv, wo, w_gate_up, w_down, output). Every row
    count takes one kernel per weight type (quant.matmul_rows; without the kernels, BLAS on
    fixed blocks of rows): a token's outputs are the same bits whatever else shares its pass."""
    return quant.matmul_rows(x, w)


def default_kv(head_dim: int) -> str:
    """The pool's formats for --kv-dtype auto: K in q8_0 and V in q4_0 where the kernels run
    and the heads split into their blocks (the smallest within +0.5% perplexity of f16 and no
    slower than it: `localkv bench kv`, BENCHMARKS.md), else f16 (numpy's quantization is a
    dozen passes)."""
    return "q8_0:q4_0" if build.usable() and head_dim % kv_format.QK == 0 else "f16"


def uses_kernels(rows: int) -> bool:
    """Whether a forward pass of `rows` token rows runs its matmuls on the compiled kernels
    (every pass does, when they loaded)."""
    return cpu_kernels.active()


RESIDUAL_STRIP = 64  # columns per add when the addend is a prefill matmul's transposed output


def add_residual(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y in place: a block's output into the residual stream. A prefill pass's matmul gives
    y as the transpose of a C-ordered [dim, T] array; numpy adds it along x's rows, reading y T
    floats apart, which misses the cache once x outgrows it (several times slower). Strips of
    columns read both sides a cache line at a time."""
    flags = y.flags
    if flags.f_contiguous and not flags.c_contiguous:
        for j in range(0, x.shape[1], RESIDUAL_STRIP):
            x[:, j : j + RESIDUAL_STRIP] += y[:, j : j + RESIDUAL_STRIP]
    else:
        x += y
    return x


def silu_mul(gu: np.ndarray) -> np.ndarray:
    """silu(gate) * up for gu = [gate | up]: the fused kernel, or numpy in one temporary
    (prefill is memory-bound here)."""
    if cpu_kernels.active() and gu.dtype == np.float32:
        return cpu_kernels.silu_mul(gu)
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    t = np.negative(g)
    np.exp(t, out=t)
    t += 1.0
    np.divide(g, t, out=t)
    t *= u
    return t


GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_mul(gu: np.ndarray) -> np.ndarray:
    """gelu(gate) * up for gu = [gate | up] (GeGLU), gelu in its tanh approximation (as llama.cpp
    and Gemma's gelu_pytorch_tanh)."""
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    t = g * g
    t *= np.float32(GELU_C * 0.044715)
    t += np.float32(GELU_C)
    t *= g
    np.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    t *= g
    t *= u
    return t


def head_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of every head of x [T, heads, hd] (a view of the qkv rows) in place, times w [hd]."""
    ms = np.einsum("thd,thd->th", x, x) / x.shape[-1]
    x *= (1.0 / np.sqrt(ms + eps))[..., None].astype(x.dtype, copy=False)
    x *= w
    return x


def rotate(x: np.ndarray, rotation, undo: bool = False) -> np.ndarray:
    """kv/rotation's transform of rows x [T, heads, hd]: the kernel's vectors, or numpy's."""
    if cpu_kernels.active():
        return cpu_kernels.hadamard(x, rotation, undo)
    return rotation.undo(x) if undo else rotation.apply(x)


def write_kv(k_layer: np.ndarray, v_layer: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray):
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool,
    each in its layer's format: rows are quantized once, as they are written (kv_format.encode,
    or the kernel that writes its bytes)."""
    kernels = cpu_kernels.active()
    for layer, x in ((k_layer, k), (v_layer, v)):
        fmt = kv_format.of(layer)
        if fmt.quantized and kernels:  # the same bytes as encode's, in one pass
            cpu_kernels.encode_rows(layer, slots, x)
        else:
            layer.reshape(-1, *layer.shape[2:])[slots] = kv_format.encode(x, fmt)


def rope_store(qkv: np.ndarray, cos, sin, style: str, rotation, k_layer, v_layer, slots) -> bool:
    """rope on qkv's q and k heads, the rotation's heads turned and write_kv of its k and v
    heads, in one kernel call where it applies (a decode step's few rows on a quantized pool:
    compiled.rope_turn_store); False, with nothing done, elsewhere."""
    return cpu_kernels.active() and cpu_kernels.rope_turn_store(qkv, cos, sin, style, rotation, k_layer, v_layer, slots)


def logits(h: np.ndarray, w_out) -> np.ndarray:
    """h [R, D] @ w_out.T as a C-ordered float32 [R, V], for the output matrix stored [V, D]."""
    return np.ascontiguousarray(linear(h, w_out, "output"))


class DecodeBatch:
    """Block tables and context lengths of B single-token sequences as the decode kernel reads
    them, made once per forward pass and read by every layer's decode(), with the kernel's
    split of the work (compiled.decode_split), worked out at the first layer."""

    def __init__(self, tables: list, n_ctx: list[int]):
        self.tables = np.zeros((len(tables), max(len(t) for t in tables)), np.int64)
        for b, t in enumerate(tables):
            self.tables[b, : len(t)] = t
        self.lens = np.asarray(n_ctx, np.int64)
        # as the kernel (compiled.decode_rows) was compiled for them: int64, read-only
        self.tables.flags.writeable = self.lens.flags.writeable = False
        self.most = max(n_ctx)
        self.split = None  # (parts, threads): the same for every layer of the pass


def decode(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, batch: DecodeBatch, scale: float) -> np.ndarray:
    """Attention of B sequences of one query token each (q [B, H, hd]), in one kernel call for
    all of them, each row the bits paged_attention's causal kernel gives it (kernels/decode_rows);
    paged_attention per sequence when the kernels are off."""
    if batch.split is None:
        if not cpu_kernels.attends(q.shape[2]):
            rows = zip(q, batch.tables, batch.lens)
            return np.stack([paged_attention(qb[None], k_layer, v_layer, t, int(n), scale)[0] for qb, t, n in rows])
        batch.split = cpu_kernels.decode_split(len(q), k_layer.shape[2], batch.most)
    return cpu_kernels.decode_rows(q, k_layer, v_layer, batch.tables, batch.lens, scale, batch.split)


class CpuBackend:
    """The CPU op set with one engine's thread settings. Thread rule: the kernels run on the
    engine's threads less the cores other processes keep busy (threads.CoreShare), and BLAS
    (the numpy path's small matmuls) stays on one thread. OpenBLAS's workers and the kernels'
    OpenMP workers both spin between calls, and on a small machine each then waits for the
    other's time slice. Its capabilities are fixed by this code (backends/base.py)."""

    name = "CPU"
    caps = Capabilities(
        # decode(): one kernel call per layer for all single-token sequences, each row the causal
        # kernel's bits (a prefix its rows share is read once: kernels/decode_rows)
        batched_decode=True,
        quant_weights=True,
        kv_dtypes=tuple(kv_format.FORMATS),
        attention_options=frozenset({"softcap", "window", "head_tables"}),
    )
    xp = np
    act_dtype = act_dtype
    default_kv = staticmethod(default_kv)
    rmsnorm = staticmethod(rmsnorm)
    rope_tables = staticmethod(rope_tables)
    rope = staticmethod(rope)
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
    linear = staticmethod(linear)
    logits = staticmethod(logits)

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"CpuBackend needs at least one thread, got {threads}")
        self.threads = threads
        self._cores = CoreShare(threads)
        self._blas = None  # threadpoolctl controllers of the BLAS libraries, found on first use
        self.prefill_amx = False  # a long pass's weight matmuls use AMX tiles (prepare_weights)
        self._progress = False
        self._pools: list[str] = []  # prepare_kv's, loaded with the weights' kernels
        self._weights_ready = False

    def prefetch(self) -> None:
        """While the model downloads: the kernels no weight type decides (attention,
        element-wise); prepare_weights's load waits for them."""
        build.load_in_background()

    def start(self, progress: bool) -> None:
        """The kernels load with the weights' types (prepare_weights): a first compile of them
        and of the pool's (prepare_kv, before) is then shared out at once (build.load)."""
        self._progress = progress

    def prepare_weights(self, weights: dict, fingerprint: str = "") -> dict:
        """The weights as they are (views of the file), with the Q4_K and Q6_K ones also packed
        for their kernel (quant.pack: kept on disk by fingerprint); loads the kernels of their
        types and of the pools prepare_kv named, only."""
        types = quant.weight_types(weights.values())
        build.load(types, progress=self._progress, kv=self._pools)
        self._weights_ready = True
        quant.pack(weights, fingerprint)
        self.prefill_amx = any(quant.on_amx(t) for t in types)
        return weights

    def prepare_kv(self, pool: str) -> None:
        """The attention kernels of this pool's K/V formats (a start loads the builds its pool
        reads, not every format's): loaded now, or with the weights' when they are not yet."""
        self._pools.append(pool)
        if self._weights_ready:
            build.load(kv=[pool], progress=self._progress)

    def decode_batch(self, tables: list, n_ctx: list[int]) -> "DecodeBatch":
        self._needs("batched_decode", "decode_batch")
        return DecodeBatch(tables, n_ctx)

    decode = staticmethod(decode)  # caps.batched_decode: always (the protocol's test calls it)

    def _needs(self, flag: str, method: str):
        if not getattr(self.caps, flag):
            raise missing_ability(self.name, method, flag)

    @staticmethod
    def embed(table, ids: np.ndarray) -> np.ndarray:
        return quant.get_rows(table, ids)

    def begin_forward(self, rows: int) -> None:
        """The kernels run on the engine's threads less the cores other processes keep busy,
        BLAS on one: its calls here (the numpy attention's, and every matmul of the numpy path)
        are small, too small to pay for waking its workers (several times slower on a busy
        machine), and its spinning workers would take time slices from the kernels'."""
        if cpu_kernels.active():
            cpu_kernels.set_threads(self._cores.threads())
        self._blas_threads(1)

    def _blas_threads(self, want: int) -> None:
        if self._blas is None:
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController().select(user_api="blas").lib_controllers
        for lib in self._blas:
            if lib.num_threads != want:  # read each time: threadpoolctl limits elsewhere may have changed it
                lib.set_num_threads(want)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return x
