"""How far a prompt's prefill has come: what the engine layer reports through a callback and
front ends show (a bar on a terminal's stderr, the reply's frame in the TUI)."""

from dataclasses import dataclass

SHOW_AFTER_S = 2.0  # front ends show the progress of prefills expected to take longer than this


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    done: int  # prompt tokens whose K/V is in place (the cached ones included)
    total: int  # prompt tokens
    cached: int  # of them, taken from the prefix cache (memory or disk) instead of computed
    elapsed_s: float  # since the request started

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    @property
    def rate(self) -> float:
        """Computed tokens per second."""
        return (self.done - self.cached) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def expected_s(self) -> float:
        """The whole prefill's expected duration at the rate so far (0 before any token is computed)."""
        rate = self.rate
        return self.elapsed_s + (self.total - self.done) / rate if rate > 0 else 0.0

    @property
    def long(self) -> bool:
        """Whether the prefill is expected to take long enough to show its progress."""
        return self.expected_s > SHOW_AFTER_S

    def summary(self) -> str:
        cached = f" · {self.cached} cached" if self.cached else ""
        return f"prefill {self.done}/{self.total} tokens · {self.rate:.0f} tok/s{cached}"
