"""Maps sequences onto the block pool: slots for new tokens, forks, copy-on-write, freeing."""

import numpy as np

from .block_pool import BlockPool
from .errors import PoolExhausted
from .sequence import Sequence


class KVManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.bs = pool.block_size

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        have = len(seq.block_table) * self.bs
        return max(0, -(-(seq.num_kv + n_new - have) // self.bs))

    def can_append(self, seqs_and_counts) -> bool:
        return sum(self.blocks_needed(s, n) for s, n in seqs_and_counts) <= self.pool.num_free

    def append_slots(self, seq: Sequence, n_new: int) -> np.ndarray:
        """Slots (block * block_size + offset) for the next n_new tokens of seq; takes blocks as needed."""
        if self.blocks_needed(seq, n_new) > self.pool.num_free:
            raise PoolExhausted(f"KV pool exhausted: {n_new} more tokens need {self.blocks_needed(seq, n_new)} "
                                f"blocks, {self.pool.num_free} are free (raise --kv-mem)")
        start = seq.num_kv
        if start % self.bs and self.pool.blocks[seq.block_table[-1]].ref_count > 1:
            self._copy_on_write(seq)
        while len(seq.block_table) * self.bs < start + n_new:
            seq.block_table.append(self.pool.allocate())
        pos = np.arange(start, start + n_new)
        table = np.asarray(seq.block_table)
        seq.num_kv += n_new
        return table[pos // self.bs] * self.bs + pos % self.bs

    def _copy_on_write(self, seq: Sequence):
        """The last block is partly filled and shared: give seq its own copy before writing."""
        old = seq.block_table[-1]
        new = self.pool.allocate()
        self.pool.copy_block(old, new, seq.num_kv % self.bs)
        self.pool.release(old)
        seq.block_table[-1] = new
        self.pool.cow_copies += 1

    def fork(self, seq: Sequence) -> Sequence:
        """A child sharing every block of seq (full ones forever, the partial one until written)."""
        for bid in seq.block_table:
            self.pool.incref(bid)
        return Sequence(list(seq.tokens), list(seq.block_table), seq.num_kv)

    def free(self, seq: Sequence):
        for bid in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            self.pool.release(bid)
        seq.block_table.clear()
        seq.num_kv = 0
