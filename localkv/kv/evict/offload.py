"""Offload and recall: blocks that leave the window move to a host tier (RAM, or a spill
file), and in every forward each layer and kv head reads back its best offloaded blocks
for its current queries (Quest's bound, then an exact rerank). See docs/EVICTION.md."""

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv import kv_format
from localkv.errors import LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.kv.evict.budget import EvictConfig
from localkv.kv.evict.protocol import AttendExtras, PositionedKV, RoomPlan, to_host
from localkv.kv.evict.window import SeqState, TablePositions, WindowPolicy
from localkv.sequence import Sequence, extra_entry
from localkv.stats import Stats


class OffloadTier:
    """Blocks moved out of the pool: K/V of all layers, bit-exact, each in the pool's format for
    it (K and V may differ, as in a q8_0:q4_0 pool), one slot each laid out [layers, kv_heads,
    block_size, row] (one layer and head of a block is one contiguous run), plus the keys'
    min/max per layer and kv head (Quest's metadata, [layers, kv_heads, head_dim, slot], so one
    layer's bounds are two matmuls). In RAM, or in np.memmap files (one for K, one for V) under
    `path` (a directory), unlinked at once so nothing is left behind."""

    def __init__(
        self,
        block_shape: tuple[int, int, int, int],
        dtype=np.float32,
        path: Path | str | None = None,
        capacity: int = 8,
        v_dtype=None,
    ):
        self.block_shape = tuple(block_shape)  # (layers, block_size, kv_heads, K's row)
        self.dtypes = (np.dtype(dtype), np.dtype(dtype if v_dtype is None else v_dtype))
        self.files = [None, None] if path is None else [_open_spill(Path(path)) for _ in range(2)]
        self.entries: dict[tuple[int, int], int] = {}  # (seq id, start) -> slot
        self.free_slots: list[int] = []
        self.version = 0  # bumped whenever entries change: cached indexes are rebuilt
        layers, bs, kvh, row = self.block_shape
        hd = kv_format.of(self.dtypes[0]).head_dim(row)
        rows = (row, kv_format.of(self.dtypes[1]).row_len(hd))
        self.slot_shapes = tuple((layers, kvh, bs, r) for r in rows)
        self.kv = [np.empty((0, *shape), dt) for shape, dt in zip(self.slot_shapes, self.dtypes)]  # [K, V]
        self.kmin = np.empty((layers, kvh, hd, 0), np.float32)
        self.kmax = np.empty_like(self.kmin)
        self._grow(max(1, capacity))

    @classmethod
    def for_pool(cls, pool: BlockPool, path: Path | str | None = None) -> "OffloadTier":
        """A tier of the pool's own rows (block_shape's last axis: a K row in its kv_format)."""
        layers, _, bs, kvh, row = pool.k.shape
        return cls((layers, bs, kvh, row), pool.k.dtype, path, v_dtype=pool.v.dtype)

    @property
    def capacity(self) -> int:
        return len(self.kv[0])

    @property
    def nbytes(self) -> int:
        return len(self.entries) * sum(a[0].nbytes for a in self.kv)

    def _grow(self, capacity: int):
        n = self.capacity
        shapes = [(capacity, *slot) for slot in self.slot_shapes]
        for f, shape, dtype in zip(self.files, shapes, self.dtypes):  # both files first: a full disk changes nothing
            if f is not None:
                _reserve(f, int(np.prod(shape)) * dtype.itemsize)
        for i, (f, shape, dtype) in enumerate(zip(self.files, shapes, self.dtypes)):
            if f is None:
                old, self.kv[i] = self.kv[i], np.empty(shape, dtype)
                self.kv[i][:n] = old
            else:
                self.kv[i] = np.memmap(f, dtype, "r+", shape=shape)
        pad = ((0, 0),) * 3 + ((0, capacity - n),)
        self.kmin, self.kmax = np.pad(self.kmin, pad), np.pad(self.kmax, pad)
        self.free_slots.extend(range(capacity - 1, n - 1, -1))

    def reserve(self, n: int):
        """Free slots for n more blocks, the spill file grown now: raises LocalkvError, changing
        nothing, when the disk is full (an offload itself then cannot fail)."""
        if len(self.free_slots) >= n:
            return
        capacity = 2 * self.capacity
        while capacity - len(self.entries) < n:
            capacity *= 2
        self._grow(capacity)

    def blocks_of(self, seq_id: int) -> list[tuple[int, int]]:
        """(start position, slot) of a sequence's offloaded blocks, by position."""
        return sorted((start, slot) for (sid, start), slot in self.entries.items() if sid == seq_id)

    def offload(
        self, seq: Sequence, table: TablePositions, i: int, pool: BlockPool, stats: Stats, reason: str = "over budget"
    ) -> int:
        """Move table entry i out of the pool; returns its slot in the tier."""
        bid = seq.block_table[i]
        if pool.blocks[bid].ref_count != 1:
            raise RuntimeError(f"block {bid} is shared and cannot be offloaded: a bug in the caller's logic")
        self.reserve(1)
        slot = self.free_slots.pop()
        k = to_host(pool.k[:, bid])  # [L, bs, kvh, row]: the pool's bytes, moved as they are
        self.kv[0][slot], self.kv[1][slot] = k.transpose(0, 2, 1, 3), to_host(pool.v[:, bid]).transpose(0, 2, 1, 3)
        keys = kv_format.decode(k)  # the bounds of the keys attention reads
        self.kmin[..., slot], self.kmax[..., slot] = keys.min(axis=1), keys.max(axis=1)
        pos = table.positions(i)
        self.entries[(seq.id, pos[0])] = slot
        self.version += 1
        del seq.block_table[i]
        table.remove(i)
        pool.release(bid)
        seq.num_stored -= table.block_size
        table.stored, seq.hashable = seq.num_stored, False
        stats.emit("offload", seq.id, bid, pos, reason=reason)
        return slot

    def block_kv(self, slots: np.ndarray, which: int, layer: int, head) -> np.ndarray:
        """K (which=0) or V (1) of one layer for the given slots and kv head (or heads, an array
        that broadcasts with slots): [*shape, block_size, hd], exact copies of what was offloaded."""
        return self.kv[which][slots, layer, head]

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
        for i, f in enumerate(self.files):
            if f is not None:
                self.kv[i] = np.empty((0, *self.slot_shapes[i]), self.dtypes[i])
                f.close()
                self.files[i] = None


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
    """Grow the spill file with real disk space: a sparse file would crash on write when full.
    A failure leaves the file at its old size (fallocate may have taken part of the space)."""
    old = os.fstat(f.fileno()).st_size
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(f.fileno(), 0, nbytes)
        else:
            f.truncate(nbytes)
    except OSError as e:
        try:
            f.truncate(old)
        except OSError:
            pass  # a longer file is harmless: the tier maps only its own capacity
        raise LocalkvError(f"cannot grow the KV offload file to {nbytes} bytes: {e.strerror or e}") from None


