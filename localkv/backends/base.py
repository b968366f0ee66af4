"""What a backend provides: the op set the model's one forward pass is written in.

A backend is an object (CpuBackend, CudaBackend) that owns its device state: thread pools and
compiled kernels on the CPU, kernel modules on the GPU. The model and the engine read its
Capabilities (`backend.caps`), never the backend's type or module, to choose between equivalent
ways of computing the same thing. Every member below exists on every backend; a method whose
capability a backend lacks raises (missing_ability) instead of being absent, so callers never
probe with getattr.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional abilities of a backend, fixed by its code (so no defaults: a backend states
    each one)."""

    batched_decode: bool  # decode, decode_batch: one call per layer for many single-token sequences
    quant_weights: bool  # computes on QTensor/QStack weights (others get model.weights.dense_weights)
    kv_dtypes: tuple[str, ...]  # the K/V row formats (kv_format names) EngineConfig.kv_dtype may choose
    attention_options: frozenset[str]  # what paged_attention takes beyond Llama's: "softcap", "window", "head_tables"


def missing_ability(backend: str, method: str, flag: str) -> RuntimeError:
    """The error of a method called on a backend whose Capabilities say it lacks it."""
    return RuntimeError(f"the {backend} backend has no {method} (caps.{flag} is False): a bug in the caller's logic")


class Backend(Protocol):
    name: str  # "CPU" | "CUDA": what `bench` and the panel print
    caps: Capabilities
    xp: Any  # the array module of pool and activations: numpy or cupy
    act_dtype: Any  # activations
    # the model's prefill matmuls run on AMX tiles: a fact about the loaded weights' types, found
    # by prepare_weights, not an ability of the backend's code, so state here and not in caps
    prefill_amx: bool

    def default_kv(self, head_dim: int) -> str:
        """The K/V format (a kv_format name) of --kv-dtype auto for heads of this size."""

    def prepare_kv(self, pool: str) -> None:
        """Ready the kernels that read a pool of these K/V formats ("K:V", kv_format.pair_name);
        called before prepare_weights, a backend may ready them with the weights'."""

    def prefetch(self) -> None:
        """While the model downloads: begin, in the background, loading what needs no model."""

    def start(self, progress: bool) -> None:
        """Once the model is known to load: compile or load kernels, so no step pays for it."""

    def prepare_weights(self, weights: dict, fingerprint: str = "") -> dict:
        """The loader's weights as this backend computes with them (e.g. copied to the device);
        fingerprint (the model's) keys what the backend keeps of them on disk."""

    def begin_forward(self, rows: int) -> None:
        """Before a forward pass of `rows` token rows (e.g. picks CPU threads for its matmuls)."""

    def uses_kernels(self, rows: int) -> bool:
        """Whether a pass of `rows` rows runs its matmuls on compiled few-row kernels."""

    def embed(self, table, ids) -> Any:
        """Rows `ids` of an embedding table, as activations [len(ids), dim]."""

    def linear(self, x, w, kind: str) -> Any:
        """x [T, in] @ w.T for a weight stored [out, in]; kind names it (wqkv, wo, w_gate_up,
        w_down, output)."""

    def logits(self, h, w_out) -> np.ndarray:
        """h [R, dim] @ w_out.T on the host as float32 [R, vocab]; w_out is stored [vocab, dim]."""

    def rmsnorm(self, x, w, eps: float) -> Any: ...

    def rope_tables(self, head_dim: int, max_pos: int, theta: float, factors=None) -> tuple[Any, Any]:
        """cos/sin [max_pos, head_dim/2]; factors divide the frequencies (Llama 3's rope_freqs)."""

    def rope(self, x, cos, sin, style: str = "neox") -> Any:
        """RoPE in place on x [T, heads, hd]; cos/sin [T, hd/2]; style "neox" rotates the halves,
        "normal" adjacent pairs (ModelConfig.rope_style)."""

    def add_residual(self, x, y) -> Any:
        """x += y in place (a block's output into the residual stream [T, dim]); returns x."""

    def silu_mul(self, gu) -> Any:
        """silu(gate) * up for gu = [gate | up] along the last axis."""

    def gelu_mul(self, gu) -> Any:
        """gelu(gate) * up (tanh approximation) for gu = [gate | up]: Gemma's GeGLU."""

    def head_rmsnorm(self, x, w, eps: float) -> Any:
        """RMSNorm of every head of x [T, heads, hd] in place, times w [hd] (Qwen3's, Gemma 3's q/k norms)."""

    def rotate(self, x, rotation, undo: bool = False) -> Any:
        """kv/rotation's M x (undo: M^T x) of rows x [T, heads, hd], a new array: its bits, by
        whatever means the backend has."""

    def write_kv(self, k_layer, v_layer, slots, k, v) -> None:
        """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer."""

    def rope_store(self, qkv, cos, sin, style: str, rotation, k_layer, v_layer, slots) -> bool:
        """rope on qkv [T, H + 2 kvh, hd]'s q and k heads, rotation's heads turned (rotate),
        then write_kv of its k and v heads, as one call where the backend has one for this pass:
        True; else False with nothing done (the model then calls the three)."""

    def frozen_table(self, block_table) -> Any:
        """A block table as this backend reads it, made once per forward pass."""

    def paged_attention(
        self, q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, extra=None, **options
    ):
        """Causal attention of q [T, H, hd] (the last T tokens of an n_ctx context) over the K/V
        found through block_table; see backends/cpu/attention.py for mass and extra; options: the
        caps.attention_options the model's architecture needs (softcap=, window=), and
        head_tables=True for a KV policy's keys by position (kv/evict/protocol.PositionedKV)."""

    def to_host(self, x) -> np.ndarray: ...

    # caps.batched_decode

    def decode_batch(self, tables: list, n_ctx: list[int]) -> Any:
        """The block tables and context lengths of single-token sequences as decode reads them,
        made once per forward pass."""

    def decode(self, q, k_layer, v_layer, batch, scale: float) -> Any:
        """Attention of B sequences of one query token each (q [B, H, hd]) through a decode_batch."""
