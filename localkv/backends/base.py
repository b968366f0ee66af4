"""What a backend provides: the small op set the model's one forward pass is written in.

A backend is an object (CpuBackend, CudaBackend) that owns its device state: thread pools and
compiled kernels on the CPU, kernel modules on the GPU. The model reads capability flags, never
the backend's type or module, to choose between equivalent ways of computing the same thing.
"""

from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    name: str  # "CPU" | "CUDA": what `bench` and the panel print
    xp: Any  # the array module of pool and activations: numpy or cupy
    act_dtype: Any  # activations
    kv_dtype: Any  # the KV pool
    shared_prefix: bool  # has shared_prefix_decode (forks score their common prefix once)
    batched_decode: bool  # has paged_decode (one launch for many single-token sequences)
    prefill_amx: bool  # the model's prefill matmuls run on AMX tiles (set by prepare_weights)
    attention_options: frozenset  # what paged_attention takes beyond Llama's: "softcap", "window"

    def start(self, progress: bool) -> None:
        """Once the model is known to load: compile or load kernels, so no step pays for it."""

    def prepare_weights(self, weights: dict) -> dict:
        """The loader's weights as this backend computes with them (e.g. copied to the device)."""

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

    def rope_tables(self, head_dim: int, max_pos: int, theta: float) -> tuple[Any, Any]: ...

    def rope(self, x, cos, sin) -> Any:
        """Rotate halves ("NEOX" order) of x [T, heads, hd] in place; cos/sin [T, hd/2]."""

    def add_residual(self, x, y) -> Any:
        """x += y in place (a block's output into the residual stream [T, dim]); returns x."""

    def silu_mul(self, gu) -> Any:
        """silu(gate) * up for gu = [gate | up] along the last axis."""

    def gelu_mul(self, gu) -> Any:
        """gelu(gate) * up (tanh approximation) for gu = [gate | up]: Gemma's GeGLU."""

    def head_rmsnorm(self, x, w, eps: float) -> Any:
        """RMSNorm of every head of x [T, heads, hd] in place, times w [hd] (Qwen3's, Gemma 3's q/k norms)."""

    def write_kv(self, k_layer, v_layer, slots, k, v) -> None:
        """Store K/V [T, kvh, hd] at flat slots (block * block_size + offset) of one layer."""

    def frozen_table(self, block_table) -> Any:
        """A block table as this backend reads it, made once per forward pass."""

    def paged_attention(self, q, k_layer, v_layer, block_table, n_ctx: int, scale: float, mass=None, extra=None):
        """Causal attention of q [T, H, hd] (the last T tokens of an n_ctx context) over the K/V
        found through block_table; see backends/cpu.py for mass and extra."""

    def to_host(self, x) -> np.ndarray: ...
