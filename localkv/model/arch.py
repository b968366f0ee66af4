"""What each architecture's forward does beyond Llama's, as data.

An Arch says which optional steps of the one forward (model/llama.py) a family switches on;
`describe` reads it and the GGUF metadata into ModelConfig fields, and the forward reads only
those. The values follow llama.cpp (llama-model.cpp's hyperparameters, src/models/*.cpp):

- llama (Llama 2/3.x, Mistral, SmolLM): the base. Llama 3.x's rope scaling arrives as the
  rope_freqs tensor (per-frequency divisors, ModelConfig.rope_freq_factors); the converter
  permuted Q/K rows for pairwise RoPE.
- qwen2: q/k/v biases. qwen3: RMSNorm of every q and k head before RoPE.
- gemma2 / gemma3: embeddings times sqrt(dim), GeGLU, RMSNorm of the attention and MLP outputs
  (the converter stored Gemma's norm weights as 1 + w: plain RMSNorm here), queries scaled by
  1/sqrt(head_dim) (1/sqrt(dim/heads) for the 27B models, as llama.cpp picks by layer count),
  sliding-window layers among global ones. Gemma 2: every other layer local, attention and
  final logit soft-capping. Gemma 3: 5 local : 1 global, local layers on their own RoPE base,
  q/k norms, no soft-capping.
- phi3: fused attn_qkv and ffn_up [gate; up] tensors; the 128k models' LongRoPE (short factors
  up to the original context, long past it, chosen by the serving context as llama.cpp does)
  and attention factor. Its sliding window is off (llama.cpp disables it for Phi-3).
"""

import math
from dataclasses import dataclass

from localkv.errors import ModelError
from localkv.model.config import ModelConfig
from localkv.model.validate import MAX_CONTEXT, Meta


@dataclass(frozen=True, slots=True)
class Arch:
    """The optional steps of one architecture's forward (defaults: Llama's)."""

    rope_style: str = "neox"  # the Q/K row order the converter wrote (ModelConfig.rope_style)
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    gemma: bool = False  # embedding scale, GeGLU, post-norms, Gemma's query scale
    local_every: int = 0  # of every n layers the first n - 1 are local (sliding window); 0: none
    window: int = 0  # the window when the metadata names none; 0: the metadata must
    softcaps: tuple[float, float] | None = None  # default (attention, final) soft-caps, read from the metadata
    local_rope_base: float = 0.0  # the local layers' RoPE base when the metadata names none; 0: the model's
    big_layers: int = 0  # the layer count of the model whose query scale is 1/sqrt(dim/heads) (Gemma 27B)


ARCHITECTURES = {
    "llama": Arch(rope_style="normal"),  # convert_hf_to_gguf permutes llama's Q/K rows for pairwise RoPE
    "qwen2": Arch(qkv_bias=True),
    "qwen3": Arch(qk_norm=True),
    "gemma2": Arch(gemma=True, local_every=2, window=4096, softcaps=(50.0, 30.0), big_layers=46),
    "gemma3": Arch(gemma=True, qk_norm=True, local_every=6, local_rope_base=10000.0, big_layers=62),
    "phi3": Arch(fused=True),
}


def describe(cfg: ModelConfig, spec: Arch, m: Meta):
    """Fill cfg's architecture fields from spec and the metadata (m reads "{arch}." keys)."""
    cfg.rope_style, cfg.qkv_bias, cfg.qk_norm, cfg.fused = spec.rope_style, spec.qkv_bias, spec.qk_norm, spec.fused
    _rope_scaling(cfg, m)
    if spec.gemma:
        cfg.post_norms, cfg.mlp, cfg.embed_scale = True, "gelu", math.sqrt(cfg.dim)
        width = cfg.dim / cfg.n_heads if cfg.n_layers == spec.big_layers else cfg.head_dim
        cfg.attn_scale = 1.0 / math.sqrt(width)
    if spec.softcaps is not None:
        cfg.attn_softcap = m.number("attn_logit_softcapping", spec.softcaps[0], 0.0, float("inf"))
        cfg.final_softcap = m.number("final_logit_softcapping", spec.softcaps[1], 0.0, float("inf"))
    if spec.local_every:
        n = spec.local_every
        cfg.sliding_window = m.integer("attention.sliding_window", spec.window or None, hi=MAX_CONTEXT)
        cfg.local_layers = tuple(i for i in range(cfg.n_layers) if i % n < n - 1)
    if spec.local_rope_base:
        cfg.rope_theta_local = m.number("rope.freq_base_swa", spec.local_rope_base, 0.0, float("inf"))


def _rope_scaling(cfg: ModelConfig, m: Meta):
    """Linear scaling, LongRoPE's original context and attention factor, as llama.cpp reads
    them for every architecture; YaRN is refused rather than run wrong."""
    kind = m.values.get(m.prefix + "rope.scaling.type", "linear")
    if kind not in ("linear", "none"):
        raise ModelError(f"{m.source}: RoPE scaling {kind!r} is not supported (localkv runs linear scaling only)")
    key = "rope.scaling.factor" if m.prefix + "rope.scaling.factor" in m.values else "rope.scale_linear"
    factor = m.number(key, 1.0, 0.0, float("inf")) if m.prefix + key in m.values else 1.0
    cfg.rope_scale = 1.0 if kind == "none" or factor == 0.0 else factor
    cfg.rope_attn_factor = m.number("rope.scaling.attn_factor", 1.0, 0.0, float("inf"))
    cfg.rope_orig_ctx = m.integer("rope.scaling.original_context_length", cfg.ctx_len, hi=MAX_CONTEXT)
