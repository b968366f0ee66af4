"""Maps sequences onto the block pool: slots for new tokens, prefix-cache hits, forks,
copy-on-write, freeing."""

import hashlib

import numpy as np

from .block_pool import BlockPool
from .errors import PoolExhausted
from .sequence import Sequence


def block_hash(salt: bytes, parent: int | None, tokens) -> int:
    """H(model fingerprint, parent hash, token ids): stable across processes (no random seed)."""
    h = hashlib.sha256(salt)
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest()[:16], "little")


class KVManager:
    def __init__(self, pool: BlockPool, salt: bytes = b""):
        self.pool = pool
        self.bs = pool.block_size
        self.salt = salt  # model fingerprint + block size + dtype: other models never match

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        have = len(seq.block_table) * self.bs
        return max(0, -(-(seq.num_stored + n_new - have) // self.bs))

    def append_slots(self, seq: Sequence, n_new: int) -> np.ndarray:
        """Slots (block * block_size + offset) for the next n_new tokens of seq; takes blocks as needed."""
        need = self.blocks_needed(seq, n_new)
        if need > self.pool.num_free:
            raise PoolExhausted(f"KV pool exhausted: {n_new} more tokens need {need} blocks, "
                                f"{self.pool.num_free} are free (raise --kv-mem)")
        start = seq.num_stored
        if start % self.bs and self.pool.blocks[seq.block_table[-1]].ref_count > 1:
            self._copy_on_write(seq)
        while len(seq.block_table) * self.bs < start + n_new:
            seq.block_table.append(self.pool.allocate())
        idx = np.arange(start, start + n_new)
        seq.num_stored += n_new
        seq.num_computed += n_new
        return np.asarray(seq.block_table)[idx // self.bs] * self.bs + idx % self.bs

    def _copy_on_write(self, seq: Sequence):
        """The last block is partly filled and shared: give seq its own copy before writing."""
        old = seq.block_table[-1]
        new = self.pool.allocate()
        self.pool.copy_block(old, new, seq.num_stored % self.bs)
        self.pool.release(old)
        seq.block_table[-1] = new
        self.pool.stats.emit("cow", seq.id, new, reason=f"copy of shared block {old}")

    # ------------------------------------------------------------ prefix cache

    def chain(self, tokens: list[int], n_blocks: int, start: list[int] = ()) -> list[int]:
        """Hashes of the first n_blocks full blocks of tokens, continuing a known chain."""
        hashes = list(start)
        for i in range(len(hashes), n_blocks):
            hashes.append(block_hash(self.salt, hashes[-1] if hashes else None, tokens[i * self.bs:(i + 1) * self.bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the leading full blocks of a fresh sequence's prompt.
        The last prompt token is never matched: its logits are needed. Returns tokens hit."""
        assert not seq.block_table, "prefix matching is for fresh sequences"
        n_full = (len(seq.tokens) - 1) // self.bs
        hashes = self.chain(seq.tokens, n_full)
        for i, h in enumerate(hashes):
            bid = self.pool.lookup(h, tuple(seq.tokens[i * self.bs:(i + 1) * self.bs]))
            if bid is None:
                break
            self.pool.incref(bid)
            seq.block_table.append(bid)
        hit = len(seq.block_table)
        seq.block_hashes = hashes[:hit]
        seq.num_computed = seq.num_stored = hit * self.bs
        self.pool.stats.prefix_queries += len(seq.tokens)
        self.pool.stats.prefix_hits += seq.num_stored
        return seq.num_stored

    def register_full_blocks(self, seq: Sequence):
        """After a step: give the sequence's newly full blocks their chain hash."""
        if not seq.hashable:
            return
        n_full, done = seq.num_stored // self.bs, len(seq.block_hashes)
        if n_full <= done:
            return
        seq.block_hashes = self.chain(seq.tokens, n_full, seq.block_hashes)
        for i in range(done, n_full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i], tuple(seq.tokens[i * self.bs:(i + 1) * self.bs]))

    # ------------------------------------------------------------ sharing

    def fork(self, seq: Sequence) -> Sequence:
        """A child sharing every block of seq (full ones forever, the partial one until written)."""
        for bid in seq.block_table:
            self.pool.incref(bid)
        return Sequence(list(seq.tokens), list(seq.block_table), seq.num_computed, seq.num_stored,
                        list(seq.block_hashes), seq.hashable)

    def free(self, seq: Sequence):
        for bid in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            self.pool.release(bid)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = seq.num_stored = 0
