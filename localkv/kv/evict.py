"""Bounded KV memory: which whole blocks leave a sequence's block table, and where they go.

Policies (EvictConfig.policy):
- none: the table only grows (the default).
- sliding: StreamingLLM. Keep the sink blocks (the first `sinks` tokens, rounded up to
  whole blocks) and the recent window; drop the oldest other blocks first.
- h2o: Heavy-Hitter Oracle, per token, per layer and per kv head. The budget is split
  between a resident set in the pool (sinks + recent window, half of the room) and, for
  every layer and kv head, `heavy` token slots (the other half). A block that leaves the
  recent window leaves the pool; each layer-head keeps those of its 16 tokens that, with
  the heavy hitters it already holds, have the most accumulated attention mass in that
  layer-head, and drops the rest (see HeavyHitters). What each layer-head keeps is its own:
  compacted K/V rows read as extra keys by that layer's attention.
- offload: the budget is split between a resident set in the pool (sinks + recent window)
  and per-layer recall slots. Blocks leaving the recent window move, oldest first, to a
  host tier (RAM, or a memmap file) instead of being dropped. In every forward, each layer
  (and each kv head) reads back its best offloaded blocks for its current queries (Quest's
  bound keeps 3x the candidates, the exact largest q·k over their keys picks), as many as
  the recall slots hold, and attends to them with the resident blocks (see Retriever).

Why h2o is per token and per layer-head (perplexity of SmolLM2 on 4,096 tokens of GPL-3.0,
blocks of 16; sliding: 20.327 / 19.012 / 18.600 at 10 / 20 / 30% budgets): whole blocks
ranked by the score summed over layers lost to sliding at 20% and 30% with every recent
share and decay tried (19.026-19.065 at 20%); in a masked full-cache simulation, whole
blocks per layer-head lost too (19.051 at 20%, 10% heavy), and one token set shared by all
layers lost at 30%. This design, half the room for heavy hitters: 19.585 / 18.575 / 18.244,
below sliding at every budget (a quarter or 70% of the room did worse in simulation). A
block spends 16 slots on each heavy token it keeps, and a token heavy for one layer-head is
rarely heavy for all of them.

Keys already carry RoPE, so attention reads whichever keys it is given and new tokens keep
their positions (from num_computed); the table stays ordered by position. The partially
filled last block and the sink blocks never leave, nor a block whose ref_count is above 1
(shared with a fork, or another sequence's prefix).

Scores (h2o). The model fills one `mass` array per span, [layers, kv_heads, heavy + n_ctx]:
the attention weight each key received in that layer, summed over the span's queries and
the kv head's query heads (heavy hitters first, then the table's tokens). Scores are H2O's
sums over prefill and decode, fading by `decay` (0.999) per query: a half-life of about 700
queries, so a token that was heavy long ago yields to one heavy now. Measured at 10 / 20 /
30%: no decay 20.086 / 18.694 / 18.310; 0.999: 19.585 / 18.575 / 18.244; 0.998: 19.538 /
18.649 / 18.300; 0.995: 19.514 / 18.745 / 18.428.

Budget arithmetic (block_size B, all in tokens): after a step a sequence holds the sink
blocks plus the blocks that meet the last `recent` positions (at most ceil(recent/B) + 1
blocks), so validate() asks budget >= sinks + ceil(recent/B)*B + B + side slots, where the
side slots are offload's per-layer recall slots (recall_blocks()) or h2o's heavy-hitter
slots (heavy_tokens()). The pool then holds at most resident_blocks() = budget - side
slots, and each layer attends to at most the budget. A prefill chunk under a budget must
be at most chunk_limit() tokens.
"""

import copy
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv.errors import LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.sequence import Sequence
from localkv.stats import Stats

POLICIES = ("none", "sliding", "h2o", "offload")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


# ------------------------------------------------------------ configuration


