"""Bounded KV memory: which whole blocks leave a sequence's block table, and where they go.

Policies (EvictConfig.policy):
- none: the table only grows (the default).
- sliding: StreamingLLM. Keep the sink blocks (the first `sinks` tokens, rounded up to
  whole blocks) and the recent window; drop the oldest other blocks first.
- h2o: Heavy-Hitter Oracle. Keep sinks and the recent window; drop the blocks with the
  lowest accumulated attention score.
- offload: h2o's choice of block, but the block moves to a host tier (RAM, or a memmap
  file) instead of being dropped, and comes back when a Quest-style bound says a query
  would attend to it more than to an active block (a swap: the budget still holds).

Granularity is the block. Keys already carry RoPE, so attention reads whichever blocks the
table holds and new tokens keep their positions (from num_computed); the table stays
ordered by position. The partially filled last block and the sink blocks are never taken,
nor a block whose ref_count is above 1 (shared with a fork, or another sequence's prefix).

Scores. The model fills one `mass` array per span, [n_ctx]: the attention weight each
stored key received, summed over the span's queries, all heads and all layers (Span.mass
is shared by the layers). A block leaves every layer at once, so one number per block is
what a decision needs; keeping the layer sum costs no model change. The sum is divided by
n_layers * n_heads, so each query hands out exactly one unit: a prefill query and a decode
query weigh alike, and a score reads as "queries' worth of attention". Scores accumulate
over steps (as in H2O); a block's score is the sum over its tokens.

Budget arithmetic (block_size B, all in tokens): after a step a sequence holds the sink
blocks plus the blocks that meet the last `recent` positions (at most ceil(recent/B) + 1
blocks), so validate() asks budget >= sinks + ceil(recent/B)*B + B. What is left is room for
h2o's heavy hitters. A prefill chunk under a budget must be at most chunk_limit() tokens.
"""

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .block_pool import BlockPool
from .errors import LocalkvError
from .sequence import Sequence
from .stats import Stats

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
    decay: float = 0.99  # h2o/offload: scores fade by this factor per query (1.0: plain H2O sums)
    recall_k: int = 8  # offload: most blocks swapped back in per step

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
        bs, sinks, recent = block_size, self.sink_tokens(block_size), self.recent_tokens(block_size)
        need = sinks + _ceil(recent, bs) * bs + bs
        if self.budget_blocks(bs) * bs < need:
            raise LocalkvError(f"KV budget {self.budget} tokens is too small: sinks ({sinks}, whole blocks of {bs}) "
                               f"+ recent window ({recent}, whole blocks) + one block ({bs}) need {need}")
        return self

    def sink_tokens(self, block_size: int) -> int:
        return _ceil(self.sinks, block_size) * block_size

    def budget_blocks(self, block_size: int) -> int:
        return (self.budget or 0) // block_size

    def recent_tokens(self, block_size: int) -> int:
        """Explicit, or: sliding keeps all the budget past sinks and one spare block; h2o and
        offload keep 90% of that room as a recent window (whole blocks) and spend the rest on
        heavy hitters. Measured on GPL-3.0 with SmolLM2 (4096 tokens, blocks of 16): an H2O-style
        half/half split loses to sliding at every budget, because language modelling leans on
        contiguous recent text and a block spends 16 slots on each heavy token it keeps."""
        if self.recent is not None:
            return self.recent
        room = max(0, (self.budget_blocks(block_size) - 1) * block_size - self.sink_tokens(block_size))
        if self.policy == "sliding":
            return room
        return min(room, max(block_size, int(room * 0.9) // block_size * block_size))

    def chunk_limit(self, block_size: int) -> int | None:
        """The most tokens one step may append to a sequence and still end within budget."""
        return None if self.policy == "none" else max(1, self.recent_tokens(block_size))


# ------------------------------------------------------------ per-sequence state

@dataclass(slots=True)
class SeqKV:
    """Per table entry: the first logical position it holds and its accumulated score."""
    block_size: int
    unit: float = 1.0  # n_layers * n_heads: the mass one query hands out
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    score: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    next_pos: int = 0  # seq.num_computed at the last sync
    stored: int = 0  # seq.num_stored at the last sync
    decay: float = 1.0  # per query

    def sync(self, seq: Sequence) -> "SeqKV":
        """Take in blocks that append_slots added at the end of the table."""
        n_new = len(seq.block_table) - len(self.start)
        assert n_new >= 0, "block table shrank outside the eviction layer"
        if n_new:
            # the old entries are all full; the new ones hold the newest tokens (even if a full
            # last block was evicted, so start[-1] + block_size would be wrong)
            first = seq.num_computed - (seq.num_stored - len(self.start) * self.block_size)
            self.start = np.concatenate([self.start, first + self.block_size * np.arange(n_new, dtype=np.int64)])
            self.score = np.concatenate([self.score, np.zeros(n_new)])
        self.next_pos, self.stored = seq.num_computed, seq.num_stored
        return self

    def accumulate(self, mass) -> None:
        """Add one forward's mass [n_ctx] (context index i lives in table entry i // block_size)."""
        mass = _host(mass)
        n = len(self.start) * self.block_size
        if len(mass) > n:
            raise ValueError(f"mass covers {len(mass)} tokens, the table holds {n}")
        padded = np.zeros(n)
        padded[:len(mass)] = mass
        new = padded.reshape(-1, self.block_size).sum(axis=1) / self.unit
        if self.decay != 1.0:
            self.score *= self.decay ** new.sum()  # each query hands out one unit: the sum counts queries
        self.score += new

    def positions(self, i: int) -> tuple[int, int]:
        s = int(self.start[i])
        return s, min(s + self.block_size, self.next_pos)

    def remove(self, i: int) -> None:
        self.start, self.score = np.delete(self.start, i), np.delete(self.score, i)

    def insert(self, start: int, score: float) -> int:
        i = int(np.searchsorted(self.start, start))
        self.start, self.score = np.insert(self.start, i, start), np.insert(self.score, i, score)
        return i

    def copy(self) -> "SeqKV":
        return SeqKV(self.block_size, self.unit, self.start.copy(), self.score.copy(), self.next_pos, self.stored,
                     self.decay)


def ref_counts(seq: Sequence, pool: BlockPool) -> list[int]:
    return [pool.blocks[b].ref_count for b in seq.block_table]


def over_budget(seq: Sequence, n_new: int, cfg: EvictConfig, block_size: int) -> int:
    """Blocks the table would exceed the budget by after n_new more tokens (<= 0: fits)."""
    if cfg.policy == "none":
        return 0
    have = len(seq.block_table)
    need = max(0, _ceil(seq.num_stored + n_new - have * block_size, block_size))
    return have + need - cfg.budget_blocks(block_size)


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


def choose_victims(state: SeqKV, n_blocks_needed: int, cfg: EvictConfig, ref_counts,
                   incoming: int = 0) -> list[int]:
    """Up to n_blocks_needed table indices (ascending): sliding takes the oldest, h2o and
    offload the lowest scores (ties: oldest). Fewer when not enough blocks may go."""
    if cfg.policy == "none" or n_blocks_needed <= 0:
        return []
    cand = candidates(state, cfg, ref_counts, incoming)
    key = state.start[cand] if cfg.policy == "sliding" else state.score[cand]
    return sorted(cand[np.argsort(key, kind="stable")][:n_blocks_needed].tolist())


def apply_eviction(seq: Sequence, state: SeqKV, victims: list[int], pool: BlockPool, stats: Stats,
                   reason: str = "over budget") -> None:
    """Drop table entries `victims`: release their blocks, one `evict` event each."""
    events = [(seq.block_table[i], state.positions(i), float(state.score[i])) for i in sorted(victims)]
    for i in sorted(victims, reverse=True):
        pool.release(seq.block_table.pop(i))
        state.remove(i)
    seq.num_stored -= len(victims) * state.block_size
    state.stored = seq.num_stored
    if victims:
        seq.hashable = False
    for bid, pos, score in events:
        stats.emit("evict", seq.id, bid, pos, score, reason)


# ------------------------------------------------------------ offload tier

class OffloadTier:
    """Blocks moved out of the pool: K/V of all layers, bit-exact, plus per-layer per-kv-head
    min/max of the keys (Quest metadata). In RAM, or in an np.memmap file under `path`
    (a directory); the file is unlinked at once, so nothing is left behind."""

    def __init__(self, block_shape: tuple[int, int, int, int], dtype=np.float32, path: Path | str | None = None,
                 capacity: int = 8):
        self.block_shape = tuple(block_shape)  # (layers, block_size, kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        self.file = None if path is None else _open_spill(Path(path))
        self.entries: dict[tuple[int, int], tuple[int, float]] = {}  # (seq id, start) -> (slot, score)
        self.free_slots: list[int] = []
        layers, _, kvh, hd = self.block_shape
        self.kv = np.empty((0, 2, *self.block_shape), self.dtype)
        self.kmin = np.empty((0, layers, kvh, hd), self.dtype)
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
        shape = (capacity, 2, *self.block_shape)
        if self.file is None:
            self.kv = np.empty(shape, self.dtype)
            self.kv[:n] = old
        else:
            _reserve(self.file, int(np.prod(shape)) * self.dtype.itemsize)
            self.kv = np.memmap(self.file, self.dtype, "r+", shape=shape)
        pad = ((0, capacity - n),) + ((0, 0),) * 3
        self.kmin, self.kmax = np.pad(self.kmin, pad), np.pad(self.kmax, pad)
        self.free_slots.extend(range(capacity - 1, n - 1, -1))

    def blocks_of(self, seq_id: int) -> list[tuple[int, int]]:
        """(start position, slot) of a sequence's offloaded blocks, by position."""
        return sorted((start, slot) for (sid, start), (slot, _) in self.entries.items() if sid == seq_id)

    def offload(self, seq: Sequence, state: SeqKV, i: int, pool: BlockPool, stats: Stats,
                reason: str = "over budget") -> int:
        """Move table entry i out of the pool; returns its slot in the tier."""
        bid = seq.block_table[i]
        assert pool.blocks[bid].ref_count == 1, f"block {bid} is shared: it cannot be offloaded"
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.free_slots.pop()
        k = _host(pool.k[:, bid])
        self.kv[slot, 0], self.kv[slot, 1] = k, _host(pool.v[:, bid])
        self.kmin[slot], self.kmax[slot] = k.min(axis=1), k.max(axis=1)
        pos, score = state.positions(i), float(state.score[i])
        self.entries[(seq.id, pos[0])] = (slot, score)
        del seq.block_table[i]
        state.remove(i)
        pool.release(bid)
        seq.num_stored -= state.block_size
        state.stored, seq.hashable = seq.num_stored, False
        stats.emit("offload", seq.id, bid, pos, score, reason)
        return slot

    def recall(self, seq: Sequence, state: SeqKV, start: int, pool: BlockPool, stats: Stats,
               reason: str = "recall") -> int:
        """Copy an offloaded block back into a fresh pool block at its place by position;
        returns its table index."""
        slot, score = self.entries.pop((seq.id, start))
        bid = pool.allocate()
        pool.k[:, bid], pool.v[:, bid] = self.kv[slot, 0], self.kv[slot, 1]
        self.free_slots.append(slot)
        i = state.insert(start, score)
        seq.block_table.insert(i, bid)
        seq.num_stored += state.block_size
        state.stored = seq.num_stored
        stats.emit("recall", seq.id, bid, (start, start + state.block_size), score, reason)
        return i

    def drop(self, seq_id: int) -> None:
        for key in [k for k in self.entries if k[0] == seq_id]:
            self.free_slots.append(self.entries.pop(key)[0])

    def close(self) -> None:
        if self.file is not None:
            self.kv = np.empty((0, 2, *self.block_shape), self.dtype)
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


# ------------------------------------------------------------ Quest recall

def quest_bound(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray, per_head: bool = False) -> np.ndarray:
    """Upper bound of q·k over a block's keys: sum over dims of max(q*min, q*max).
    q [L, H, hd] (L layers of one query), kmin/kmax [n, L, kvh, hd] -> [n] summed over
    layers and heads, or [n, L, H] with per_head."""
    n, layers, kvh, hd = kmin.shape
    qg = np.asarray(q, np.float32).reshape(layers, kvh, -1, hd)
    b = np.maximum(qg * kmin[:, :, :, None], qg * kmax[:, :, :, None]).sum(axis=-1)  # [n, L, kvh, g]
    return b.reshape(n, layers, -1) if per_head else b.sum(axis=(1, 2, 3))


def select_recalls(q, tier: OffloadTier, seq: Sequence, state: SeqKV, pool: BlockPool, cfg: EvictConfig,
                   k: int = 1, layers=None) -> list[tuple[int, int]]:
    """Swaps worth making: (start of an offloaded block, table index of an active block to
    offload), at most k. q is one query per layer in `layers` ([len(layers), H, hd]; default
    all layers). Offloaded blocks are ranked by their Quest bound, highest first, against the
    evictable active blocks by the same bound (from their keys in the pool), lowest first;
    a pair is kept while the offloaded bound is strictly higher."""
    mine = tier.blocks_of(seq.id)
    cand = candidates(state, cfg, ref_counts(seq, pool))
    if not mine or not len(cand) or k <= 0:
        return []
    layers = np.arange(pool.k.shape[0]) if layers is None else np.atleast_1d(layers)
    q = np.asarray(q, np.float32).reshape(len(layers), -1, pool.k.shape[-1])
    slots = [slot for _, slot in mine]
    off = quest_bound(q, tier.kmin[slots][:, layers], tier.kmax[slots][:, layers])
    keys = _host(pool.k[np.ix_(layers, np.asarray(seq.block_table)[cand])])  # [L, n, bs, kvh, hd]
    act = quest_bound(q, keys.min(axis=2).swapaxes(0, 1), keys.max(axis=2).swapaxes(0, 1))
    pairs = []
    for o, a in zip(np.argsort(-off, kind="stable")[:k], np.argsort(act, kind="stable")[:k]):
        if off[o] <= act[a]:
            break
        pairs.append((mine[o][0], int(cand[a])))
    return pairs


def speculate(q, tier: OffloadTier, seq: Sequence, state: SeqKV, pool: BlockPool, cfg: EvictConfig, k: int = 1,
              layers=None) -> list[tuple[int, int]]:
    """Swaps worth making, as select_recalls returns them, from the attention the last query
    q [L, H, hd] would pay every block (active and offloaded) if all were present: the
    softmax over all their keys, per layer and head, summed to one number per block. The
    next query is taken to look like the last one (InfiniGen-style speculation; exact keys
    from the host tier instead of partial channels, which costs L*H*hd per stored token).
    Among the evictable active blocks and the offloaded ones, the top len(evictable) by that
    mass should be active; up to k offloaded blocks of that top set swap with the active
    blocks outside it, weakest first."""
    mine = tier.blocks_of(seq.id)
    cand = candidates(state, cfg, ref_counts(seq, pool))
    if not mine or not len(cand) or k <= 0:
        return []
    L, bs, kvh, hd = tier.block_shape
    layers = np.arange(L) if layers is None else np.atleast_1d(layers)
    q = np.asarray(q, np.float32).reshape(len(layers), kvh, -1, hd)
    act = _host(pool.k[np.ix_(layers, np.asarray(seq.block_table))])  # [l, n_act, bs, kvh, hd]
    off = tier.kv[[slot for _, slot in mine], 0][:, layers].swapaxes(0, 1)  # [l, n_off, bs, kvh, hd]
    keys = np.concatenate([act, off], axis=1)
    logits = np.einsum("lkgd,lnbkd->lkgnb", q, keys) / np.sqrt(hd)
    valid = np.ones(keys.shape[1:3], bool)
    filled = seq.num_stored - (len(seq.block_table) - 1) * bs  # the last active block may be partial
    valid[len(seq.block_table) - 1, filled:] = False
    logits = np.where(valid, logits, -np.inf)
    logits -= logits.max(axis=(-2, -1), keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=(-2, -1), keepdims=True)
    mass = p.sum(axis=(0, 1, 2, 4))  # [n_act + n_off]
    n_act = len(seq.block_table)
    pool_idx = np.concatenate([cand, n_act + np.arange(len(mine))])
    top = set(pool_idx[np.argsort(-mass[pool_idx], kind="stable")[:len(cand)]].tolist())
    ins = [j - n_act for j in sorted(top, key=lambda j: -mass[j]) if j >= n_act]
    outs = [int(i) for i in sorted(cand, key=lambda i: mass[i]) if int(i) not in top]
    return [(mine[j][0], i) for j, i in zip(ins[:k], outs[:k])]


# ------------------------------------------------------------ what the engine holds

class Evictor:
    """One per engine: the config, each sequence's SeqKV, the offload tier (policy offload)."""

    def __init__(self, cfg: EvictConfig, pool: BlockPool, stats: Stats | None = None, n_heads: int = 1,
                 offload_dir: Path | str | None = None):
        self.cfg = cfg.validate(pool.block_size)
        self.pool, self.stats = pool, stats or pool.stats
        self.unit = float(pool.k.shape[0] * n_heads)
        self.states: dict[int, SeqKV] = {}
        self.tier = OffloadTier.for_pool(pool, offload_dir) if cfg.policy == "offload" else None

    @property
    def active(self) -> bool:
        return self.cfg.policy != "none"

    @property
    def scores_needed(self) -> bool:
        return self.cfg.policy in ("h2o", "offload")

    def state(self, seq: Sequence) -> SeqKV:
        st = self.states.get(seq.id)
        if st is None:
            st = self.states[seq.id] = SeqKV(self.pool.block_size, self.unit, decay=self.cfg.decay)
        return st.sync(seq)

    def make_room(self, seq: Sequence, n_new: int) -> int:
        """Before append_slots: evict (or offload) so that seq fits its budget after n_new
        more tokens. Returns the blocks it could not free (0: fits)."""
        need = over_budget(seq, n_new, self.cfg, self.pool.block_size)
        if need <= 0:
            return 0
        st = self.state(seq)
        victims = choose_victims(st, need, self.cfg, ref_counts(seq, self.pool), incoming=n_new)
        reason = f"{self.cfg.policy}: budget {self.cfg.budget} tokens"
        if self.tier is None:
            apply_eviction(seq, st, victims, self.pool, self.stats, reason)
        else:
            for i in reversed(victims):
                self.tier.offload(seq, st, i, self.pool, self.stats, reason)
        return need - len(victims)

    def mass_for(self, seq: Sequence, xp=np):
        """After append_slots: the array to pass as Span.mass (None when no policy reads it)."""
        return xp.zeros(seq.num_stored, np.float32) if self.scores_needed else None

    def observe(self, seq: Sequence, mass) -> None:
        """After the forward: fold the span's mass into the block scores."""
        if mass is not None:
            self.state(seq).accumulate(mass)

    def maybe_recall(self, seq: Sequence, q, layers=None, k: int = 1) -> int:
        """Between steps (policy offload): swap in up to k offloaded blocks that the query q
        bounds above the weakest active ones. Returns the swaps made."""
        if self.tier is None:
            return 0
        st = self.state(seq)
        pairs = speculate(q, self.tier, seq, st, self.pool, self.cfg, k, layers)
        for _, i in sorted(pairs, key=lambda p: -p[1]):
            self.tier.offload(seq, st, i, self.pool, self.stats, "swapped out for a recall")
        hot = float(st.score.max()) if len(st.score) else 0.0
        for start, _ in pairs:
            i = self.tier.recall(seq, st, start, self.pool, self.stats, "speculated attention above an active block")
            st.score[i] = hot  # wanted now: without this the next make_room would send it straight back
        return len(pairs)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """After KVManager.fork: the child starts with the parent's scores (offloaded blocks stay the parent's)."""
        self.states[child.id] = self.state(parent).copy()

    def free(self, seq: Sequence) -> None:
        """With KVManager.free: forget the sequence and its offloaded blocks."""
        self.states.pop(seq.id, None)
        if self.tier is not None:
            self.tier.drop(seq.id)
