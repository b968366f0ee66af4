"""One ModelConfig for every model source (GGUF file or Hugging Face directory).

What differs between architectures is data here (rope_style, rope_freq_factors, ...), read by
the one forward pass in llama.py; the loaders fill it in and check it (model/validate.py)
before anything is allocated.
"""

from dataclasses import dataclass, field

ROPE_STYLES = ("neox", "normal")
# neox: rotate the two halves of each head (Hugging Face's rotate_half; GGUFs whose converter
#       keeps Hugging Face's row order, and Hugging Face directories)
# normal: rotate adjacent pairs (2i, 2i+1) (llama.cpp's LLAMA_ROPE_TYPE_NORM: llama-architecture
#       GGUFs, whose converter permuted the Q/K rows for it; the rows stay as the file has them)


@dataclass(slots=True)
class ModelConfig:
    name: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ctx_len: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    head_dim: int = 0  # 0: dim // n_heads
    tied_embeddings: bool = True
    bos_id: int | None = None
    eos_id: int | None = None
    quant: str = "F32"
    fingerprint: str = ""  # identifies the weights, keys caches
    n_params: int = 0
    file_size: int = 0
    arch: str = "llama"
    rope_style: str = "neox"  # see ROPE_STYLES
    rope_freq_factors: tuple[float, ...] | None = None  # per frequency divisor (Llama 3's rope_freqs), or None
    # What an architecture's forward does beyond Llama's (model/arch.py describes each; the
    # defaults are Llama's). The one forward (model/llama.py) reads these, never the arch name.
    qkv_bias: bool = False  # biases added to the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of every q and k head before RoPE (Qwen3, Gemma 3)
    fused: bool = False  # one attn_qkv [q; k; v] and one ffn_up [gate; up] tensor (Phi-3)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add (Gemma)
    mlp: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    embed_scale: float = 1.0  # the embeddings are multiplied by it on the way in (Gemma: sqrt(dim))
    attn_scale: float = 0.0  # the queries' scale; 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax (Gemma 2); 0: none
    final_softcap: float = 0.0  # the same on the logits (Gemma 2); 0: none
    sliding_window: int = 0  # keys a local layer's query sees, its own included
    local_layers: tuple[int, ...] = ()  # the layers that attend to the sliding window only
    rope_theta_local: float = 0.0  # the local layers' RoPE base (Gemma 3); 0: rope_theta
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by it (rope.scaling.factor)
    rope_attn_factor: float = 1.0  # multiplies cos and sin (Phi-3 LongRoPE's attention factor)
    rope_factors_long: tuple[float, ...] | None = None  # LongRoPE: these past rope_orig_ctx, else rope_freq_factors
    rope_orig_ctx: int = 0  # the context LongRoPE's short factors are for
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        if self.mlp not in ("silu", "gelu"):
            raise ValueError(f"mlp must be 'silu' or 'gelu', got {self.mlp!r}")

    @property
    def kv_dim(self) -> int:
        """K (or V) values per token and layer."""
        return self.n_kv_heads * self.head_dim
