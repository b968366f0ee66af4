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
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")

    @property
    def kv_dim(self) -> int:
        """K (or V) values per token and layer."""
        return self.n_kv_heads * self.head_dim
