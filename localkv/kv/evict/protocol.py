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
    """One per engine. A step is planned once (kv/step_plan.py): plan for every sequence (it
    may raise BudgetReached; again only for a batch the scheduler changed after a preemption).
    Once the pool check passed, the commit calls reserve with every plan, then per sequence
    make_room, append_slots, extras, the forward and after_forward. plan changes nothing, and
    committing a plan releases exactly len(plan.victims) blocks, so the pool is checked before
    anything changes; reserve takes whatever else the plans need (and may raise, changing
    nothing) so that make_room cannot fail part-way."""

    config: EvictConfig

    def chunk_limit(self) -> int | None: ...  # most tokens one step may append to a sequence

    def plan(self, seq: Sequence, n_new: int) -> RoomPlan: ...

    def reserve(self, plans: list[RoomPlan]) -> None: ...

    def make_room(self, seq: Sequence, plan: RoomPlan) -> None: ...

    def extras(self, seq: Sequence) -> AttendExtras | None: ...

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None: ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...

    def rollback(self, seq: Sequence, n: int) -> None: ...  # forget seq's last n tokens, or raise LocalkvError

    def active_tokens(self, seq: Sequence) -> int: ...  # K/V tokens one layer attended to in seq's last forward
