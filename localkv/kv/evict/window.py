"""Sinks + recent window: which whole blocks may leave a block table, in what order, and
SlidingPolicy (StreamingLLM), which drops them. WindowPolicy is the part that h2o and
offload share: they keep the same window and differ in where a leaving block goes."""

from dataclasses import dataclass, field

import numpy as np

from localkv.errors import BudgetReached, LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.kv.evict.budget import EvictConfig, ceil_div
from localkv.kv.evict.protocol import AttendExtras, RoomPlan
from localkv.sequence import HOLE, Sequence
from localkv.stats import Stats


@dataclass(slots=True)
class TablePositions:
    """The first logical position each block-table entry holds (aligned with the table)."""

    block_size: int
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    next_pos: int = 0  # seq.num_computed at the last sync
    stored: int = 0  # seq.num_stored at the last sync

    def sync(self, seq: Sequence) -> "TablePositions":
        """Take in blocks that append_slots added at the end of the table."""
        n_new = len(seq.block_table) - len(self.start)
        if n_new < 0:
            raise RuntimeError(f"sequence {seq.id}'s table shrank outside its policy: a bug in the caller's logic")
        if n_new:
            # the old entries are all full; the new ones hold the newest tokens (even if a full
            # last block was evicted, so start[-1] + block_size would be wrong)
            first = seq.num_computed - (seq.num_stored - len(self.start) * self.block_size)
            self.start = np.concatenate([self.start, first + self.block_size * np.arange(n_new, dtype=np.int64)])
        self.next_pos, self.stored = seq.num_computed, seq.num_stored
        return self

    def positions(self, i: int) -> tuple[int, int]:
        s = int(self.start[i])
        return s, min(s + self.block_size, self.next_pos)

    def remove(self, i) -> None:
        self.start = np.delete(self.start, i)

    def by_position(self, block_table) -> np.ndarray:
        """block_table's blocks at their positions (int64, entry j for positions j * block_size
        on, up to next_pos), HOLE where a block left the table."""
        bs = self.block_size
        if len(block_table) != len(self.start) or (self.start % bs).any():
            raise RuntimeError(
                f"a table of {len(block_table)} blocks against {len(self.start)} positions, or a block off the "
                f"{bs}-token grid: a bug in the caller's logic"
            )
        out = np.full(ceil_div(self.next_pos, bs), HOLE, np.int64)
        out[self.start // bs] = block_table
        return out

    def copy(self) -> "TablePositions":
        return TablePositions(self.block_size, self.start.copy(), self.next_pos, self.stored)


def ref_counts(seq: Sequence, pool: BlockPool) -> list[int]:
    return [pool.blocks[b].ref_count for b in seq.block_table]


def over_budget(seq: Sequence, n_new: int, cfg: EvictConfig, block_size: int) -> int:
    """Blocks the table would exceed its resident share by after n_new more tokens (<= 0: fits)."""
    have = len(seq.block_table)
    need = max(0, ceil_div(seq.num_stored + n_new - have * block_size, block_size))
    return have + need - cfg.resident_blocks(block_size)


def candidates(table: TablePositions, cfg: EvictConfig, ref_counts, incoming: int = 0) -> np.ndarray:
    """Table indices that may go: past the sinks, wholly before the recent window (measured
    after `incoming` more tokens), not the partial last block, not shared."""
    bs = table.block_size
    horizon = table.next_pos + incoming - cfg.recent_tokens(bs)
    ok = (table.start >= cfg.sink_tokens(bs)) & (table.start + bs <= horizon) & (np.asarray(ref_counts) <= 1)
    if len(ok) and table.stored % bs:
        ok[-1] = False
    return np.flatnonzero(ok)


def choose_victims(table: TablePositions, n_blocks: int, cfg: EvictConfig, ref_counts, incoming: int = 0) -> list[int]:
    """Up to n_blocks table indices (ascending), the oldest that may go; fewer when not enough may."""
    if n_blocks <= 0:
        return []
    cand = candidates(table, cfg, ref_counts, incoming)
    return sorted(cand[np.argsort(table.start[cand], kind="stable")][:n_blocks].tolist())


def apply_eviction(
    seq: Sequence,
    table: TablePositions,
    victims: list[int],
    pool: BlockPool,
    stats: Stats,
    reason: str = "over budget",
    scores=None,
    reasons=None,
) -> None:
    """Drop table entries `victims`: release their blocks, one `evict` event each (with
    scores[j] and reasons[j] for victim j when given)."""
    victims = sorted(victims)
    events = [
        (
            seq.block_table[i],
            table.positions(i),
            float(scores[j]) if scores is not None else 0.0,
            reasons[j] if reasons is not None else reason,
        )
        for j, i in enumerate(victims)
    ]
    for i in reversed(victims):
        pool.release(seq.block_table.pop(i))
        table.remove(i)
    seq.num_stored -= len(victims) * table.block_size
    table.stored = seq.num_stored
    if victims:
        seq.hashable = False
    for bid, pos, score, why in events:
        stats.emit("evict", seq.id, bid, pos, score, why)


def check_plan(seq: Sequence, plan: RoomPlan, pool: BlockPool) -> None:
    """A plan names ascending indices of unshared full blocks of seq's current table."""
    v, table = plan.victims, seq.block_table
    full = len(table) - bool(seq.num_stored % pool.block_size)
    ascending = all(a < b for a, b in zip(v, v[1:]))
    if not ascending or any(not 0 <= i < full or pool.blocks[table[i]].ref_count != 1 for i in v):
        raise RuntimeError(
            f"room plan {v} does not fit sequence {seq.id}'s table of {len(table)} blocks "
            "(shared, partial or changed since planned): a bug in the caller's logic"
        )


@dataclass(slots=True)
class SeqState:
    """One sequence's state in a policy (h2o and offload extend it)."""

    table: TablePositions

    def sync(self, seq: Sequence) -> "SeqState":
        self.table.sync(seq)
        return self

    def fork(self) -> "SeqState":
        return SeqState(self.table.copy())


class WindowPolicy:
    """Keeps the sink blocks and the recent window; past the budget's resident share, the
    oldest other unshared full blocks leave the table. Subclasses implement remove (where
    they go) and, when attention reads more than the table, extras and after_forward."""

    can_roll_back = False  # what a step's tokens did (victims, attention mass, recalls) stays done
    bounded_context = False  # a sequence runs past the context: its oldest keys leave

    def __init__(self, config: EvictConfig, pool: BlockPool, stats: Stats):
        self.config = config.validate(pool.block_size)
        self.pool, self.stats, self.block_size = pool, stats, pool.block_size
        self.seqs: dict[int, SeqState] = {}  # seq.id -> its state, made on first use
        self.reason = f"{config.policy}: budget {config.budget} tokens"

    def new_state(self) -> SeqState:
        return SeqState(TablePositions(self.block_size))

    def state(self, seq: Sequence) -> SeqState:
        """seq's state, brought up to date with blocks appended since (changes nothing else)."""
        st = self.seqs.get(seq.id)
        if st is None:
            st = self.seqs[seq.id] = self.new_state()
        return st.sync(seq)

    def chunk_limit(self) -> int | None:
        return self.config.chunk_limit(self.block_size)

    def plan(self, seq: Sequence, n_new: int) -> RoomPlan:
        need = over_budget(seq, n_new, self.config, self.block_size)
        if need <= 0:
            return RoomPlan()
        victims = choose_victims(self.state(seq).table, need, self.config, ref_counts(seq, self.pool), n_new)
        if len(victims) < need:
            raise BudgetReached(
                f"KV budget of {self.config.budget} tokens is full and the remaining blocks are shared "
                "with another sequence"
            )
        return RoomPlan(victims)

    def reserve(self, plans: list[RoomPlan]) -> None:
        pass

    def make_room(self, seq: Sequence, plan: RoomPlan) -> None:
        if plan.victims:
            check_plan(seq, plan, self.pool)
            self.remove(seq, self.state(seq), plan.victims)

    def remove(self, seq: Sequence, state: SeqState, victims: list[int]) -> None:
        """Take table entries `victims` (checked: unshared full blocks) out of the pool."""
        raise NotImplementedError

    def extras(self, seq: Sequence) -> AttendExtras | None:
        return None

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None:
        pass

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """After KVManager.fork: the child starts from the parent's state (its own copy)."""
        self.seqs[child.id] = self.state(parent).fork()

    def free(self, seq: Sequence) -> None:
        self.seqs.pop(seq.id, None)

    def rollback(self, seq: Sequence, n: int) -> None:
        """Refused: the blocks a step's tokens pushed out of the window (and, for h2o, the
        attention mass of their queries) cannot be taken back."""
        raise LocalkvError(
            f"--evict {self.config.policy} cannot drop tokens once computed (it evicted or scored for them); "
            "use --evict none"
        )

    def active_tokens(self, seq: Sequence) -> int:
        return seq.num_stored


class SlidingPolicy(WindowPolicy):
    """StreamingLLM: blocks that leave the window are dropped."""

    def remove(self, seq: Sequence, state: SeqState, victims: list[int]) -> None:
        apply_eviction(seq, state.table, victims, self.pool, self.stats, self.reason)
