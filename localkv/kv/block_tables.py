"""Maps sequences onto the block pool: slots for new tokens, prefix-cache hits, forks,
copy-on-write, freeing."""

import hashlib

import numpy as np

from localkv.errors import PoolExhausted
from localkv.kv.block_pool import BlockPool
from localkv.sequence import Sequence


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
        self.salt = salt  # model fingerprint, block size, dtype, RoPE layout, KV format: nothing else matches

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        have = len(seq.block_table) * self.bs
        return max(0, -(-(seq.num_stored + n_new - have) // self.bs))

    def _needs_cow(self, seq: Sequence) -> bool:
        return bool(seq.num_stored % self.bs) and self.pool.blocks[seq.block_table[-1]].ref_count > 1

    def need(self, seq: Sequence, n_new: int) -> int:
        """Free blocks that appending n_new tokens takes, a copy-on-write included."""
        return self.blocks_needed(seq, n_new) + self._needs_cow(seq)

    def append_slots(self, seq: Sequence, n_new: int) -> np.ndarray:
        """Slots (block * block_size + offset) for the next n_new tokens of seq; takes blocks as needed."""
        start = seq.num_stored
        cow = self._needs_cow(seq)
        need = self.need(seq, n_new)  # checked up front: a failed call changes nothing
        if need > self.pool.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: {n_new} more tokens need {need} blocks, "
                f"{self.pool.num_free} are free (raise --kv-mem)"
            )
        if cow:
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
        seq.cow_copies += 1
        self.pool.stats.emit("cow", seq.id, new, reason=f"copy of shared block {old}")

    # ------------------------------------------------------------ prefix cache

    def chain(self, tokens: list[int], n_blocks: int, start: list[int] = ()) -> list[int]:
        """Hashes of the first n_blocks full blocks of tokens, continuing a known chain."""
        hashes = list(start)
        for i in range(len(hashes), n_blocks):
            hashes.append(
                block_hash(self.salt, hashes[-1] if hashes else None, tokens[i * self.bs : (i + 1) * self.bs])
            )
        return hashes

    def match_prefix(self, seq: Sequence, disk=None) -> tuple[int, int]:
        """Attach cached blocks for the leading full blocks of a fresh sequence's prompt: from
        the pool, else from the disk tier into fresh blocks. disk, if given, has
        contains(hash) -> bool and load_all([(hash, tokens, block id), ...]) -> [bool] (fills
        the pool blocks).
        Disk blocks are found in chain order, then loaded on this thread (a second one made
        the load slower: the GIL passes back and forth between the two per block); the chain
        stops at the first block that fails to load. The last prompt token is
        never matched: its logits are needed. Returns (tokens hit in memory, tokens loaded
        from disk)."""
        if seq.block_table:
            raise RuntimeError("prefix matching is for fresh sequences")
        n_full = (len(seq.tokens) - 1) // self.bs
        hashes = self.chain(seq.tokens, n_full)
        jobs = []  # (table index, hash, tokens, block id) to load from disk
        for i, h in enumerate(hashes):
            toks = tuple(seq.tokens[i * self.bs : (i + 1) * self.bs])
            bid = self.pool.lookup(h, toks)
            if bid is not None:
                self.pool.incref(bid)
            elif disk is None or not self.pool.num_free or not disk.contains(h):
                break
            else:
                bid = self.pool.allocate()
                jobs.append((i, h, toks, bid))
            seq.block_table.append(bid)
        loaded = disk.load_all([(h, toks, bid) for _, h, toks, bid in jobs]) if jobs else []
        hit = len(seq.block_table)
        for (i, h, toks, bid), ok in zip(jobs, loaded):
            if not ok:  # a corrupt or vanished entry: the chain ends before it
                hit = i
                break
            self.pool.register(bid, h, toks, hashes[i - 1] if i else None)
        for bid in seq.block_table[hit:]:
            self.pool.release(bid)
        del seq.block_table[hit:]
        disk_blocks = sum(1 for i, *_ in jobs if i < hit)
        seq.block_hashes = hashes[:hit]
        seq.num_computed = seq.num_stored = hit * self.bs
        stats = self.pool.stats
        stats.prefix_queries += len(seq.tokens)
        stats.prefix_hits += seq.num_stored
        stats.disk_hits += disk_blocks * self.bs
        return (hit - disk_blocks) * self.bs, disk_blocks * self.bs

    def register_full_blocks(self, seq: Sequence):
        """After a step: give the sequence's newly full blocks their chain hash."""
        if not seq.hashable:
            return
        n_full, done = seq.num_stored // self.bs, len(seq.block_hashes)
        if n_full <= done:
            return
        seq.block_hashes = self.chain(seq.tokens, n_full, seq.block_hashes)
        for i in range(done, n_full):
            toks = tuple(seq.tokens[i * self.bs : (i + 1) * self.bs])
            parent = seq.block_hashes[i - 1] if i else None
            self.pool.register(seq.block_table[i], seq.block_hashes[i], toks, parent)

    # ------------------------------------------------------------ sharing

    def fork(self, seq: Sequence) -> Sequence:
        """A child sharing every block of seq (full ones forever, the partial one until written)."""
        for bid in seq.block_table:
            self.pool.incref(bid)
        return Sequence(
            list(seq.tokens),
            list(seq.block_table),
            seq.num_computed,
            seq.num_stored,
            list(seq.block_hashes),
            seq.hashable,
        )

    def free(self, seq: Sequence):
        for bid in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            self.pool.release(bid)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = seq.num_stored = 0

    def rollback(self, seq: Sequence, n: int):
        """Drop seq's last n tokens, all computed and stored (see StepPlan for what this may
        touch): blocks left empty are released (a registered one keeps its hash: its K/V is
        still that of the tokens the hash names); the block left partly filled loses its
        registration if seq holds it alone, since the next write overwrites it."""
        keep = seq.num_stored - n
        if seq.pending or seq.num_stored != seq.num_computed or not 0 <= keep <= seq.num_stored:
            raise RuntimeError(
                f"rolling back {n} of sequence {seq.id}'s {seq.num_stored} stored tokens "
                f"({len(seq.pending)} pending): a bug in the caller's logic"
            )
        held = -(-keep // self.bs)
        for bid in reversed(seq.block_table[held:]):
            self.pool.release(bid)
        del seq.block_table[held:]
        if keep % self.bs and self.pool.blocks[seq.block_table[-1]].ref_count == 1:
            self.pool.unregister(seq.block_table[-1])
        del seq.block_hashes[keep // self.bs :]
        del seq.tokens[keep:]
        seq.num_computed = seq.num_stored = keep

    def blocks_held(self, seqs: list[Sequence]) -> int:
        """Distinct blocks these sequences hold (a shared one counts once)."""
        if len(seqs) == 1:
            return len(seqs[0].block_table)
        return len({bid for s in seqs for bid in s.block_table})
