"""The CPU backend: numpy and OpenBLAS, the quantized-weight kernels (quant) for every matmul,
and numba kernels (compiled) for attention and a few fused one-pass element-wise ops.

The ops are module functions (tests call them directly); CpuBackend bundles them with the state
one engine owns: its thread count and the BLAS thread controllers.
"""

import threading

import numpy as np

import localkv.backends.cpu.build as build
import localkv.backends.cpu.compiled as cpu_kernels
import localkv.backends.cpu.quant as quant
from localkv import kv_format
from localkv.backends.base import Capabilities, missing_ability
from localkv.backends.cpu.attention import f32, frozen_table, gather_kv, merge, paged_attention, partial
from localkv.backends.cpu.threads import CoreShare

act_dtype = np.float32  # activations
kv_dtype = np.float16  # the KV pool's default: f16, half the bytes of f32 at about its speed (BENCHMARKS.md)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """One arithmetic per row whatever the row count (the kernel's, or numpy's einsum), except
    the one-row shortcut of the fast paths."""
    if len(x) == 1 and build.FAST_PATHS:  # a decode row: a third of the calls
        return x * (w / np.sqrt(np.dot(x[0], x[0]) / x.shape[1] + eps)).astype(x.dtype, copy=False)
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
    its weights side by side); kind names it (wqkv, wo, w_gate_up, w_down, output).
    Up to KERNEL_ROWS rows the kernels read the blocks (quant.matmul_few, quant.MAX_FEW rows a
    call; its numpy path when they are off); more rows go to quant.matmul_many: tiles
    dequantized into a scratch of this thread's, then BLAS (with AMX: its tile kernels). Its
    result is the transpose of a C-ordered [out, T] array: gate and up are then each one
    contiguous block for SwiGLU, and the down projection reads its transpose as a plain matrix.
    Unless build.FAST_PATHS, every row count takes one kernel (quant.matmul_rows; without the
    kernels, BLAS on fixed blocks of rows): a token's outputs are then the same bits whatever else
    shares its pass."""
    if not build.FAST_PATHS:
        return quant.matmul_rows(x, w)
    rows = len(x)
    if rows <= quant.MAX_FEW:
        return quant.matmul_few(x, w)
    if rows <= KERNEL_ROWS and cpu_kernels.active():
        out = np.empty((rows, w.rows), np.float32)
        for r in range(0, rows, quant.MAX_FEW):
            out[r : r + quant.MAX_FEW] = quant.matmul_few(x[r : r + quant.MAX_FEW], w)
        return out
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = quant.scratch()
    return quant.matmul_many(x, w, scratch)


_local = threading.local()  # per thread: the scratch of matmul_many's dequantized tiles
# Passes of up to this many rows run their matmuls on the kernels, MAX_FEW rows at a time: below
# it, dequantizing every weight for BLAS (or AMX) costs more than reading the blocks again per
# 8 rows (the crossover measured on two models, with either: BENCHMARKS.md).
KERNEL_ROWS = 32


def uses_kernels(rows: int) -> bool:
    """Whether a forward pass of `rows` token rows runs its matmuls on the compiled kernels."""
    return (rows <= KERNEL_ROWS or not build.FAST_PATHS) and cpu_kernels.active()


RESIDUAL_STRIP = 64  # columns per add when the addend is a prefill matmul's transposed output


