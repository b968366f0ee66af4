"""The weights of a model as the forward pass reads them, whatever the source.

    tok_embd [V, D]; per layer i: "{i}.attn_norm", "{i}.wqkv" (q, k, v rows: a QStack, or
    one matrix where the file fuses them), "{i}.wo" [D, H*hd], "{i}.ffn_norm", "{i}.w_gate_up"
    (gate rows, then up rows: a QStack or one matrix), "{i}.w_down" [D, F]; out_norm [D];
    "output" [V, D] only when not tied to tok_embd. Where the architecture has them
    (ModelConfig): "{i}.bqkv" (q, k, v biases), "{i}.q_norm" / "{i}.k_norm" [hd],
    "{i}.post_attn_norm" / "{i}.post_ffn_norm" [D].

Matrices are QTensors [out, in] in the source's own encoding (GGUF blocks, or F32/F16/BF16),
read-only views of the mapped file; norms are float32 vectors. Q/K rows stay in the source's
order: ModelConfig.rope_style says which RoPE matches them.

A backend that cannot compute on QTensors gets `dense_weights`: the same keys as plain arrays.
"""

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from localkv.backends.cpu.quant import QStack, QTensor, dequantize
from localkv.model.config import ModelConfig


def layout(get: Callable[[str], object], cfg: ModelConfig, has: Callable[[str], bool]) -> dict:
    """The forward pass's weights from get(GGUF tensor name) (a QTensor for a matrix, a float32
    vector for a norm); has(name) says whether an optional tensor is there."""
    w = {"tok_embd": get("token_embd.weight"), "out_norm": get("output_norm.weight")}
    if has("output.weight"):
        w["output"] = get("output.weight")
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        w[f"{i}.attn_norm"] = get(p + "attn_norm.weight")
        if cfg.fused:  # Phi-3: the file's own [q; k; v] and [gate; up] matrices
            w[f"{i}.wqkv"], w[f"{i}.w_gate_up"] = get(p + "attn_qkv.weight"), get(p + "ffn_up.weight")
        else:
            w[f"{i}.wqkv"] = QStack(tuple(get(p + f"attn_{x}.weight") for x in "qkv"))
            w[f"{i}.w_gate_up"] = QStack((get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")))
        if cfg.qkv_bias:
            w[f"{i}.bqkv"] = np.concatenate([get(p + f"attn_{x}.bias") for x in "qkv"])
        if cfg.qk_norm:
            w[f"{i}.q_norm"], w[f"{i}.k_norm"] = get(p + "attn_q_norm.weight"), get(p + "attn_k_norm.weight")
        if cfg.post_norms:
            w[f"{i}.post_attn_norm"] = get(p + "post_attention_norm.weight")
            w[f"{i}.post_ffn_norm"] = get(p + "post_ffw_norm.weight")
        w[f"{i}.wo"] = get(p + "attn_output.weight")
        w[f"{i}.ffn_norm"] = get(p + "ffn_norm.weight")
        w[f"{i}.w_down"] = get(p + "ffn_down.weight")
    return w


def vector(a: np.ndarray) -> np.ndarray:
    """A norm weight as float32 (BF16 arrives as its uint16 bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def dense_weights(weights: Mapping, cfg: ModelConfig, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """Every matrix dequantized to dtype (norms stay float32), with Q/K rows in Hugging Face
    order, and the config that goes with them (NEOX RoPE): for a backend without kernels on
    quantized weights."""
    out = {k: dequantize(v, dtype) if isinstance(v, (QTensor, QStack)) else v for k, v in weights.items()}
    if cfg.rope_style == "normal":
        q, k = cfg.n_heads * cfg.head_dim, cfg.kv_dim
        for i in range(cfg.n_layers):
            qkv = out[f"{i}.wqkv"]
            qkv[:q] = _halves_order(qkv[:q], cfg.n_heads)
            qkv[q : q + k] = _halves_order(qkv[q : q + k], cfg.n_kv_heads)
        cfg = replace(cfg, rope_style="neox")
    return out, cfg


def _halves_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Q or K rows of pairwise-RoPE order (llama.cpp's) -> rotate-halves order (Hugging Face's)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)
