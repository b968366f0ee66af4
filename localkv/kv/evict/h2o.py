"""H2O (Heavy-Hitter Oracle), per token, per layer and per kv head: the pool keeps the
sinks and the recent window; each layer-head keeps, past the table, the tokens that received
the most attention mass in that layer-head (their K/V rows, read as extra keys). See
docs/EVICTION.md for why it is per token and per layer-head."""

import copy
from dataclasses import dataclass

import numpy as np

from localkv.kv.block_pool import BlockPool
from localkv.kv.evict.protocol import AttendExtras, to_host
from localkv.kv.evict.window import SeqState, TablePositions, WindowPolicy, apply_eviction
from localkv.sequence import Sequence


class HeavyHitters:
    """One sequence's heavy hitters. Per layer and kv head: up to `cap` tokens (K/V rows,
    compacted, in the pool's array module and dtype), their scores and positions; and the
    running mass of every token the table holds (`live`, [layers, kv_heads, len(table) *
    block_size], aligned with the table). Scores are H2O's sums of attention mass over prefill
    and decode, fading by a factor per query so that a token heavy long ago yields to one
    heavy now."""

    def __init__(self, pool: BlockPool, cap: int):
        layers, _, bs, kvh, _ = pool.k.shape
        self.cap, self.block_size = cap, bs
        self.xp = pool.xp
        # the pool's rows as stored (quantized ones too): compaction moves bytes, never requantizes
        self.k = self.xp.empty((layers, kvh, cap, pool.k.shape[4]), pool.k.dtype)
        self.v = self.xp.empty((layers, kvh, cap, pool.v.shape[4]), pool.v.dtype)
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

    def extra(self, layer: int, q=None):
        """This layer's heavy hitters as extra keys: (K, V) [kvh, n, hd] (whatever the query)."""
        return None if not self.n else (self.k[layer, :, : self.n], self.v[layer, :, : self.n])

    def observe(self, mass, fade: float = 1.0) -> None:
        """Fold one forward's mass [layers, kv_heads, n + n_ctx] (heavy hitters first), after
        scaling the scores held so far by `fade`."""
        mass = to_host(mass)
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
        layers, kvh = self.k.shape[:2]
        cols = np.concatenate([np.arange(i * bs, (i + 1) * bs) for i in victims])
        bids = xp.asarray(np.asarray([seq.block_table[i] for i in victims]))
        # [layers, nv, bs, kvh, row] -> [layers, kvh, nv * bs, row]
        new_k = pool.k[:, bids].transpose(0, 3, 1, 2, 4).reshape(layers, kvh, -1, self.k.shape[3])
        new_v = pool.v[:, bids].transpose(0, 3, 1, 2, 4).reshape(layers, kvh, -1, self.v.shape[3])
        new_s = self.live[:, :, cols]
        new_p = np.broadcast_to(np.concatenate([starts[i] + np.arange(bs) for i in victims]), new_s.shape)
        block_scores = new_s.reshape(layers, kvh, len(victims), bs).sum(axis=3).mean(axis=(0, 1))
        self.live = np.delete(self.live, cols, axis=2)
        fill = min(cap - n, len(cols))  # free slots take the first tokens as they are
        end = n + fill
        self.k[:, :, n:end], self.v[:, :, n:end] = new_k[:, :, :fill], new_v[:, :, :fill]
        self.score[:, :, n:end], self.pos[:, :, n:end] = new_s[:, :, :fill], new_p[:, :, :fill]
        self.n = end
        if len(cols) > fill:
            self._replace_lowest(new_k, new_v, new_s, new_p, fill)
        # what stayed, from the positions now stored (heavy hitters are older than any victim)
        first = np.array([starts[i] for i in victims])
        stored = self.pos[:, :, : self.n].ravel()
        mine = np.searchsorted(first, stored, side="right") - 1
        is_new = (mine >= 0) & (stored < first[np.maximum(mine, 0)] + bs)
        kept = np.bincount(mine[is_new], minlength=len(victims))
        pushed = layers * kvh * n - int((~is_new).sum())
        return block_scores, kept.tolist(), pushed

    def _replace_lowest(self, new_k, new_v, new_s, new_p, fill: int) -> None:
        """A full store: per layer-head, the `rest` lowest of the cap held and the `rest`
        incoming rows past `fill` go; freed slots take the incoming rows that stay, in order."""
        xp, cap, rest = self.xp, self.cap, new_s.shape[2] - fill
        score = np.concatenate([self.score, new_s[:, :, fill:]], axis=2)
        drop = np.zeros(score.shape, bool)
        np.put_along_axis(drop, np.argpartition(score, rest - 1, axis=2)[:, :, :rest], True, axis=2)
        freed = np.nonzero(drop[:, :, :cap])
        taken = np.nonzero(~drop[:, :, cap:])
        taken = (taken[0], taken[1], taken[2] + fill)
        self.score[freed], self.pos[freed] = new_s[taken], new_p[taken]
        fx, tx = tuple(xp.asarray(a) for a in freed), tuple(xp.asarray(a) for a in taken)
        self.k[fx], self.v[fx] = new_k[tx], new_v[tx]

    def copy(self) -> "HeavyHitters":
        twin = copy.copy(self)
        twin.k, twin.v, twin.score, twin.pos, twin.live = (
            a.copy() for a in (self.k, self.v, self.score, self.pos, self.live)
        )
        return twin


