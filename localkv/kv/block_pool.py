"""The physical KV pool: fixed-size blocks, reference counts, a free queue that keeps
freed blocks' prefix hashes so a later request can revive them.

K/V live in two arrays [layers, blocks, block_size, kv_heads, row]; a block id indexes the
second axis in every layer at once. A row is one kv head's head_dim values in the array's K/V
format (kv_format: float values, or GGUF's q8_0 / q4_0 blocks as bytes), so every copy of a
block (copy-on-write, the disk tier, offload) copies the pool's own bytes and never requantizes.
Blocks never handed out have no bookkeeping yet: ids from len(blocks) up are free and untouched
(a small model's 1 GiB pool holds a million blocks; objects for all of them would delay the first
token and take memory).
Invariants (checked by check()), over the blocks handed out so far:
- a block is in the free queue iff its ref_count is 0;
- ref_count equals the number of block tables holding the block;
- cached maps a hash to a block whose hash is that hash (free or not).
"""

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from localkv import kv_format
from localkv.errors import PoolExhausted
from localkv.kv.block_events import MEMORY, BlockLog
from localkv.stats import Stats


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once full and registered for prefix reuse
    tokens: tuple[int, ...] = ()  # the block's token ids, to verify a hash hit


class BlockPool:
    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype=np.float32,
        xp=np,
        stats: Stats | None = None,
    ):
        """dtype: a float dtype for K and V, or their (K, V) kv_format.KvFormat pair."""
        if num_blocks < 1:
            raise PoolExhausted("the KV memory budget is too small for even one block")
        k_fmt, v_fmt = dtype if isinstance(dtype, tuple) else (kv_format.of(np.dtype(dtype)),) * 2
        shape = (n_layers, num_blocks, block_size, n_kv_heads)
        # zeros are mapped lazily: a large pool costs memory only as it fills (numpy advises
        # huge pages for large arrays on Linux; an aligned mapping of our own measured no better)
        self.xp = xp
        self.k = xp.zeros((*shape, k_fmt.row_len(head_dim)), k_fmt.dtype)
        self.v = xp.zeros((*shape, v_fmt.row_len(head_dim)), v_fmt.dtype)
        # each layer's K and V (views of k and v), made once: every layer of every step reads them
        self.layers = [(self.k[i], self.v[i]) for i in range(n_layers)]
        self.block_size = block_size
        self._num_blocks = num_blocks
        self.blocks: list[Block] = []  # of the blocks handed out so far: ids 0 .. len - 1
        self.free_queue: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently first
        self._warm: list[int] = []  # freed blocks without a hash, most recent last (may hold stale ids)
        self.cached: dict[int, int] = {}  # prefix hash -> block id
        self.stats = stats or Stats()
        self.log: BlockLog | None = None  # told what becomes findable by hash and what stops being

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + self._num_blocks - len(self.blocks)

    @property
    def bytes_per_block(self) -> int:
        return self.k[:, 0].nbytes + self.v[:, 0].nbytes

    def allocate(self) -> int:
        """A block for new data. First the most recently freed block that caches nothing: its
        pages are mapped and likely in cache, where a never-used block costs a page fault per
        4 KiB on its first write. Then the free queue's order: never-used blocks, then cached ones
        least recently freed first (one loses its hash: recomputing it costs far more than its
        page faults, hence last)."""
        if not self.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: all {self.num_blocks} blocks of {self.block_size} tokens are in use "
                "(raise --kv-mem)"
            )
        while self._warm:
            bid = self._warm.pop()
            if bid in self.free_queue and self.blocks[bid].hash is None:
                del self.free_queue[bid]
                self.blocks[bid].ref_count = 1
                return bid
        if len(self.blocks) < self._num_blocks:
            self.blocks.append(Block(len(self.blocks), ref_count=1))
            return len(self.blocks) - 1
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            self._forget(block)
        block.ref_count = 1
        return bid

    def incref(self, bid: int):
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_queue[bid]  # revived from the free queue by a prefix hit
        block.ref_count += 1

    def release(self, bid: int):
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {bid}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[bid] = None
            if block.hash is None:
                self._warm.append(bid)
                if len(self._warm) > 2 * self.num_blocks:  # stale ids pile up only in odd patterns
                    self._warm = [
                        b for b in dict.fromkeys(self._warm) if b in self.free_queue and self.blocks[b].hash is None
                    ]

    def register(self, bid: int, h: int, tokens: tuple[int, ...], parent: int | None = None):
        """Make a full block findable by its prefix hash (first writer wins); parent: the hash
        of the block before it in its chain."""
        block = self.blocks[bid]
        if block.hash is None and h not in self.cached:
            block.hash, block.tokens = h, tokens
            self.cached[h] = bid
            if self.log is not None:
                self.log.stored(h, parent, tokens, MEMORY)

    def unregister(self, bid: int):
        """Make a block no longer findable by its hash (its tokens are about to change)."""
        block = self.blocks[bid]
        if block.hash is not None:  # then cached[hash] is this block (first writer wins)
            self._forget(block)

    def _forget(self, block: Block):
        del self.cached[block.hash]
        if self.log is not None:
            self.log.removed(block.hash, MEMORY)
        block.hash, block.tokens = None, ()

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        bid = self.cached.get(h)
        if bid is None or self.blocks[bid].tokens != tokens:  # verify: a hash is not proof
            return None
        return bid

    def spans(self, bids: list[int], most_runs: int | None = None) -> list[tuple[int, int]]:
        """The address spans [start, end) of these blocks' bytes in each layer of K and of V
        (a host pool's), a run of consecutive ids as one span: what a loader writes; none when
        the blocks lie in more than most_runs runs."""
        out, ids = [], sorted(set(bids))
        starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1] + 1]
        if most_runs is not None and len(starts) > most_runs:
            return []
        for a in (self.k, self.v):
            for r0, r1 in zip(starts, starts[1:] + [len(ids)]):
                for layer in range(a.shape[0]):
                    start = a.ctypes.data + layer * a.strides[0] + ids[r0] * a.strides[1]
                    out.append((start, start + (r1 - r0) * a.strides[1]))
        return out

    def copy_block(self, src: int, dst: int, n_tokens: int):
        self.k[:, dst, :n_tokens] = self.k[:, src, :n_tokens]
        self.v[:, dst, :n_tokens] = self.v[:, src, :n_tokens]

    def usage(self) -> dict:
        shared = sum(1 for b in self.blocks if b.ref_count > 1)
        cached_free = sum(1 for bid in self.free_queue if self.blocks[bid].hash is not None)
        return {
            "blocks": self.num_blocks,
            "used": self.num_blocks - self.num_free,
            "shared": shared,
            "cached_free": cached_free,
            "free": self.num_free - cached_free,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_dtype": kv_format.pair_name(kv_format.of(self.k), kv_format.of(self.v)),
        }

    def check(self, tables: list[list[int]] = ()):
        """Check the invariants (RuntimeError naming the first broken one); tables are all
        live block tables."""
        held = [0] * len(self.blocks)
        for table in tables:
            for bid in table:
                held[bid] += 1
        for b in self.blocks:
            if (b.ref_count == 0) != (b.id in self.free_queue):
                raise RuntimeError(f"block {b.id}: free queue out of sync")
            if tables and b.ref_count != held[b.id]:
                raise RuntimeError(f"block {b.id}: ref_count {b.ref_count} != {held[b.id]} tables")
        for h, bid in self.cached.items():
            if self.blocks[bid].hash != h:
                raise RuntimeError(f"cached hash of block {bid} out of sync")