def add_residual(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y in place: a block's output into the residual stream. A prefill pass's matmul gives
    y as the transpose of a C-ordered [dim, T] array; numpy adds it along x's rows, reading y T
    floats apart, which misses the cache once x outgrows it (several times slower). Strips of
    columns read both sides a cache line at a time."""
    if y.flags.f_contiguous and not y.flags.c_contiguous:
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


def write_kv(k_layer: np.ndarray, v_layer: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray):
    """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer's pool,
    each in its layer's format: the one place rows are quantized (once, as they are written)."""
    nb, bs = k_layer.shape[:2]
    k_layer.reshape(nb * bs, *k_layer.shape[2:])[slots] = kv_format.encode(k, kv_format.of(k_layer))
    v_layer.reshape(nb * bs, *v_layer.shape[2:])[slots] = kv_format.encode(v, kv_format.of(v_layer))


def shared_prefix_decode(
    q: np.ndarray,
    k_layer: np.ndarray,
    v_layer: np.ndarray,
    prefix_table: np.ndarray,
    tails: "list[tuple[np.ndarray, int]] | tuple",
    scale: float,
) -> np.ndarray:
    """Decode attention for B sequences (one query each, q [B, H, hd]) whose block tables all
    begin with prefix_table (full blocks, e.g. the forks of one prompt). The prefix K/V are
    gathered and scored once for all B queries; each sequence's own tail (its table after the
    prefix, n tokens) is scored on its own (with the kernels, all tails in one call; in numpy,
    in one batched pass when they are the same length, as branches decoding in lockstep are);
    the two softmax parts merge by their row maxima (cascade attention). Same result as
    paged_attention per sequence."""
    B, H, hd = q.shape
    kvh = k_layer.shape[2]
    g = H // kvh
    n_prefix = len(prefix_table) * k_layer.shape[1]
    qg = (q * scale).reshape(B, kvh, g, hd).transpose(1, 0, 2, 3).reshape(kvh, B * g, hd)
    kernels = uses_kernels(B) and cpu_kernels.attends(hd)
    if kernels:  # the prefix's K/V read through its table, as stored (no float32 copy)
        op, mp, lp = cpu_kernels.paged_partial(qg, k_layer, v_layer, prefix_table, n_prefix)
    else:
        kp, vp = gather_kv(k_layer, prefix_table, n_prefix), gather_kv(v_layer, prefix_table, n_prefix)
        op, mp, lp = partial(qg, kp, vp)  # rows: (sequence, group)
    tail = _batched_tails(qg.reshape(kvh, B, g, hd), k_layer, v_layer, tails, kernels)
    if tail is not None:
        out = merge((op.reshape(kvh, B, g, hd), mp.reshape(kvh, B, g, 1), lp.reshape(kvh, B, g, 1)), tail)
        return out.transpose(1, 0, 2, 3).reshape(B, H, hd)
    out = np.empty((B, kvh, g, hd), q.dtype)
    for b, (table, n) in enumerate(tails):
        rows = slice(b * g, (b + 1) * g)
        tail = partial(qg[:, rows], gather_kv(k_layer, table, n), gather_kv(v_layer, table, n))
        out[b] = merge((op[:, rows], mp[:, rows], lp[:, rows]), tail)
    return out.reshape(B, H, hd)


def _batched_tails(q4: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, tails, kernels: bool):
    """The sequences' own tails, q4 [kvh, B, g, hd], as one partial attention [kvh, B, g, .]:
    with the kernels whatever their lengths; in numpy when they all hold the same number of
    tokens (else None: one sequence at a time)."""
    if kernels:
        t = tails if isinstance(tails, Tails) else frozen_tails(tails)
        return cpu_kernels.paged_tails(q4, k_layer, v_layer, t.padded, t.lens)
    stacked = tails.stacked if isinstance(tails, Tails) else _stack_tails(tails)
    if stacked is None:
        return None
    kvh, B, _, hd = q4.shape
    n = tails[0][1]
    kt = f32(k_layer.transpose(2, 0, 1, 3)[:, stacked].reshape(kvh, B, -1, hd)[:, :, :n])  # [kvh, B, n, hd]
    vt = f32(v_layer.transpose(2, 0, 1, 3)[:, stacked].reshape(kvh, B, -1, hd)[:, :, :n])
    return partial(q4, kt, vt)


class Tails(tuple):
    """(table, tokens) per sequence after the shared prefix, with `stacked`: the tables as one
    [B, blocks] array when all tails hold the same number of tokens (branches decoding in
    lockstep), else None; `padded` [B, most blocks] (int64, short tables padded with block 0)
    and `lens` [B]: what the kernel reads. Made once per forward (frozen_tails), read by every
    layer."""

    stacked: np.ndarray | None
    padded: np.ndarray
    lens: np.ndarray


def frozen_tails(tails) -> Tails:
    t = Tails(tails)
    t.stacked = _stack_tails(t)
    t.padded = np.zeros((len(t), max(len(table) for table, _ in t)), np.int64)
    for row, (table, _) in zip(t.padded, t):
        row[: len(table)] = table
    t.lens = np.array([n for _, n in t], np.int64)
    return t


def _stack_tails(tails) -> np.ndarray | None:
    n, blocks = tails[0][1], len(tails[0][0])
    return np.stack([t[0] for t in tails]) if all(t[1] == n and len(t[0]) == blocks for t in tails) else None


def logits(h: np.ndarray, w_out) -> np.ndarray:
    """h [R, D] @ w_out.T as a C-ordered float32 [R, V], for the output matrix stored [V, D]."""
    return np.ascontiguousarray(linear(h, w_out, "output"))


class DecodeBatch:
    """Block tables and context lengths of B single-token sequences as the decode kernel reads
    them, made once per forward pass and read by every layer's decode()."""

    def __init__(self, tables: list, n_ctx: list[int]):
        self.tables = np.zeros((len(tables), max(len(t) for t in tables)), np.int32)
        for b, t in enumerate(tables):
            self.tables[b, : len(t)] = t
        self.lens = np.asarray(n_ctx, np.int32)
        self.scores = None  # the kernel's scratch, sized at the first layer
        self.work = 0  # its multiply-adds per layer
        # what the one-answer kernel (compiled.decode_rows) reads: int64, read-only
        self.tables64, self.lens64 = self.tables.astype(np.int64), self.lens.astype(np.int64)
        self.tables64.flags.writeable = self.lens64.flags.writeable = False


def decode(q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, batch: DecodeBatch, scale: float) -> np.ndarray:
    """Attention of B sequences of one query token each (q [B, H, hd]), in one kernel call for
    all of them; paged_attention per sequence when the kernels are off."""
    if not cpu_kernels.attends(q.shape[2]):
        rows = zip(q, batch.tables, batch.lens)
        return np.stack([paged_attention(qb[None], k_layer, v_layer, t, int(n), scale)[0] for qb, t, n in rows])
    if not build.FAST_PATHS:  # each row the bits of its own causal attention (the one-answer rule)
        return cpu_kernels.decode_rows(q, k_layer, v_layer, batch.tables64, batch.lens64, scale)
    if batch.scores is None:
        kvh = k_layer.shape[2]
        batch.scores = np.empty((len(batch.lens) * kvh, q.shape[1] // kvh, int(batch.lens.max())), np.float32)
        batch.work = 2 * int(batch.lens.sum()) * q.shape[1] * q.shape[2]
    return cpu_kernels.decode_attention(q, k_layer, v_layer, batch.tables, batch.lens, scale, batch.scores, batch.work)


class CpuBackend:
    """The CPU op set with one engine's thread settings. Thread rule: while the few-row kernels
    run, BLAS (attention's small matmuls) stays on one thread. OpenBLAS's workers and the
    kernels' OpenMP workers both spin between calls, and on a small machine each then waits for
    the other's time slice; passes of many rows give BLAS the threads back. Either runs on the
    engine's threads less the cores other processes keep busy (threads.CoreShare)."""

    name = "CPU"
    xp = np
    act_dtype = act_dtype
    kv_dtype = kv_dtype
    rmsnorm = staticmethod(rmsnorm)
    rope_tables = staticmethod(rope_tables)
    rope = staticmethod(rope)
    add_residual = staticmethod(add_residual)
    silu_mul = staticmethod(silu_mul)
    gelu_mul = staticmethod(gelu_mul)
    head_rmsnorm = staticmethod(head_rmsnorm)
    write_kv = staticmethod(write_kv)
    frozen_table = staticmethod(frozen_table)
    paged_attention = staticmethod(paged_attention)
    uses_kernels = staticmethod(uses_kernels)
    linear = staticmethod(linear)
    logits = staticmethod(logits)

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"CpuBackend needs at least one thread, got {threads}")
        # the cascade over a shared prefix and the fast batched decode kernel sum in their own
        # order: without the fast paths decode() gives each row the causal kernel's bits (and
        # reads a prefix its rows share once, kernels/decode_rows)
        self.caps = Capabilities(
            shared_prefix=build.FAST_PATHS,
            batched_decode=True,  # decode(): one kernel call per layer for all single-token sequences
            quant_weights=True,
            # the fast paths' decode kernels read float rows only
            kv_dtypes=("f32", "f16") if build.FAST_PATHS else tuple(kv_format.FORMATS),
            attention_options=frozenset({"softcap", "window", "head_tables"}),
        )
        self.threads = threads
        self._cores = CoreShare(threads)
        self._blas = None  # threadpoolctl controllers of the BLAS libraries, found on first use
        self.prefill_amx = False  # the weights' prefill matmuls run on the AMX kernels (prepare_weights)
        self._progress = False

    def prefetch(self) -> None:
        """While the model downloads: the kernels no weight type decides (attention,
        element-wise); prepare_weights's load waits for them."""
        build.load_in_background()

    def start(self, progress: bool) -> None:
        """The kernels load with the weights' types (prepare_weights, next): a first compile of
        both is then shared out at once (build.load)."""
        self._progress = progress

    def prepare_weights(self, weights: dict) -> dict:
        """The weights as they are (views of the file); loads the kernels of their types only."""
        types = quant.weight_types(weights.values())
        build.load(types, progress=self._progress)
        self.prefill_amx = any(quant.on_amx(t) for t in types)
        return weights

    def decode_batch(self, tables: list, n_ctx: list[int]) -> "DecodeBatch":
        self._needs("batched_decode", "decode_batch")
        return DecodeBatch(tables, n_ctx)

    def decode(self, q, k_layer, v_layer, batch, scale: float) -> np.ndarray:
        self._needs("batched_decode", "decode")
        return decode(q, k_layer, v_layer, batch, scale)

    def frozen_tails(self, tails) -> "Tails":
        self._needs("shared_prefix", "frozen_tails")
        return frozen_tails(tails)

    def shared_prefix_decode(self, q, k_layer, v_layer, prefix_table, tails, scale: float) -> np.ndarray:
        self._needs("shared_prefix", "shared_prefix_decode")
        return shared_prefix_decode(q, k_layer, v_layer, prefix_table, tails, scale)

    def _needs(self, flag: str, method: str):
        if not getattr(self.caps, flag):
            raise missing_ability(self.name, method, flag)

    @staticmethod
    def embed(table, ids: np.ndarray) -> np.ndarray:
        return quant.get_rows(table, ids)

    def begin_forward(self, rows: int) -> None:
        if not cpu_kernels.active():
            if not build.FAST_PATHS:  # the numpy path: each of its BLAS calls is small (one block of
                # rows times one cache-sized tile of a weight, one query's attention), too small
                # to pay for waking BLAS's workers (several times slower on a busy machine)
                self._blas_threads(1)
            return  # with the fast paths BLAS keeps the engine's threads throughout
        threads = self._cores.threads()  # the engine's, less the cores other processes keep busy
        if rows > KERNEL_ROWS and (self.prefill_amx or not build.FAST_PATHS):  # numba's kernels
            cpu_kernels.set_threads(threads)
            want = 1
        elif rows > KERNEL_ROWS:  # BLAS's pass: a kernel in it (prefill's causal attention, decode
            # attention of the requests that share the step with prompt chunks) runs on this
            # thread alone, not against BLAS's (both on all threads measured slower), except a
            # causal attention large enough to pay for the workers' spin (PARALLEL_CAUSAL)
            cpu_kernels.set_threads(1, large=threads)
            want = threads
        else:
            cpu_kernels.set_threads(threads)
            want = 1
        self._blas_threads(want)

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
