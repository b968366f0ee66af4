"""The server's numbers in Prometheus' text format: the block pool, the prefix cache, the
scheduler and the requests, and a histogram of the time to first token.

Counters of requests and tokens are kept here (the runner updates them on the engine's thread);
the pool and cache numbers are read from the engine when /metrics is asked (Snapshot)."""

import math
from dataclasses import dataclass, field

from localkv.stats import Stats

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float):
        i = next((i for i, b in enumerate(self.bounds) if v <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for bound, c in zip((*self.bounds, math.inf), list(self.counts)):
            acc += c
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return out + [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


@dataclass(slots=True)
class Counters:
    """What the runner counts as requests come and go (engine thread) and the HTTP side refuses."""

    requests: dict[str, int] = field(default_factory=dict)  # outcome -> count
    prompt_tokens: int = 0
    cached_tokens: int = 0
    warmed_tokens: int = 0  # prefilled while idle: finished chats' next prefixes (next_turn.py)
    generated_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))

    def count(self, outcome: str, n: int = 1):
        self.requests[outcome] = self.requests.get(outcome, 0) + n


@dataclass(slots=True)
class Snapshot:
    """The engine's state between two steps (read on the engine's thread)."""

    pool: dict  # BlockPool.usage()
    stats: Stats  # a copy of engine.stats
    preemptions: int
    running: int
    waiting: int

    @classmethod
    def of(cls, engine, scheduler) -> "Snapshot":
        return cls(
            engine.pool.usage(),
            engine.stats.snapshot(),
            scheduler.preemptions,
            len(scheduler.running),
            len(scheduler.waiting),
        )


# name, type, help: each metric's header, in the order they are written
_HELP = {
    "localkv_up": ("gauge", "1 once the model is loaded and requests are served, 0 while loading or failed"),
    "localkv_kv_blocks": (
        "gauge",
        "KV pool blocks by state: used (held), shared (held by more than one sequence), "
        "cached (free but keeping a prefix for reuse), free (empty)",
    ),
    "localkv_kv_blocks_total": ("gauge", "Blocks in the KV pool"),
    "localkv_kv_block_size_tokens": ("gauge", "Tokens per KV block"),
    "localkv_kv_bytes_per_token": ("gauge", "K/V bytes of one token over all layers, in the pool's format (dtype)"),
    "localkv_prefix_query_tokens_total": ("counter", "Prompt tokens looked up in the prefix cache"),
    "localkv_prefix_hit_tokens_total": ("counter", "Prompt tokens found in the prefix cache (memory or disk)"),
    "localkv_disk_hit_tokens_total": ("counter", "Prompt tokens loaded from the disk cache"),
    "localkv_cow_copies_total": ("counter", "Shared blocks copied on a branch's first write"),
    "localkv_evictions_total": ("counter", "Blocks evicted by the KV budget policy"),
    "localkv_n_drafted_total": ("counter", "Speculative tokens drafted and verified"),
    "localkv_n_drafted_accepted_total": ("counter", "Drafted tokens accepted"),
    "localkv_n_verify_passes_total": ("counter", "Sequence-steps that verified a draft"),
    "localkv_n_drafted_accepted_per_pos_total": (
        "counter",
        "Drafts whose token at this position (1 = the first drafted) was accepted",
    ),
    "localkv_preemptions_total": ("counter", "Requests preempted (blocks freed, recomputed later): the pool ran dry"),
    "localkv_requests_running": ("gauge", "Requests being computed"),
    "localkv_requests_waiting": ("gauge", "Requests queued for a seat or free blocks"),
    "localkv_requests_total": (
        "counter",
        "Requests by outcome: completed, cancelled (client went away), error, refused (queue full)",
    ),
    "localkv_prompt_tokens_total": ("counter", "Prompt tokens of accepted requests"),
    "localkv_cached_prompt_tokens_total": ("counter", "Prompt tokens of accepted requests taken from the prefix cache"),
    "localkv_warmed_tokens_total": (
        "counter",
        "Tokens prefilled while idle: finished chats' next prompts as the template writes them",
    ),
    "localkv_generated_tokens_total": ("counter", "Tokens generated"),
    "localkv_time_to_first_token_seconds": ("histogram", "From a request's arrival to its first token"),
}


def render(counters: Counters, snap: Snapshot | None) -> str:
    """The Prometheus text exposition (version 0.0.4)."""
    out: list[str] = []
    named: set[str] = set()

    def head(name: str):
        if name not in named:
            named.add(name)
            kind, text = _HELP[name]
            out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])

    def put(name: str, value, labels: str = ""):
        head(name)
        out.append(f"{name}{labels} {value}")

    put("localkv_up", int(snap is not None))
    if snap is not None:
        p = snap.pool
        for state, key in (("used", "used"), ("shared", "shared"), ("cached", "cached_free"), ("free", "free")):
            put("localkv_kv_blocks", p[key], f'{{state="{state}"}}')
        put("localkv_kv_blocks_total", p["blocks"])
        put("localkv_kv_block_size_tokens", p["block_size"])
        put("localkv_kv_bytes_per_token", p["bytes_per_block"] // p["block_size"], f'{{dtype="{p["kv_dtype"]}"}}')
        s = snap.stats
        put("localkv_prefix_query_tokens_total", s.prefix_queries)
        put("localkv_prefix_hit_tokens_total", s.prefix_hits)
        put("localkv_disk_hit_tokens_total", s.disk_hits)
        put("localkv_cow_copies_total", s.cow_copies)
        put("localkv_evictions_total", s.evictions)
        put("localkv_n_drafted_total", s.drafted)
        put("localkv_n_drafted_accepted_total", s.accepted)
        put("localkv_n_verify_passes_total", s.verify_passes)
        for i, n in enumerate(s.accepted_at):
            put("localkv_n_drafted_accepted_per_pos_total", n, f'{{position="{i + 1}"}}')
        put("localkv_preemptions_total", snap.preemptions)
        put("localkv_requests_running", snap.running)
        put("localkv_requests_waiting", snap.waiting)
    for outcome, n in sorted(dict(counters.requests).items()):
        put("localkv_requests_total", n, f'{{outcome="{outcome}"}}')
    put("localkv_prompt_tokens_total", counters.prompt_tokens)
    put("localkv_cached_prompt_tokens_total", counters.cached_tokens)
    put("localkv_warmed_tokens_total", counters.warmed_tokens)
    put("localkv_generated_tokens_total", counters.generated_tokens)
    head("localkv_time_to_first_token_seconds")
    out += counters.ttft.lines("localkv_time_to_first_token_seconds")
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped): for tests and the bench."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
