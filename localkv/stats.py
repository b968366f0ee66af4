"""One source of KV numbers: counters plus a bounded event log. The CLI's --verbose and
--json, `localkv bench` and the TUI panel all read it."""

import time
from collections import deque
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Event:
    kind: str  # evict | offload | recall | cow | prefix_hit | disk_hit
    seq: int
    block: int
    positions: tuple[int, int] = (0, 0)  # logical token range [start, end)
    score: float = 0.0
    reason: str = ""
    t: float = field(default_factory=time.time)


@dataclass(slots=True)
class Stats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found (memory or disk)
    disk_hits: int = 0  # of the hits, tokens loaded from the disk store
    cow_copies: int = 0
    evictions: int = 0
    offloads: int = 0
    recalls: int = 0
    drafted: int = 0  # speculative tokens drafted and verified
    accepted: int = 0  # of which accepted
    verify_passes: int = 0  # sequence-steps that verified a draft
    accepted_at: list[int] = field(default_factory=list)  # [i]: drafts whose token i + 1 was accepted
    events: deque = field(default_factory=lambda: deque(maxlen=512))

    def emit(self, kind: str, seq: int, block: int, positions=(0, 0), score: float = 0.0, reason: str = ""):
        self.events.append(Event(kind, seq, block, positions, score, reason))
        counter = _COUNTERS.get(kind)
        if counter:
            setattr(self, counter, getattr(self, counter) + 1)

    def count_draft(self, drafted: int, accepted: int):
        """A verify pass of `drafted` tokens accepted the first `accepted`."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_passes += 1
        if accepted > len(self.accepted_at):
            self.accepted_at.extend([0] * (accepted - len(self.accepted_at)))
        for i in range(accepted):
            self.accepted_at[i] += 1

    def snapshot(self, events: int = 0) -> "Stats":
        """A copy that stays as it is while the engine moves on: the counters now and the last
        `events` events. Take it on the engine's thread (the event deque must not be iterated
        while another thread appends to it)."""
        last = list(self.events)[-events:] if events > 0 else []
        return replace(self, events=deque(last, maxlen=self.events.maxlen), accepted_at=list(self.accepted_at))


_COUNTERS = {"evict": "evictions", "offload": "offloads", "recall": "recalls", "cow": "cow_copies"}
