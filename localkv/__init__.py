"""localkv: local LLM inference over a paged KV cache."""

__version__ = "0.1.0"