def quest_scores(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray) -> np.ndarray:
    """Quest's upper bound of q·k over each block's keys: sum over dims of max(q*min, q*max),
    computed as relu(q)·max + min(q, 0)·min (two matmuls). q [kvh, R, hd] (R query rows per
    kv head), kmin/kmax [kvh, hd, n] -> [kvh, R, n]."""
    return np.matmul(np.maximum(q, 0), kmax) + np.matmul(np.minimum(q, 0), kmin)


class Retriever:
    """One sequence's offloaded blocks during one forward. Per layer and kv head, Quest's
    bound keeps the top `rerank * r_blocks` blocks as candidates, then the exact largest q·k
    over their keys picks `r_blocks`, whose K/V are read from the tier: as extra keys
    (__call__), or at their positions beside the pool's blocks (positioned). Nothing goes back
    into the pool, so each layer attends to at most resident + r_blocks blocks."""

    def __init__(
        self,
        tier: OffloadTier,
        starts: np.ndarray,
        slots: np.ndarray,
        kmin: np.ndarray,
        kmax: np.ndarray,
        r_blocks: int,
        rerank: int,
        resident: np.ndarray,
        n_ctx: int,
    ):
        self.tier, self.starts, self.slots = tier, starts, slots
        self.kmin, self.kmax = kmin, kmax  # [L, kvh, hd, n]
        self.r = min(r_blocks, len(slots))
        self.rerank = max(1, rerank)
        # for positioned(): the pool's blocks by position (TablePositions.by_position) and the
        # positions the forward's queries end at
        self.resident, self.n_ctx = resident, n_ctx
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

    def _pick(self, layer: int, q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This layer's chosen blocks for queries q [T, H, hd], per kv head: their tier slots
        and starts [kvh, r] and their keys [kvh, r, block_size, hd]. Call only when r > 0."""
        r = self.r
        q = to_host(q)
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
        chosen = np.empty((kvh, r), np.int64)
        k = np.empty((kvh, r, bs, self.tier.block_shape[3]), self.tier.dtypes[0])  # rows as stored
        for h in range(kvh):
            keys = self.tier.block_kv(self.slots[cand[h]], 0, layer, h)  # [c, bs, row]
            best = (kv_format.decode(keys).reshape(c * bs, hd) @ qh[h].T).reshape(c, -1).max(axis=1)
            pick = np.argpartition(best, c - r)[c - r :] if r < c else np.arange(c)
            chosen[h], k[h] = cand[h][pick], keys[pick]
            self._picks.append((self.starts[chosen[h]], best[pick]))
        self.most = max(self.most, r * bs)
        return self.slots[chosen], self.starts[chosen], k

    def __call__(self, layer: int, q) -> tuple[np.ndarray, np.ndarray] | None:
        """K/V [kvh, r * block_size, hd] of this layer's chosen blocks for queries q [T, H, hd]."""
        if not self.r:
            return None
        slots, _, k = self._pick(layer, q)
        kvh, r, bs, hd = k.shape
        v = self.tier.block_kv(slots, 1, layer, np.arange(kvh)[:, None])
        return k.reshape(kvh, r * bs, hd), v.reshape(kvh, r * bs, hd)

    def positioned(self, layer: int, q) -> PositionedKV:
        """This layer's keys for queries q [T, H, hd] by position, per kv head: the pool's
        blocks, the chosen blocks (read from the tier) where they were computed, holes for the
        rest."""
        kvh = self.kmin.shape[1]
        tables = np.repeat(self.resident[None], kvh, axis=0)
        if not self.r:
            return PositionedKV(tables, self.n_ctx)
        slots, starts, k = self._pick(layer, q)
        heads = np.arange(kvh)[:, None]
        tables[heads, starts // self.tier.block_shape[1]] = extra_entry(np.arange(self.r))
        return PositionedKV(tables, self.n_ctx, (k, self.tier.block_kv(slots, 1, layer, heads)))


@dataclass(slots=True)
class OffloadSeqState(SeqState):
    index: tuple | None = None  # (tier version, tier.index(seq id)), rebuilt when the tier changes
    retriever: Retriever | None = None  # the one extras() handed out for the current forward
    recalled: set[int] = field(default_factory=set)  # starts read back in the last forward
    read_back: int = 0  # most tokens one layer read back in the last forward

    def sync(self, seq: Sequence) -> "OffloadSeqState":
        self.table.sync(seq)
        return self

    def fork(self) -> "OffloadSeqState":
        return OffloadSeqState(self.table.copy())  # offloaded blocks stay the parent's


class OffloadPolicy(WindowPolicy):
    """Blocks leaving the window move to an OffloadTier; each forward reads back, per layer,
    up to the budget's recall slots of them (Retriever), one `recall` event per block that
    comes back after a step without it."""

    def __init__(self, config: EvictConfig, pool: BlockPool, stats: Stats, offload_dir: Path | str | None = None):
        super().__init__(config, pool, stats)
        self.tier = OffloadTier.for_pool(pool, offload_dir)

    def new_state(self) -> OffloadSeqState:
        return OffloadSeqState(TablePositions(self.block_size))

    def reserve(self, plans: list[RoomPlan]) -> None:
        self.tier.reserve(sum(len(p.victims) for p in plans))

    def remove(self, seq: Sequence, state: SeqState, victims: list[int]) -> None:
        for i in reversed(victims):
            self.tier.offload(seq, state.table, i, self.pool, self.stats, self.reason)

    def extras(self, seq: Sequence) -> AttendExtras | None:
        st = self.state(seq)
        if st.index is None or st.index[0] != self.tier.version:
            st.index = (self.tier.version, self.tier.index(seq.id))
        starts, slots, kmin, kmax = st.index[1]
        st.retriever = None
        if not len(slots):
            return None
        recall, resident = self.config.recall_blocks(self.block_size), st.table.by_position(seq.block_table)
        ret = Retriever(self.tier, starts, slots, kmin, kmax, recall, self.config.rerank, resident, seq.num_computed)
        st.retriever = ret
        return AttendExtras(kv=ret, positioned=ret.positioned)

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None:
        """One `recall` event per block some layer read back this step but not in the step
        before (a block recalled every step is one recall, not one per step)."""
        st = self.state(seq)
        ret, st.retriever = st.retriever, None
        picked = ret.picked if ret is not None else {}
        for start in sorted(set(picked) - st.recalled):
            slot = self.tier.entries[(seq.id, start)]
            reason = "among a layer's top offloaded blocks for the current query"
            self.stats.emit("recall", seq.id, slot, (start, start + self.block_size), picked[start], reason)
        st.recalled = set(picked)
        st.read_back = ret.most if ret is not None else 0

    def active_tokens(self, seq: Sequence) -> int:
        st = self.seqs.get(seq.id)
        return seq.num_stored + (st.read_back if st is not None else 0)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.tier.drop(seq.id)