@dataclass(slots=True)
class EvictConfig:
    policy: str = "none"  # none | sliding | h2o | offload
    budget: int | None = None  # tokens of KV one sequence may hold in the pool
    sinks: int = 4  # leading tokens always kept (rounded up to whole blocks)
    recent: int | None = None  # trailing tokens always kept; None: see recent_tokens()
    heavy_share: float = 0.5  # h2o: share of the room past sinks spent on per-layer-head heavy-hitter slots
    decay: float = 0.999  # h2o: scores fade by this factor per query (1.0: plain H2O sums)
    recall_share: float = 0.9  # offload: share of the room past sinks spent on per-layer recall slots
    rerank: int = 3  # offload: Quest keeps rerank x the recall slots as candidates for the exact pass

    def validate(self, block_size: int) -> "EvictConfig":
        if self.policy not in POLICIES:
            raise LocalkvError(f"unknown KV policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        for name in ("budget", "sinks", "recent"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise LocalkvError(f"invalid KV {name} {value}: must be >= 0")
        if self.policy == "none":
            return self
        if self.budget is None:
            raise LocalkvError(f"KV policy {self.policy!r} needs a budget (tokens of KV per sequence)")
        for name in ("recall_share", "heavy_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise LocalkvError(f"invalid {name.replace('_', ' ')} {getattr(self, name)}: must be in [0, 1)")
        bs, sinks, recent = block_size, self.sink_tokens(block_size), self.recent_tokens(block_size)
        need = sinks + _ceil(recent, bs) * bs + bs + self._side_blocks(bs) * bs
        if self.budget_blocks(bs) * bs < need:
            raise LocalkvError(
                f"KV budget {self.budget} tokens is too small: sinks ({sinks}, whole blocks of {bs}) "
                f"+ recent window ({recent}, whole blocks) + one block ({bs}) need {need}"
            )
        return self

    def sink_tokens(self, block_size: int) -> int:
        return _ceil(self.sinks, block_size) * block_size

    def budget_blocks(self, block_size: int) -> int:
        return (self.budget or 0) // block_size

    def _room_blocks(self, block_size: int) -> int:
        """Blocks of the budget past the sinks and the one spare (partial) block."""
        return max(0, self.budget_blocks(block_size) - 1 - self.sink_tokens(block_size) // block_size)

    def _side_blocks(self, block_size: int) -> int:
        """Blocks' worth of the budget held outside the pool's table: offload's recall slots or
        h2o's heavy-hitter slots (per layer, and per kv head). With an explicit recent window,
        all the room it leaves."""
        share = {"offload": self.recall_share, "h2o": self.heavy_share}.get(self.policy)
        if share is None:
            return 0
        room = self._room_blocks(block_size)
        if self.recent is not None:
            return max(0, room - _ceil(self.recent, block_size))
        return min(max(0, room - 1), int(room * share))

    def recall_blocks(self, block_size: int) -> int:
        """Offload: blocks each layer may read back from the host tier per step (0 otherwise)."""
        return self._side_blocks(block_size) if self.policy == "offload" else 0

    def heavy_tokens(self, block_size: int) -> int:
        """h2o: heavy-hitter tokens each layer and kv head may keep past the table (0 otherwise)."""
        return self._side_blocks(block_size) * block_size if self.policy == "h2o" else 0

    def resident_blocks(self, block_size: int) -> int:
        """Blocks a sequence may hold in the pool: the budget less the side slots."""
        return self.budget_blocks(block_size) - self._side_blocks(block_size)

    def recent_tokens(self, block_size: int) -> int:
        """Explicit, or all the room past sinks and one spare block that the side slots leave
        (sliding: all of it; h2o: half, heavy_share; offload: a tenth, recall_share)."""
        if self.recent is not None:
            return self.recent
        return (self._room_blocks(block_size) - self._side_blocks(block_size)) * block_size

    def chunk_limit(self, block_size: int) -> int | None:
        """The most tokens one step may append to a sequence and still end within budget."""
        return None if self.policy == "none" else max(1, self.recent_tokens(block_size))


# ------------------------------------------------------------ per-sequence state


@dataclass(slots=True)
class SeqKV:
    """Per table entry: the first logical position it holds."""

    block_size: int
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    next_pos: int = 0  # seq.num_computed at the last sync
    stored: int = 0  # seq.num_stored at the last sync

    def sync(self, seq: Sequence) -> "SeqKV":
        """Take in blocks that append_slots added at the end of the table."""
        n_new = len(seq.block_table) - len(self.start)
        assert n_new >= 0, "block table shrank outside the eviction layer"
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

    def copy(self) -> "SeqKV":
        return SeqKV(self.block_size, self.start.copy(), self.next_pos, self.stored)


def ref_counts(seq: Sequence, pool: BlockPool) -> list[int]:
    return [pool.blocks[b].ref_count for b in seq.block_table]


def over_budget(seq: Sequence, n_new: int, cfg: EvictConfig, block_size: int) -> int:
    """Blocks the table would exceed the budget by after n_new more tokens (<= 0: fits)."""
    if cfg.policy == "none":
        return 0
    have = len(seq.block_table)
    need = max(0, _ceil(seq.num_stored + n_new - have * block_size, block_size))
    return have + need - cfg.resident_blocks(block_size)


# ------------------------------------------------------------ choosing and evicting


def candidates(state: SeqKV, cfg: EvictConfig, ref_counts, incoming: int = 0) -> np.ndarray:
    """Table indices that may go: past the sinks, wholly before the recent window (measured
    after `incoming` more tokens), not the partial last block, not shared."""
    bs = state.block_size
    horizon = state.next_pos + incoming - cfg.recent_tokens(bs)
    ok = (state.start >= cfg.sink_tokens(bs)) & (state.start + bs <= horizon) & (np.asarray(ref_counts) <= 1)
    if len(ok) and state.stored % bs:
        ok[-1] = False
    return np.flatnonzero(ok)


def choose_victims(state: SeqKV, n_blocks_needed: int, cfg: EvictConfig, ref_counts, incoming: int = 0) -> list[int]:
    """Up to n_blocks_needed table indices (ascending), the oldest that may go (h2o's heavy
    hitters are chosen per token after their block leaves). Fewer when not enough may go."""
    if cfg.policy == "none" or n_blocks_needed <= 0:
        return []
    cand = candidates(state, cfg, ref_counts, incoming)
    return sorted(cand[np.argsort(state.start[cand], kind="stable")][:n_blocks_needed].tolist())


def apply_eviction(
    seq: Sequence,
    state: SeqKV,
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
            state.positions(i),
            float(scores[j]) if scores is not None else 0.0,
            reasons[j] if reasons is not None else reason,
        )
        for j, i in enumerate(victims)
    ]
    for i in sorted(victims, reverse=True):
        pool.release(seq.block_table.pop(i))
        state.remove(i)
    seq.num_stored -= len(victims) * state.block_size
    state.stored = seq.num_stored
    if victims:
        seq.hashable = False
    for bid, pos, score, why in events:
        stats.emit("evict", seq.id, bid, pos, score, why)


# ------------------------------------------------------------ offload tier


class OffloadTier:
    """Blocks moved out of the pool: K/V of all layers, bit-exact, stored per slot as
    [2, layers, kv_heads, block_size, hd] so one layer and head of a block is one contiguous
    run (what the retriever reads), plus per-layer per-kv-head min/max of the keys (Quest
    metadata, laid out [layers, kv_heads, head_dim, slot] so one layer's bounds are two
    matmuls). In RAM, or in an np.memmap file under `path` (a directory); the file is
    unlinked at once, so nothing is left behind."""

    def __init__(
        self,
        block_shape: tuple[int, int, int, int],
        dtype=np.float32,
        path: Path | str | None = None,
        capacity: int = 8,
    ):
        self.block_shape = tuple(block_shape)  # (layers, block_size, kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        self.file = None if path is None else _open_spill(Path(path))
        self.entries: dict[tuple[int, int], int] = {}  # (seq id, start) -> slot
        self.free_slots: list[int] = []
        self.version = 0  # bumped whenever entries change: retrievers rebuild their index
        layers, bs, kvh, hd = self.block_shape
        self.slot_shape = (2, layers, kvh, bs, hd)
        self.kv = np.empty((0, *self.slot_shape), self.dtype)
        self.kmin = np.empty((layers, kvh, hd, 0), np.float32)
        self.kmax = np.empty_like(self.kmin)
        self._grow(max(1, capacity))

    @classmethod
    def for_pool(cls, pool: BlockPool, path: Path | str | None = None) -> "OffloadTier":
        layers, _, bs, kvh, hd = pool.k.shape
        return cls((layers, bs, kvh, hd), pool.k.dtype, path)

    @property
    def capacity(self) -> int:
        return len(self.kv)

    @property
    def nbytes(self) -> int:
        return len(self.entries) * self.kv[0].nbytes

    def _grow(self, capacity: int):
        old, n = self.kv, len(self.kv)
        shape = (capacity, *self.slot_shape)
        if self.file is None:
            self.kv = np.empty(shape, self.dtype)
            self.kv[:n] = old
        else:
            _reserve(self.file, int(np.prod(shape)) * self.dtype.itemsize)
            self.kv = np.memmap(self.file, self.dtype, "r+", shape=shape)
        pad = ((0, 0),) * 3 + ((0, capacity - n),)
        self.kmin, self.kmax = np.pad(self.kmin, pad), np.pad(self.kmax, pad)
        self.free_slots.extend(range(capacity - 1, n - 1, -1))

    def blocks_of(self, seq_id: int) -> list[tuple[int, int]]:
        """(start position, slot) of a sequence's offloaded blocks, by position."""
        return sorted((start, slot) for (sid, start), slot in self.entries.items() if sid == seq_id)

    def offload(
        self, seq: Sequence, state: SeqKV, i: int, pool: BlockPool, stats: Stats, reason: str = "over budget"
    ) -> int:
        """Move table entry i out of the pool; returns its slot in the tier."""
        bid = seq.block_table[i]
        assert pool.blocks[bid].ref_count == 1, f"block {bid} is shared: it cannot be offloaded"
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.free_slots.pop()
        k = _host(pool.k[:, bid])  # [L, bs, kvh, hd]
        self.kv[slot, 0], self.kv[slot, 1] = k.transpose(0, 2, 1, 3), _host(pool.v[:, bid]).transpose(0, 2, 1, 3)
        self.kmin[..., slot], self.kmax[..., slot] = k.min(axis=1), k.max(axis=1)
        pos = state.positions(i)
        self.entries[(seq.id, pos[0])] = slot
        self.version += 1
        del seq.block_table[i]
        state.remove(i)
        pool.release(bid)
        seq.num_stored -= state.block_size
        state.stored, seq.hashable = seq.num_stored, False
        stats.emit("offload", seq.id, bid, pos, reason=reason)
        return slot

    def block_kv(self, slots: np.ndarray, which: int, layer: int, head: int) -> np.ndarray:
        """K (which=0) or V (1) of one layer and kv head for the given slots: [len(slots),
        block_size, hd], exact copies of what was offloaded."""
        return self.kv[slots, which, layer, head]

    def index(self, seq_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A sequence's offloaded blocks: starts [n], slots [n], key min and max [L, kvh, hd, n]."""
        mine = self.blocks_of(seq_id)
        starts = np.array([s for s, _ in mine], np.int64)
        slots = np.array([slot for _, slot in mine], np.int64)
        return starts, slots, np.ascontiguousarray(self.kmin[..., slots]), np.ascontiguousarray(self.kmax[..., slots])

    def drop(self, seq_id: int) -> None:
        for key in [k for k in self.entries if k[0] == seq_id]:
            self.free_slots.append(self.entries.pop(key))
            self.version += 1

    def close(self) -> None:
        if self.file is not None:
            self.kv = np.empty((0, *self.slot_shape), self.dtype)
            self.file.close()
            self.file = None


def _open_spill(directory: Path):
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="localkv-offload-", suffix=".kv", dir=directory)
        f = os.fdopen(fd, "w+b")
    except OSError as e:
        raise LocalkvError(f"cannot write the KV offload file under {directory}: {e.strerror or e}") from None
    try:
        os.unlink(name)  # lives while open (POSIX)
    except OSError:
        pass
    return f


def _reserve(f, nbytes: int):
    """Grow the spill file with real disk space: a sparse file would crash on write when full."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(f.fileno(), 0, nbytes)
        else:
            f.truncate(nbytes)
    except OSError as e:
        raise LocalkvError(f"cannot grow the KV offload file to {nbytes} bytes: {e.strerror or e}") from None


# ------------------------------------------------------------ per-layer recall (Quest)


def quest_scores(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray) -> np.ndarray:
    """Quest's upper bound of q·k over each block's keys: sum over dims of max(q*min, q*max),
    computed as relu(q)·max + min(q, 0)·min (two matmuls). q [kvh, R, hd] (R query rows per
    kv head), kmin/kmax [kvh, hd, n] -> [kvh, R, n]."""
    return np.matmul(np.maximum(q, 0), kmax) + np.matmul(np.minimum(q, 0), kmin)


class Retriever:
    """One sequence's offloaded blocks during one forward. Per layer and kv head, two stages
    pick the `r_blocks` blocks to read back: Quest's bound (key min/max per block, against
    this layer's queries; max over the queries and the group's heads) keeps the top
    `rerank * r_blocks` candidates, then the exact largest q·k over the candidates' keys picks
    the final r_blocks (coarse-to-fine: the bound alone is loose for 16-token blocks). Their
    K/V are read from the host tier and attended to alongside the resident blocks. Nothing
    is copied into the pool: a block comes back into one layer's attention for one step, so
    each layer attends to at most resident + r_blocks * block_size tokens, which the budget
    covers (InfiniGen's split of a small resident set and a per-layer fetched set, with the
    current query instead of a speculated one: on the CPU the host tier is right there, so
    nothing needs prefetching)."""

    def __init__(
        self,
        tier: "OffloadTier",
        starts: np.ndarray,
        slots: np.ndarray,
        kmin: np.ndarray,
        kmax: np.ndarray,
        r_blocks: int,
        rerank: int,
    ):
        self.tier, self.starts, self.slots = tier, starts, slots
        self.kmin, self.kmax = kmin, kmax  # [L, kvh, hd, n]
        self.r = min(r_blocks, len(slots))
        self.rerank = max(1, rerank)
        self._picks: list[tuple[np.ndarray, np.ndarray]] = []  # (starts, largest q·k) per layer and head
        self.most = 0  # most tokens one layer read back

    @property
    def picked(self) -> dict[int, float]:
        """start -> largest q·k this step, over the layers and heads that read the block back."""
        if not self._picks:
            return {}
        starts = np.concatenate([p[0] for p in self._picks])
        best = np.concatenate([p[1] for p in self._picks])
        order = np.lexsort((-best, starts))  # by start, highest score first within a start
        starts, best = starts[order], best[order]
        first = np.flatnonzero(np.r_[True, starts[1:] != starts[:-1]])
        return dict(zip(starts[first].tolist(), best[first].tolist()))

    def __call__(self, layer: int, q) -> tuple[np.ndarray, np.ndarray] | None:
        """K/V [kvh, r * block_size, hd] of this layer's chosen blocks for queries q [T, H, hd]."""
        r = self.r
        if not r:
            return None
        q = _host(q)
        T, H, hd = q.shape
        kvh, n = self.kmin.shape[1], len(self.slots)
        bs = self.tier.block_shape[1]
        qh = q.reshape(T, kvh, H // kvh, hd).transpose(1, 0, 2, 3).reshape(kvh, -1, hd)
        c = min(n, self.rerank * r)
        if c < n:
            bound = quest_scores(qh, self.kmin[layer], self.kmax[layer]).max(axis=1)  # [kvh, n]
            cand = np.argpartition(bound, n - c, axis=1)[:, n - c :]
        else:
            cand = np.broadcast_to(np.arange(n), (kvh, n))
        k = np.empty((kvh, r * bs, hd), self.tier.dtype)
        v = np.empty_like(k)
        for h in range(kvh):
            slots = self.slots[cand[h]]
            keys = self.tier.block_kv(slots, 0, layer, h)  # [c, bs, hd]
            best = (keys.reshape(c * bs, hd) @ qh[h].T).reshape(c, -1).max(axis=1)
            pick = np.argpartition(best, c - r)[c - r :] if r < c else np.arange(c)
            k[h] = keys[pick].reshape(r * bs, hd)
            v[h] = self.tier.block_kv(slots[pick], 1, layer, h).reshape(r * bs, hd)
            self._picks.append((self.starts[cand[h][pick]], best[pick]))
        self.most = max(self.most, r * bs)
        return k, v


# ------------------------------------------------------------ h2o heavy hitters


class HeavyHitters:
    """One sequence's h2o state past its block table. Per layer and kv head: up to `cap`
    heavy-hitter tokens (K/V rows, compacted, in the pool's array module and dtype), their
    accumulated attention mass and positions; and the running mass of every token the table
    holds ([layers, kv_heads, len(table) * block_size], aligned with the table). When blocks
    leave the table, absorb() merges their tokens with the heavy hitters and each layer-head
    keeps its `cap` highest scores."""

    def __init__(self, pool: BlockPool, cap: int):
        layers, _, bs, kvh, hd = pool.k.shape
        self.cap, self.block_size = cap, bs
        self.xp = pool.xp
        self.k = self.xp.empty((layers, kvh, cap, hd), pool.k.dtype)
        self.v = self.xp.empty_like(self.k)
        self.score = np.zeros((layers, kvh, cap))
        self.pos = np.zeros((layers, kvh, cap), np.int64)
        self.n = 0  # heavy hitters held by every layer-head
        self.live = np.zeros((layers, kvh, 0))  # mass of the table's tokens

    def sync(self, seq: Sequence) -> "HeavyHitters":
        """Room for blocks that append_slots added at the end of the table."""
        n = len(seq.block_table) * self.block_size
        if n > self.live.shape[2]:
            self.live = np.concatenate([self.live, np.zeros((*self.live.shape[:2], n - self.live.shape[2]))], axis=2)
        return self

    def extra(self, layer: int):
        """This layer's heavy hitters as extra keys for paged_attention: (K, V) [kvh, n, hd]."""
        return None if not self.n else (self.k[layer, :, : self.n], self.v[layer, :, : self.n])

    def observe(self, mass, fade: float = 1.0) -> None:
        """Fold one forward's mass [layers, kv_heads, n + n_ctx] (heavy hitters first), after
        scaling the scores held so far by `fade`."""
        mass = _host(mass)
        if fade != 1.0:
            self.score *= fade
            self.live *= fade
        self.score[:, :, : self.n] += mass[:, :, : self.n]
        ctx = mass.shape[2] - self.n
        self.live[:, :, :ctx] += mass[:, :, self.n :]

    def absorb(self, seq: Sequence, victims: list[int], pool: BlockPool, starts: np.ndarray):
        """Table entries `victims` (full blocks, about to leave the pool): each layer-head keeps
        the cap best of its heavy hitters and their tokens. Returns, per victim, its mean score
        over layer-heads and how many (token, layer-head) rows of it stay; and how many older
        heavy-hitter rows were pushed out."""
        xp, bs, n, cap = self.xp, self.block_size, self.n, self.cap
        layers, kvh, _, hd = self.k.shape
        cols = np.concatenate([np.arange(i * bs, (i + 1) * bs) for i in victims])
        bids = xp.asarray(np.asarray([seq.block_table[i] for i in victims]))
        # [layers, nv, bs, kvh, hd] -> [layers, kvh, nv * bs, hd]
        new_k = pool.k[:, bids].transpose(0, 3, 1, 2, 4).reshape(layers, kvh, -1, hd)
        new_v = pool.v[:, bids].transpose(0, 3, 1, 2, 4).reshape(new_k.shape)
        new_s = self.live[:, :, cols]
        new_p = np.broadcast_to(np.concatenate([starts[i] + np.arange(bs) for i in victims]), new_s.shape)
        block_scores = new_s.reshape(layers, kvh, len(victims), bs).sum(axis=3).mean(axis=(0, 1))
        self.live = np.delete(self.live, cols, axis=2)
        fill = min(cap - n, len(cols))  # free slots take the first tokens as they are
        end = n + fill
        self.k[:, :, n:end], self.v[:, :, n:end] = new_k[:, :, :fill], new_v[:, :, :fill]
        self.score[:, :, n:end], self.pos[:, :, n:end] = new_s[:, :, :fill], new_p[:, :, :fill]
        self.n = end
        rest = len(cols) - fill
        if rest:  # a full store: per layer-head, the `rest` lowest of cap + rest rows go
            score = np.concatenate([self.score, new_s[:, :, fill:]], axis=2)
            drop = np.zeros(score.shape, bool)
            np.put_along_axis(drop, np.argpartition(score, rest - 1, axis=2)[:, :, :rest], True, axis=2)
            # per layer-head, as many stored rows are freed as incoming rows stay: pair them in order
            freed = np.nonzero(drop[:, :, :cap])
            taken = np.nonzero(~drop[:, :, cap:])
            taken = (taken[0], taken[1], taken[2] + fill)
            self.score[freed], self.pos[freed] = new_s[taken], new_p[taken]
            fx, tx = tuple(xp.asarray(a) for a in freed), tuple(xp.asarray(a) for a in taken)
            self.k[fx], self.v[fx] = new_k[tx], new_v[tx]
        # what stayed, from the positions now stored (heavy hitters are older than any victim)
        first = np.array([starts[i] for i in victims])
        stored = self.pos[:, :, : self.n].ravel()
        mine = np.searchsorted(first, stored, side="right") - 1
        is_new = (mine >= 0) & (stored < first[np.maximum(mine, 0)] + bs)
        kept = np.bincount(mine[is_new], minlength=len(victims))
        pushed = layers * kvh * n - int((~is_new).sum())
        return block_scores, kept.tolist(), pushed

    def copy(self) -> "HeavyHitters":
        twin = copy.copy(self)
        twin.k, twin.v, twin.score, twin.pos, twin.live = (
            a.copy() for a in (self.k, self.v, self.score, self.pos, self.live)
        )
        return twin


# ------------------------------------------------------------ what the engine holds


class Evictor:
    """One per engine: the config, each sequence's SeqKV, h2o's heavy hitters, the offload
    tier (policy offload)."""

    def __init__(
        self, cfg: EvictConfig, pool: BlockPool, stats: Stats | None = None, offload_dir: Path | str | None = None
    ):
        self.cfg = cfg.validate(pool.block_size)
        self.pool, self.stats = pool, stats or pool.stats
        self.states: dict[int, SeqKV] = {}
        self.heavy: dict[int, HeavyHitters] = {}  # h2o: seq id -> its heavy hitters
        self.tier = OffloadTier.for_pool(pool, offload_dir) if cfg.policy == "offload" else None
        self._index: dict[int, tuple] = {}  # seq id -> (tier version, tier.index(seq id))
        self._recalled: dict[int, set[int]] = {}  # seq id -> starts read back in its last forward
        self._extra: dict[int, int] = {}  # seq id -> most tokens one layer read back in its last forward

    @property
    def active(self) -> bool:
        return self.cfg.policy != "none"

    @property
    def scores_needed(self) -> bool:
        return self.cfg.policy == "h2o"

    def state(self, seq: Sequence) -> SeqKV:
        st = self.states.get(seq.id)
        if st is None:
            st = self.states[seq.id] = SeqKV(self.pool.block_size)
        return st.sync(seq)

    def heavy_hitters(self, seq: Sequence) -> HeavyHitters:
        hh = self.heavy.get(seq.id)
        if hh is None:
            hh = self.heavy[seq.id] = HeavyHitters(self.pool, self.cfg.heavy_tokens(self.pool.block_size))
        return hh.sync(seq)

    def make_room(self, seq: Sequence, n_new: int) -> int:
        """Before append_slots: evict (or offload) so that seq fits its budget after n_new
        more tokens. Returns the blocks it could not free (0: fits)."""
        need = over_budget(seq, n_new, self.cfg, self.pool.block_size)
        if need <= 0:
            return 0
        st = self.state(seq)
        victims = choose_victims(st, need, self.cfg, ref_counts(seq, self.pool), incoming=n_new)
        reason = f"{self.cfg.policy}: budget {self.cfg.budget} tokens"
        if self.tier is not None:
            for i in reversed(victims):
                self.tier.offload(seq, st, i, self.pool, self.stats, reason)
        elif self.cfg.policy == "h2o" and victims:
            hh = self.heavy_hitters(seq)
            scores, kept, pushed = hh.absorb(seq, victims, self.pool, st.start)
            rows = self.pool.k.shape[0] * self.pool.k.shape[3] * self.pool.block_size
            reasons = [f"{reason}; {k} of its {rows} (token, layer, kv head) rows stay as heavy hitters" for k in kept]
            if pushed:
                reasons[-1] += f"; {pushed} older heavy-hitter rows dropped"
            apply_eviction(seq, st, victims, self.pool, self.stats, reason, scores, reasons)
        else:
            apply_eviction(seq, st, victims, self.pool, self.stats, reason)
        return need - len(victims)

    def mass_for(self, seq: Sequence, xp=np):
        """After append_slots: the array to pass as Span.mass (None when no policy reads it):
        [layers, kv_heads, heavy hitters + stored tokens]."""
        if not self.scores_needed:
            return None
        layers, _, _, kvh, _ = self.pool.k.shape
        return xp.zeros((layers, kvh, self.heavy_hitters(seq).n + seq.num_stored), np.float32)

    def observe(self, seq: Sequence, mass, n_queries: int = 1) -> None:
        """After the forward: fold the span's mass (from n_queries queries) into the scores."""
        if mass is not None:
            self.heavy_hitters(seq).observe(mass, self.cfg.decay**n_queries)

    def retriever(self, seq: Sequence):
        """Before the forward: what each layer attends to besides the table (Span.retrieve):
        h2o's heavy hitters, or the blocks offload reads back from its tier; None if nothing."""
        if self.cfg.policy == "h2o":
            hh = self.heavy.get(seq.id)
            return None if hh is None or not hh.n else (lambda layer, q: hh.extra(layer))
        if self.tier is None:
            return None
        cached = self._index.get(seq.id)
        if cached is None or cached[0] != self.tier.version:
            cached = self._index[seq.id] = (self.tier.version, self.tier.index(seq.id))
        starts, slots, kmin, kmax = cached[1]
        if not len(slots):
            return None
        return Retriever(
            self.tier, starts, slots, kmin, kmax, self.cfg.recall_blocks(self.pool.block_size), self.cfg.rerank
        )

    def recalled(self, seq: Sequence, ret: Retriever | None) -> None:
        """After the forward: one `recall` event per block some layer read back this step but
        not in the step before (a block recalled every step is one recall, not one per step)."""
        picked = ret.picked if ret is not None else {}
        before = self._recalled.get(seq.id, set())
        bs = self.pool.block_size
        for start in sorted(set(picked) - before):
            slot = self.tier.entries[(seq.id, start)]
            self.stats.emit(
                "recall",
                seq.id,
                slot,
                (start, start + bs),
                picked[start],
                "among a layer's top offloaded blocks for the current query",
            )
        self._recalled[seq.id] = set(picked)
        self._extra[seq.id] = ret.most if ret is not None else 0

    def active_tokens(self, seq: Sequence) -> int:
        """Tokens of K/V seq's last forward attended to in one layer (and kv head): resident,
        plus h2o's heavy hitters or what offload read back."""
        hh = self.heavy.get(seq.id)
        return seq.num_stored + self._extra.get(seq.id, 0) + (hh.n if hh is not None else 0)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """After KVManager.fork: the child starts with the parent's table positions and its own
        copy of the heavy hitters (offloaded blocks stay the parent's)."""
        self.states[child.id] = self.state(parent).copy()
        if parent.id in self.heavy:
            self.heavy[child.id] = self.heavy[parent.id].copy()

    def free(self, seq: Sequence) -> None:
        """With KVManager.free: forget the sequence, its heavy hitters and offloaded blocks."""
        self.states.pop(seq.id, None)
        for d in (self.heavy, self._index, self._recalled, self._extra):
            d.pop(seq.id, None)
        if self.tier is not None:
            self.tier.drop(seq.id)
