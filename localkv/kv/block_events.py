"""What the prefix cache holds, told as it changes: the pool and the disk tier report each full
block that becomes findable by its hash (stored) and each that stops being findable (removed),
for a KV-aware router. The log keeps a mirror of what is findable, so a new listener can be
told the whole state at once, from any thread, without touching the engine's structures.

A block is named by its chain hash (KVManager's: the model's salt, the parent's hash, the
tokens); stored carries its parent's hash and its tokens, so a listener can rebuild the chain
keys of its own from token ids alone, as vllm-router does.
"""

import threading
from dataclasses import dataclass

MEMORY = "GPU"  # vLLM's name for the tier the engine computes from: here the pool, in RAM
DISK = "DISK"


@dataclass(frozen=True, slots=True)
class Stored:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class Removed:
    hash: int
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Everything this process told of is gone (a listener forgets it all)."""


class BlockLog:
    """Events since the last take(), and the findable blocks per medium (the mirror)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list = []
        self._live: dict[str, dict[int, Stored]] = {MEMORY: {}, DISK: {}}

    def stored(self, h: int, parent: int | None, tokens: tuple[int, ...], medium: str):
        event = Stored(h, parent, tuple(tokens), medium)
        with self._lock:
            if h in self._live[medium]:
                return
            self._live[medium][h] = event
            self._events.append(event)

    def removed(self, h: int, medium: str):
        with self._lock:
            if self._live[medium].pop(h, None) is not None:
                self._events.append(Removed(h, medium))

    def take(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events

    def snapshot(self) -> list:
        """Cleared, then every findable block, parents before children within each medium."""
        with self._lock:
            live = {m: dict(blocks) for m, blocks in self._live.items()}
        return [Cleared(), *(e for blocks in live.values() for e in chain_order(blocks))]


def chain_order(blocks: dict[int, Stored]) -> list[Stored]:
    """The blocks with each one after its parent (when its parent is among them)."""
    children: dict[int | None, list[Stored]] = {}
    for e in blocks.values():
        children.setdefault(e.parent if e.parent in blocks else None, []).append(e)
    out, todo = [], list(reversed(children.get(None, [])))
    while todo:
        e = todo.pop()
        out.append(e)
        todo.extend(reversed(children.get(e.hash, [])))
    return out
