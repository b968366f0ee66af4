"""What the engine and the model see of a KV policy: the Policy protocol and the small records
that cross it."""

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
class PositionedKV:
    """One layer's keys by absolute position, per kv head, as the causal kernel reads them: so a
    recalled block sits where it was computed, and a key set with holes attends with the bits
    of the full cache for the keys it has."""

    tables: np.ndarray  # int64 [kv_heads, ceil(n_ctx / block_size)]: pool block, HOLE, or extra_entry(i)
    n_ctx: int  # positions, holes included; the queries are the last of them
    extra: tuple | None = None  # (K, V) [kv_heads, n, block_size, hd] in the pool's dtype (recalled blocks)


@dataclass(slots=True)
class AttendExtras:
    """What one sequence's attention needs besides its block table, for one forward. A backend
    that takes per-kv-head tables (attention option "head_tables") reads `positioned` where it
    is given, the others `kv`."""

    mass: np.ndarray | None = None  # h2o: [layers, kv_heads, n_extra + n_stored] float32, filled by the model
    kv: Callable[[int, Any], tuple | None] | None = None  # (layer, q [T, H, hd]) -> extra (K, V) [kv_heads, n, hd]
    positioned: Callable[[int, Any], PositionedKV] | None = None  # (layer, q [T, H, hd]) -> the layer's keys


def to_host(x) -> np.ndarray:
    """A numpy view or copy of an array the model handed over (CuPy on a GPU)."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


class Policy(Protocol):
    """One per engine. Each step is planned once (kv/step_plan.py): plan for every sequence of
    the batch (it may raise BudgetReached), again only over a batch the scheduler changed (a
    preemption, a sequence out of budget); plan changes nothing. Once the pool check passed,
    the commit calls reserve with all the plans, make_room per sequence, append_slots, then per
    sequence extras, the forward and after_forward. Committing a plan releases exactly
    len(plan.victims) blocks, so the pool is checked before anything changes; reserve takes
    what else the plans need (it may raise, changing nothing), so make_room cannot fail
    part-way. After the forward a step's last tokens may be rolled back (StepPlan): rollback
    forgets them, or raises LocalkvError, changing nothing, if the policy acted on them."""

    config: EvictConfig
    can_roll_back: bool  # a step's last tokens can be forgotten after its forward (speculation)
    bounded_context: bool  # a sequence ends at the context (True), or runs past it by evicting

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
