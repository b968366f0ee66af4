"""The server's own settings (the engine's are EngineConfig): where it listens and how much it
takes at once. `localkv serve`'s flags build it; validate() is the one check of its values."""

from dataclasses import dataclass

from localkv.errors import LocalkvError


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free one
    max_seqs: int = 64  # sequences decoded at once (n choices count n)
    max_queue: int = 256  # requests that may wait beyond max_seqs; past it: 429
    batch_tokens: int = 2048  # tokens one step runs over all requests
    api_key: str | None = None
    log_requests: bool = False
    shutdown_timeout: float = 15.0  # seconds requests in flight may take to finish on SIGTERM/SIGINT

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
        return self