@dataclass(slots=True)
class H2OSeqState(SeqState):
    heavy: HeavyHitters

    def sync(self, seq: Sequence) -> "H2OSeqState":
        self.table.sync(seq)
        self.heavy.sync(seq)
        return self

    def fork(self) -> "H2OSeqState":
        return H2OSeqState(self.table.copy(), self.heavy.copy())


class H2OPolicy(WindowPolicy):
    """Blocks leaving the window go through HeavyHitters.absorb; attention reads the heavy
    hitters as extra keys and reports its mass, which after_forward folds into the scores."""

    def new_state(self) -> H2OSeqState:
        bs = self.block_size
        return H2OSeqState(TablePositions(bs), HeavyHitters(self.pool, self.config.heavy_tokens(bs)))

    def remove(self, seq: Sequence, state: H2OSeqState, victims: list[int]) -> None:
        scores, kept, pushed = state.heavy.absorb(seq, victims, self.pool, state.table.start)
        rows = self.pool.k.shape[0] * self.pool.k.shape[3] * self.block_size
        reasons = [f"{self.reason}; {k} of its {rows} (token, layer, kv head) rows stay as heavy hitters" for k in kept]
        if pushed:
            reasons[-1] += f"; {pushed} older heavy-hitter rows dropped"
        apply_eviction(seq, state.table, victims, self.pool, self.stats, self.reason, scores, reasons)

    def extras(self, seq: Sequence) -> AttendExtras:
        """A zeroed mass array [layers, kv_heads, heavy hitters + stored tokens] for the model to
        fill, and the heavy hitters as extra keys (None while there are none)."""
        hh = self.state(seq).heavy
        layers, _, _, kvh, _ = self.pool.k.shape
        mass = np.zeros((layers, kvh, hh.n + seq.num_stored), np.float32)
        return AttendExtras(mass, hh.extra if hh.n else None)

    def after_forward(self, seq: Sequence, extras: AttendExtras | None, n_queries: int) -> None:
        """Fold the mass of n_queries queries into the scores, fading the older ones."""
        if extras is not None and extras.mass is not None:
            self.state(seq).heavy.observe(extras.mass, self.config.decay**n_queries)

    def active_tokens(self, seq: Sequence) -> int:
        st = self.seqs.get(seq.id)
        return seq.num_stored + (st.heavy.n if st is not None else 0)
