"""One ModelConfig for every model source (GGUF file or Hugging Face directory)."""

from dataclasses import dataclass, field


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
    fingerprint: str = ""  # identifies the weights (file sha256), keys caches
    n_params: int = 0
    file_size: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
