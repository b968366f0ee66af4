"""What the engine and the model see of a KV policy: the Policy protocol and the two small
records that cross it."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from localkv.kv.evict.budget import EvictConfig
from localkv.sequence import Sequence


@dataclass(slots=True)
class RoomPlan:
    """What make_room would do; computing it changes nothing."""

    victims: list[int] = field(default_factory=list)  # table indices that would leave the pool (unshared blocks)


@dataclass(slots=True)
class AttendExtras:
    """What one sequence's attention needs besides its block table, for one forward."""

    mass: np.ndarray | None = None  # h2o: [layers, kv_heads, n_extra + n_stored] float32, filled by the model
    kv: Callable[[int, Any], tuple | None] | None = None  # (layer, q [T, H, hd]) -> extra (K, V) [kv_heads, n, hd]


def to_host(x) -> np.ndarray:
    """A numpy view or copy of an array the model handed over (CuPy on a GPU)."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


class Policy(Protocol):
    """One per engine. Per step and sequence the engine calls plan (every sequence first: it
    may raise BudgetReached), then, once the pool check passed, make_room, append_slots,
    extras, the forward and after_forward. Committing a plan releases exactly
    len(plan.victims) blocks, so the engine can check the pool before anything changes."""

    config: EvictConfig

    def chunk_limit(self) -> int | None: ...  # most tokens one step may append to a sequence

    def plan(self, seq: Sequence, n_new: int) -> RoomPlan: ...

    def make_room(self, seq: Sequence, plan: RoomPlan) -> None: ...

    def extras(self, seq: Sequence) -> AttendExtras | None: ...

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None: ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...

    def active_tokens(self, seq: Sequence) -> int: ...  # K/V tokens one layer attended to in seq's last forward
