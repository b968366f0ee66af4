"""Allocator invariants of the block pool and the KV manager."""

import numpy as np
import pytest

from localkv.errors import PoolExhausted
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.sequence import Sequence


def make(num_blocks=8, block_size=4):
    pool = BlockPool(n_layers=2, num_blocks=num_blocks, block_size=block_size, n_kv_heads=1, head_dim=2)
    return pool, KVManager(pool)


def test_new_block_only_when_last_is_full():
    pool, kv = make()
    seq = Sequence(list(range(10)))
    counts = []
    for _ in range(9):
        kv.append_slots(seq, 1)
        counts.append(len(seq.block_table))
    assert counts == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert pool.num_free == 8 - 3
    pool.check([seq.block_table])


def test_slots_follow_block_table():
    pool, kv = make(block_size=4)
    seq = Sequence([0] * 6)
    slots = kv.append_slots(seq, 6)
    b0, b1 = seq.block_table
    assert list(slots) == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]


def test_free_returns_every_block():
    pool, kv = make()
    seqs = [Sequence([1] * n) for n in (3, 5, 9)]
    for s in seqs:
        kv.append_slots(s, len(s.tokens))
    assert pool.num_free == 8 - (1 + 2 + 3)
    for s in seqs:
        kv.free(s)
    assert pool.num_free == 8
    pool.check([])


def test_exhaustion_is_a_clear_error_and_leaks_nothing():
    pool, kv = make(num_blocks=2, block_size=4)
    seq = Sequence([1] * 9)
    with pytest.raises(PoolExhausted, match="exhausted"):
        kv.append_slots(seq, 9)
    assert pool.num_free == 2 and seq.block_table == [] and seq.num_stored == 0


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    pool, kv = make(block_size=4)
    parent = Sequence([1] * 6)
    kv.append_slots(parent, 6)
    pool.k[:, parent.block_table[1], :2] = 7.0
    child = kv.fork(parent)
    assert child.block_table == parent.block_table
    assert [pool.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    pool.check([parent.block_table, child.block_table])
    kv.append_slots(child, 1)  # writes into the shared, partly filled block: copy first
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert child.block_table[1] != parent.block_table[1]
    assert pool.stats.cow_copies == 1
    assert np.all(pool.k[:, child.block_table[1], :2] == 7.0)
    pool.check([parent.block_table, child.block_table])
    kv.free(parent)
    kv.free(child)
    assert pool.num_free == pool.num_blocks


def test_double_free_is_caught():
    pool, _ = make()
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(b)


def test_allocation_reuses_warm_uncached_blocks_before_untouched_or_cached_ones():
    pool = BlockPool(n_layers=1, num_blocks=8, block_size=4, n_kv_heads=1, head_dim=2)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)  # a fresh pool hands blocks out in order
    pool.register(c, h=99, tokens=(1, 2, 3, 4))
    pool.release(a)
    pool.release(c)  # cached: kept for a prefix hit, reused last
    pool.release(b)
    assert pool.allocate() == b  # most recently freed uncached block first
    assert pool.allocate() == a
    assert pool.allocate() == 3  # then never-used blocks, in order
    assert pool.lookup(99, (1, 2, 3, 4)) == c
    rest = [pool.allocate() for _ in range(4)]
    assert rest == [4, 5, 6, 7]
    assert pool.allocate() == c and pool.lookup(99, (1, 2, 3, 4)) is None  # the cached block goes last
    with pytest.raises(PoolExhausted):
        pool.allocate()
    pool.check()


def test_spans_cover_the_blocks_bytes_in_every_layer_and_nothing_else():
    pool = BlockPool(3, 16, 4, 2, 8, dtype=np.float16)
    bids = [9, 2, 3, 4, 12, 3]  # runs 2-4, 9, 12; a repeat
    spans = pool.spans(bids)
    assert len(spans) == 2 * 3 * 3, "a span per run, layer and array"
    for a in (pool.k, pool.v):
        a.view(np.uint8)[...] = 0
    for start, end in spans:
        for a in (pool.k, pool.v):
            lo = a.ctypes.data
            if lo <= start and end <= lo + a.nbytes:
                flat = a.reshape(-1).view(np.uint8)
                flat[start - lo : end - lo] += 1
    for a in (pool.k, pool.v):
        marked = a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)
        want = np.zeros(a.shape[1], bool)
        want[sorted(set(bids))] = True
        assert (marked[:, want] == 1).all() and (marked[:, ~want] == 0).all()
