"""EngineConfig: every setting an engine is built from, its defaults and its checks, in one place;
ServeOptions: the server's own (here, not in serve/, so that `localkv serve`'s flags take their
defaults without loading the server).

Front ends (CLI, TUI, bench, server) build an EngineConfig, an Engine takes it whole, and a variant is
`dataclasses.replace(config, ...)`. validate() runs before any model loads, so a bad flag
fails in a fraction of a second.
"""

from dataclasses import dataclass, field
from pathlib import Path

from localkv import kv_format
from localkv.backends import DEVICES
from localkv.errors import LocalkvError
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.spec import control as speculation
from localkv.units import parse_size

PREFILL_CHUNK = 512  # most tokens of one prompt in a forward pass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # catalog name, .gguf path or Hugging Face directory; None: the default model
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None  # CPU threads for matrix math; None: all cores
    block_size: int = 16  # tokens per KV block
    kv_mem: int | str = "1GiB"  # memory of the KV block pool
    prefill_chunk: int = PREFILL_CHUNK  # most prompt tokens per forward pass
    prefix_cache: bool = True  # reuse full blocks of earlier prompts (memory, and disk if disk_cache)
    disk_cache: bool = True  # keep prompt blocks on disk between processes
    disk_cache_size: int | str = "2GiB"  # LRU cap of the disk cache
    evict: EvictConfig = field(default_factory=EvictConfig)  # KV budget per sequence and what happens past it
    offload_dir: str | None = None  # offload policy: spill blocks to a file here instead of RAM
    kv_dtype: str = "auto"  # K/V pool: auto (the backend's default), f32, f16, q8_0, q4_0 or K:V (kv_format.parse)
    kv_rotate: bool = True  # a quantized K or V is stored rotated (kv/rotation.py); a float pool never is
    ctx: int | None = None  # most tokens one sequence may hold (prompt + reply); None: the model's context
    spec: str = "off"  # speculative decoding: off | ngram | draft (spec/control.py says why the defaults)
    draft_model: str | None = None  # --spec draft: a model of the same vocabulary, resolved as `model` is
    spec_max: int = 0  # most tokens a sequence drafts per verify pass; 0: its mode's (spec/control.k_max)
    spec_ngram_max: int = speculation.NGRAM_MAX  # longest n-gram of the context's end looked up
    spec_ngram_min: int = speculation.NGRAM_MIN  # shortest

    def __post_init__(self):
        # sizes arrive as text from flags; they are kept as bytes
        if self.evict is None:
            object.__setattr__(self, "evict", EvictConfig())
        object.__setattr__(self, "kv_mem", parse_size(self.kv_mem))
        object.__setattr__(self, "disk_cache_size", parse_size(self.disk_cache_size))
        for name in ("model", "draft_model"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        if self.offload_dir is not None:
            object.__setattr__(self, "offload_dir", str(Path(self.offload_dir)))

    def validate(self) -> "EngineConfig":
        """Raise LocalkvError for any value no engine can be built with; return self."""
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise LocalkvError(f"invalid block size {bs}: use a power of two (16 is the default)")
        if self.prefill_chunk < 1:
            raise LocalkvError(f"invalid prefill chunk {self.prefill_chunk}: must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise LocalkvError(f"invalid thread count {self.threads}: must be >= 1")
        if (self.device or "").strip().lower() not in DEVICES:
            raise LocalkvError(f"unknown device {self.device!r}: use one of {', '.join(DEVICES)}")
        if self.kv_mem < 1:
            raise LocalkvError("invalid --kv-mem 0: the KV pool needs memory")
        if self.ctx is not None and self.ctx < 2:
            raise LocalkvError(f"invalid --ctx {self.ctx}: a sequence needs at least 2 tokens (a prompt and a reply)")
        if self.kv_dtype != "auto":
            kv_format.parse(self.kv_dtype)
        self.evict.validate(bs)
        speculation.check(self.spec, self.spec_max, self.spec_ngram_max, self.spec_ngram_min, self.draft_model)
        return self

    def to_dict(self) -> dict:
        """Plain values (JSON-ready), e.g. for a child process; from_dict() reverses it."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["evict"] = {f: getattr(self.evict, f) for f in self.evict.__dataclass_fields__}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return cls(**(d | {"evict": EvictConfig(**d.get("evict", {}))}))


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """The server's settings: where it listens and how much it takes at once. `localkv serve`'s
    flags build it; validate() is the one check of its values."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free one
    max_seqs: int = 64  # sequences decoded at once (n choices count n)
    max_queue: int = 256  # requests that may wait beyond max_seqs; past it: 429
    batch_tokens: int = 2048  # tokens one step runs over all requests
    api_key: str | None = None
    log_requests: bool = False
    shutdown_timeout: float = 15.0  # seconds requests in flight may take to finish on SIGTERM/SIGINT
    # KV events for KV-aware routers (serve/kv_events.py): ZeroMQ endpoints, the topic frame
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    # sampling for requests that do not set it, over the model's catalog defaults (--no-think,
    # --reasoning-budget: llama-server's server-wide reasoning settings)
    defaults: dict = field(default_factory=dict)

    def validate(self) -> "ServeOptions":
        """Raise LocalkvError for a value no server can run with, naming its flag; return self."""
        if not 0 <= self.port <= 65535:
            raise LocalkvError(f"invalid --port {self.port}: must be in 0..65535")
        if self.max_seqs < 1:
            raise LocalkvError(f"invalid --max-seqs {self.max_seqs}: must be >= 1")
        if self.max_queue < 0:
            raise LocalkvError(f"invalid --max-queue {self.max_queue}: must be >= 0")
        if self.batch_tokens < 1:
            raise LocalkvError(f"invalid --batch-tokens {self.batch_tokens}: must be >= 1")
        if not 0 <= self.shutdown_timeout <= 86400:  # also refuses NaN
            raise LocalkvError(f"invalid --shutdown-timeout {self.shutdown_timeout:g}: must be in 0..86400 seconds")
        if self.kv_events_replay and not self.kv_events:
            raise LocalkvError("--kv-events-replay needs --kv-events (the endpoint the events are published at)")
        SamplingParams(**self.defaults).validate()  # at start, not in every request
        return self
