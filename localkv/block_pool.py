"""The physical KV pool: fixed-size blocks, reference counts, a free queue.

K/V live in two arrays [layers, blocks, block_size, kv_heads, head_dim]; a block id
indexes the second axis in every layer at once. Invariants (checked by check()):
- a block is in the free queue iff its ref_count is 0;
- ref_count equals the number of block tables holding the block.
"""

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import PoolExhausted


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once full and registered for prefix reuse


class BlockPool:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype=np.float32):
        if num_blocks < 1:
            raise PoolExhausted("the KV memory budget is too small for even one block")
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].nbytes

    def allocate(self) -> int:
        if not self.free_queue:
            raise PoolExhausted(f"KV pool exhausted: all {self.num_blocks} blocks of {self.block_size} tokens are in use "
                                "(raise --kv-mem)")
        bid, _ = self.free_queue.popitem(last=False)  # least recently freed first
        block = self.blocks[bid]
        block.ref_count, block.hash = 1, None
        return bid

    def incref(self, bid: int):
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_queue[bid]
        block.ref_count += 1

    def release(self, bid: int):
        block = self.blocks[bid]
        assert block.ref_count > 0, f"double free of block {bid}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[bid] = None

    def copy_block(self, src: int, dst: int, n_tokens: int):
        self.k[:, dst, :n_tokens] = self.k[:, src, :n_tokens]
        self.v[:, dst, :n_tokens] = self.v[:, src, :n_tokens]

    def check(self, tables: list[list[int]] = ()):
        """Assert the invariants; tables are all live block tables."""
        held = [0] * self.num_blocks
        for table in tables:
            for bid in table:
                held[bid] += 1
        for b in self.blocks:
            assert (b.ref_count == 0) == (b.id in self.free_queue), f"block {b.id}: free queue out of sync"
            if tables:
                assert b.ref_count == held[b.id], f"block {b.id}: ref_count {b.ref_count} != {held[b.id]} tables"
