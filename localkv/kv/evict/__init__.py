"""Bounded KV memory per sequence: which whole blocks leave a block table past a budget, and
where they go. One Policy object per engine, made by make_policy from an EvictConfig:

- none: tables only grow; with a budget, a step that would pass it raises BudgetReached;
- sliding (window.py): sinks + recent window, the oldest other blocks are dropped;
- h2o (h2o.py): the same window, plus per-layer-head heavy-hitter tokens past the table;
- offload (offload.py): the same window, leaving blocks move to a host tier and each layer
  reads back its best ones per forward.

The partially filled last block, the sink blocks and a shared block (ref_count > 1) never
leave. Design and measurements: docs/EVICTION.md.
"""

from pathlib import Path

from localkv.errors import BudgetReached
from localkv.kv.block_pool import BlockPool
from localkv.kv.evict.budget import POLICIES, EvictConfig
from localkv.kv.evict.h2o import H2OPolicy
from localkv.kv.evict.offload import OffloadPolicy
from localkv.kv.evict.protocol import AttendExtras, Policy, RoomPlan
from localkv.kv.evict.window import SlidingPolicy
from localkv.sequence import Sequence
from localkv.stats import Stats

__all__ = ["POLICIES", "AttendExtras", "EvictConfig", "NoPolicy", "Policy", "RoomPlan", "make_policy"]


class NoPolicy:
    """Policy none: nothing leaves a table; with a budget, a step past it raises BudgetReached."""

    can_roll_back = True
    bounded_context = True

    def __init__(self, config: EvictConfig, pool: BlockPool, stats: Stats):
        self.config = config.validate(pool.block_size)

    def chunk_limit(self) -> int | None:
        return None

    def plan(self, seq: Sequence, n_new: int) -> RoomPlan:
        budget = self.config.budget
        if budget is not None and seq.num_stored + n_new > budget:
            raise BudgetReached(
                f"KV budget of {budget} tokens is full (policy none; choose --evict sliding, h2o or offload "
                "to keep going)"
            )
        return RoomPlan()

    def reserve(self, plans: list[RoomPlan]) -> None:
        pass

    def make_room(self, seq: Sequence, plan: RoomPlan) -> None:
        if plan.victims:
            raise RuntimeError("policy none evicts nothing: a plan with victims is a bug in the caller's logic")

    def extras(self, seq: Sequence) -> AttendExtras | None:
        return None

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None:
        pass

    def fork(self, parent: Sequence, child: Sequence) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass

    def rollback(self, seq: Sequence, n: int) -> None:
        pass  # nothing here depends on the tokens: the block table is all there is

    def active_tokens(self, seq: Sequence) -> int:
        return seq.num_stored


def make_policy(cfg: EvictConfig, pool: BlockPool, stats: Stats, offload_dir: Path | str | None = None) -> Policy:
    """The policy cfg names, validated for the pool's block size (a LocalkvError says what to
    change); offload opens its tier (a spill file under offload_dir, if given) here."""
    cfg.validate(pool.block_size)
    if cfg.policy == "offload":
        return OffloadPolicy(cfg, pool, stats, offload_dir)
    return {"none": NoPolicy, "sliding": SlidingPolicy, "h2o": H2OPolicy}[cfg.policy](cfg, pool, stats)
