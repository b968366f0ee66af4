"""The eviction / offload policy layer on a small synthetic pool (no model)."""

import numpy as np
import pytest

from localkv.backends.cpu import paged_attention
from localkv.errors import LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.kv.evict import (
    EvictConfig,
    Evictor,
    OffloadTier,
    SeqKV,
    choose_victims,
    quest_scores,
    ref_counts,
)
from localkv.sequence import Sequence

BS, LAYERS, KVH, HEADS, HD = 4, 2, 2, 4, 8


def make(num_blocks=64, block_size=BS):
    pool = BlockPool(n_layers=LAYERS, num_blocks=num_blocks, block_size=block_size, n_kv_heads=KVH, head_dim=HD)
    return pool, KVManager(pool)


def append(kv, seq, n, rng=None):
    """append_slots plus K/V content: key[..., 0] = the token's position, the rest random."""
    slots = kv.append_slots(seq, n)
    pos = np.arange(seq.num_computed - n, seq.num_computed)
    rng = rng or np.random.default_rng(seq.num_computed)
    for arr in (kv.pool.k, kv.pool.v):
        flat = arr.reshape(LAYERS, -1, KVH, HD)
        flat[:, slots] = rng.standard_normal((LAYERS, n, KVH, HD)).astype(np.float32)
        flat[:, slots, :, :1] = pos[None, :, None, None]
    return slots


def new_seq(kv, n, rng=None):
    seq = Sequence(list(range(n)))
    append(kv, seq, n, rng)
    return seq


def positions_held(pool, seq):
    """The first position each table entry holds, read back from the keys themselves."""
    return [int(pool.k[0, b, 0, 0, 0]) for b in seq.block_table]


def events(pool, kind):
    return [e for e in pool.stats.events if e.kind == kind]


# ------------------------------------------------------------ config


def test_validation_errors():
    with pytest.raises(LocalkvError, match="unknown KV policy 'lru'"):
        EvictConfig("lru", 64).validate(BS)
    with pytest.raises(LocalkvError, match=r"too small.*need 8"):
        EvictConfig("sliding", budget=7, sinks=4).validate(BS)  # sinks 4 + one block 4
    with pytest.raises(LocalkvError, match=r"too small.*need 8"):
        EvictConfig("h2o", budget=7, sinks=1).validate(BS)  # 1 sink rounds up to a block
    with pytest.raises(LocalkvError, match=r"too small.*need 20"):
        EvictConfig("h2o", budget=16, sinks=4, recent=9).validate(BS)  # 4 + 12 (9 in blocks) + 4
    with pytest.raises(LocalkvError, match="invalid KV recent -1"):
        EvictConfig("sliding", budget=64, recent=-1).validate(BS)
    with pytest.raises(LocalkvError, match="invalid KV sinks -4"):
        EvictConfig("sliding", budget=64, sinks=-4).validate(BS)
    with pytest.raises(LocalkvError, match="invalid KV budget -1"):
        EvictConfig("sliding", budget=-1).validate(BS)
    with pytest.raises(LocalkvError, match="needs a budget"):
        EvictConfig("h2o").validate(BS)
    with pytest.raises(LocalkvError, match=r"invalid heavy share 1.0"):
        EvictConfig("h2o", budget=64, heavy_share=1.0).validate(BS)
    pool, _ = make()
    with pytest.raises(LocalkvError, match="unknown KV policy"):
        Evictor(EvictConfig("LRU", 64), pool)
    # the boundaries themselves are valid
    EvictConfig().validate(BS)
    EvictConfig("sliding", budget=8, sinks=4).validate(BS)
    EvictConfig("h2o", budget=16, sinks=4, recent=8).validate(BS)
    EvictConfig("h2o", budget=8, sinks=0, recent=0).validate(BS)


def test_default_recent_window():
    assert EvictConfig("sliding", budget=32, sinks=4).recent_tokens(BS) == 32 - 4 - BS
    # h2o: half the room (6 blocks past sinks and the spare) is per-layer-head heavy-hitter slots
    h2o = EvictConfig("h2o", budget=32, sinks=4)
    assert h2o.heavy_tokens(BS) == 3 * BS and h2o.recent_tokens(BS) == 3 * BS and h2o.resident_blocks(BS) == 5
    assert EvictConfig("h2o", budget=32, sinks=4, heavy_share=0.0).recent_tokens(BS) == 32 - 4 - BS
    assert EvictConfig("sliding", budget=32).heavy_tokens(BS) == 0
    # offload: 90% of the room (14 blocks past sinks and the spare) is recall slots, the rest recent window
    off = EvictConfig("offload", budget=64, sinks=4)
    assert off.recall_blocks(BS) == 12 and off.recent_tokens(BS) == 2 * BS and off.resident_blocks(BS) == 4
    assert EvictConfig("offload", budget=64, sinks=4, recent=8).recall_blocks(BS) == 12
    assert EvictConfig("h2o", budget=64).recall_blocks(BS) == 0
    assert EvictConfig("h2o", budget=32, recent=3).recent_tokens(BS) == 3
    assert EvictConfig("h2o", budget=32, recent=3).heavy_tokens(BS) == 5 * BS  # all the room the window leaves
    assert EvictConfig("h2o", budget=32, recent=3).chunk_limit(BS) == 3
    assert EvictConfig().chunk_limit(BS) is None


# ------------------------------------------------------------ choosing victims


def test_sliding_keeps_sinks_and_recent_and_drops_oldest_first():
    pool, kv = make()
    ev = Evictor(EvictConfig("sliding", budget=16, sinks=4), pool)  # recent: 8
    seq = Sequence([])
    for t in range(60):
        seq.tokens.append(t)
        assert ev.make_room(seq, 1) == 0
        append(kv, seq, 1)
        held = positions_held(pool, seq)
        assert held == ev.state(seq).start.tolist() and held == sorted(held)
        assert held[0] == 0  # the sink block
        covered = {p for s in held for p in range(s, s + BS)}
        assert set(range(max(0, seq.num_computed - 8), seq.num_computed)) <= covered  # the recent window
        assert len(seq.block_table) <= 4 and seq.num_stored <= 16
        pool.check([seq.block_table])
    evicted = [e.positions for e in events(pool, "evict")]
    assert evicted == [(s, s + BS) for s in range(4, 4 + BS * len(evicted), BS)]  # oldest first, no gaps
    assert len(evicted) == pool.stats.evictions == 60 // BS - 4
    assert not seq.hashable


def h2o_step(ev, kv, seq, n, rng, mass_fn):
    """make_room + append n tokens + a mass array filled by mass_fn(mass, hh) + observe."""
    seq.tokens += [0] * n
    assert ev.make_room(seq, n) == 0
    append(kv, seq, n, rng)
    mass = ev.mass_for(seq)
    mass_fn(mass, ev.heavy_hitters(seq))
    ev.observe(seq, mass)


def test_h2o_each_layer_head_keeps_its_own_top_tokens():
    """Per layer and kv head, the tokens with the most attention mass stay (their exact K/V),
    whichever blocks they came from; sinks and the recent window stay in the table."""
    pool, kv = make()
    cfg = EvictConfig("h2o", budget=24, sinks=4, recent=4)  # 6 blocks: sink, recent, spare; 3 blocks = 12 heavy slots
    ev = Evictor(cfg, pool)
    assert cfg.heavy_tokens(BS) == 12 and cfg.resident_blocks(BS) == 3
    rng = np.random.default_rng(2)
    favourite = {(l, h): {5 + 7 * l + 3 * h, 9 + 11 * l + 5 * h} for l in range(LAYERS) for h in range(KVH)}

    def mass_fn(mass, hh):  # token p gets 0.01 * p, each layer-head's favourites get 10
        base = np.zeros(mass.shape[2] - hh.n)
        first = ev.state(seq).start
        ctx = np.concatenate([np.arange(s, s + BS) for s in first])[: len(base)]
        for (l, h), fav in favourite.items():
            mass[l, h, hh.n :] = 0.01 * ctx + np.where(np.isin(ctx, list(fav)), 10.0, 0.0)

    saved_k = {}
    seq = Sequence([])
    for _ in range(60):
        h2o_step(ev, kv, seq, 1, rng, mass_fn)
        for i, b in enumerate(seq.block_table):
            saved_k[int(ev.state(seq).start[i])] = pool.k[:, b].copy()
    hh = ev.heavy_hitters(seq)
    assert hh.n == 12 and ev.active_tokens(seq) == seq.num_stored + 12 <= cfg.budget
    assert positions_held(pool, seq)[0] == 0 and len(seq.block_table) <= 3
    for (l, h), fav in favourite.items():
        held = sorted(hh.pos[l, h, : hh.n].tolist())
        assert set(fav) <= set(held)  # the favourites beat later tokens' larger 0.01 * p
        for j in range(hh.n):  # exact K/V of the token each slot claims to hold
            p = int(hh.pos[l, h, j])
            start = p - p % BS
            assert np.array_equal(hh.k[l, h, j], saved_k[start][l, p - start, h])
        k, v = hh.extra(l)
        assert k.shape == v.shape == (KVH, 12, HD)
    assert sorted(hh.pos[0, 0].tolist()) != sorted(hh.pos[1, 1].tolist())  # layer-heads differ
    ev_ = events(pool, "evict")
    assert len(ev_) == pool.stats.evictions == 60 // BS - 3 and all("heavy hitters" in e.reason for e in ev_)
    assert not seq.hashable


def test_h2o_matches_a_brute_force_top_k_over_everything_that_left():
    """Random scores: after every step each layer-head holds exactly the cap highest-scoring
    tokens among all that ever left the table (a dropped token never comes back), and its
    score is the mass it accumulated."""
    pool, kv = make()
    ev = Evictor(EvictConfig("h2o", budget=28, sinks=4, recent=8, decay=1.0), pool)  # plain sums: the reference adds
    cap = ev.cfg.heavy_tokens(BS)
    assert cap == 12  # 7 blocks: sink, 2 recent, spare, 3 blocks of heavy-hitter slots
    rng = np.random.default_rng(9)
    total = {}  # (l, h, pos) -> accumulated mass
    alive = {(l, h): set() for l in range(LAYERS) for h in range(KVH)}  # reference heavy sets
    seq = Sequence([])

    def mass_fn(mass, hh):
        mass[:] = rng.random(mass.shape)
        first = ev.state(seq).start
        ctx = np.concatenate([np.arange(s, s + BS) for s in first])[: mass.shape[2] - hh.n]
        for l in range(LAYERS):
            for h in range(KVH):
                for j in range(hh.n):
                    total[l, h, int(hh.pos[l, h, j])] += mass[l, h, j]
                for c, p in enumerate(ctx):
                    total[l, h, int(p)] = total.get((l, h, int(p)), 0.0) + mass[l, h, hh.n + c]

    for _ in range(30):
        n = int(rng.integers(1, 5))
        before = set(positions_held(pool, seq))
        h2o_step(ev, kv, seq, n, rng, mass_fn)
        hh = ev.heavy_hitters(seq)
        left = before - set(positions_held(pool, seq))
        for (l, h), ref in alive.items():
            pool_ = ref | {p for s in left for p in range(s, s + BS)}
            best = sorted(pool_, key=lambda p: -total[l, h, p])[:cap]
            alive[l, h] = set(best)
            assert set(hh.pos[l, h, : hh.n].tolist()) == alive[l, h]
            for j in range(hh.n):
                assert np.isclose(hh.score[l, h, j], total[l, h, int(hh.pos[l, h, j])])
    assert hh.n == cap and pool.stats.evictions > 8


def test_partial_last_block_is_never_taken():
    pool, kv = make()
    seq = new_seq(kv, 10)  # blocks of 4, 4, 2
    state = SeqKV(BS).sync(seq)
    cfg = EvictConfig("sliding", budget=8, sinks=0, recent=0)
    assert choose_victims(state, 3, cfg, ref_counts(seq, pool)) == [0, 1]
    # even when the incoming tokens would fill it and put it wholly behind the recent window
    assert choose_victims(state, 3, cfg, ref_counts(seq, pool), incoming=6) == [0, 1]


def test_shared_blocks_are_never_chosen():
    pool, kv = make()
    parent = new_seq(kv, 12)
    child = kv.fork(parent)  # blocks 0-2 now have ref_count 2
    parent.tokens += [0] * 12
    append(kv, parent, 12)
    state = SeqKV(BS).sync(parent)  # the shared ones are the oldest
    cfg = EvictConfig("h2o", budget=8, sinks=0, recent=4)
    assert choose_victims(state, 5, cfg, ref_counts(parent, pool)) == [3, 4]
    # the child holds only shared blocks: nothing may go, the shortfall is reported
    ev = Evictor(EvictConfig("h2o", budget=8, sinks=0, recent=0), pool)
    table = list(child.block_table)
    assert ev.make_room(child, 1) == 4 - ev.cfg.resident_blocks(BS)  # 3 full blocks + 1 for the new token
    assert child.block_table == table and child.hashable
    assert pool.stats.evictions == 0
    pool.check([parent.block_table, child.block_table])


def test_policy_none_never_evicts():
    pool, kv = make()
    ev = Evictor(EvictConfig(), pool)
    seq = Sequence([])
    for t in range(40):
        seq.tokens.append(t)
        assert ev.make_room(seq, 1) == 0
        append(kv, seq, 1)
        assert ev.mass_for(seq) is None
    assert len(seq.block_table) == 10 and not pool.stats.events


# ------------------------------------------------------------ the engine's loop

CONFIGS = [
    (EvictConfig("sliding", budget=16, sinks=4), 4),
    (EvictConfig("sliding", budget=40, sinks=1, recent=13), 4),
    (EvictConfig("h2o", budget=32, sinks=4), 4),
    (EvictConfig("h2o", budget=24, sinks=0, recent=0), 4),
    (EvictConfig("h2o", budget=64, sinks=4, recent=20), 16),
    (EvictConfig("offload", budget=32, sinks=4, recent=9), 4),
]


@pytest.mark.parametrize("cfg,bs", CONFIGS, ids=lambda c: c.policy if isinstance(c, EvictConfig) else str(c))
def test_budget_never_exceeded_and_tables_stay_aligned(cfg, bs):
    rng = np.random.default_rng(bs + cfg.budget)
    pool = BlockPool(LAYERS, 64, bs, KVH, HD)
    kv = KVManager(pool)
    ev = Evictor(cfg, pool)
    seq, limit = Sequence([]), cfg.chunk_limit(bs)
    recent, sinks = cfg.recent_tokens(bs), cfg.sink_tokens(bs)
    while seq.num_computed < 400:
        n = int(rng.integers(1, limit + 1)) if seq.num_computed < 100 else 1  # "prefill" chunks, then decode
        seq.tokens += [0] * n
        assert ev.make_room(seq, n) == 0
        slots = kv.append_slots(seq, n)
        pos = np.arange(seq.num_computed - n, seq.num_computed)
        pool.k.reshape(LAYERS, -1, KVH, HD)[:, slots] = rng.standard_normal((LAYERS, n, KVH, HD))
        pool.k.reshape(LAYERS, -1, KVH, HD)[:, slots, :, :1] = pos[None, :, None, None]
        mass = ev.mass_for(seq)
        if mass is not None:
            mass += rng.random(mass.shape).astype(np.float32)
        ev.observe(seq, mass)
        assert len(seq.block_table) <= cfg.resident_blocks(bs) <= cfg.budget // bs
        assert ev.active_tokens(seq) <= cfg.budget
        held = positions_held(pool, seq)
        assert held == ev.state(seq).start.tolist() == sorted(held)
        assert held[: sinks // bs] == list(range(0, sinks, bs))
        covered = {p for s in held for p in range(s, s + bs)}
        assert set(range(max(0, seq.num_computed - recent), seq.num_computed)) <= covered
        assert seq.num_stored == (len(held) - 1) * bs + (seq.num_computed - held[-1])
        pool.check([seq.block_table])
    gone = pool.stats.evictions + pool.stats.offloads
    assert gone == seq.num_computed // bs - seq.num_stored // bs > 0
    ev.free(seq)
    kv.free(seq)
    assert pool.num_free == pool.num_blocks and not ev.states and not ev.heavy
    assert ev.tier is None or not ev.tier.entries


def test_mass_is_per_layer_and_kv_head_and_covers_heavy_hitters():
    """Real attention mass from paged_attention in every layer, heavy hitters included: each
    query hands each query head's unit to the keys of its kv head, in that layer."""
    pool, kv = make()
    ev = Evictor(EvictConfig("h2o", budget=24, sinks=4, recent=4, decay=1.0), pool)  # no fading: mass is conserved
    rng = np.random.default_rng(1)
    seq = Sequence([])
    queries = 0
    for n in (4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1):  # prefill chunks, then decode: blocks leave the table
        seq.tokens += [0] * n
        ev.make_room(seq, n)
        append(kv, seq, n, rng)
        mass, hh = ev.mass_for(seq), ev.heavy_hitters(seq)
        assert mass.shape == (LAYERS, KVH, hh.n + seq.num_stored)
        q = rng.standard_normal((n, HEADS, HD)).astype(np.float32)
        ret = ev.retriever(seq)
        for layer in range(LAYERS):
            extra = ret(layer, q) if ret is not None else None
            paged_attention(
                q, pool.k[layer], pool.v[layer], np.asarray(seq.block_table), seq.num_stored, 0.3, mass[layer], extra
            )
        np.testing.assert_allclose(mass.sum(axis=2), n * HEADS // KVH, rtol=1e-5)
        ev.observe(seq, mass)
        queries += n
    hh = ev.heavy_hitters(seq)
    assert hh.n > 0 and pool.stats.evictions > 0
    # no token was dropped yet (12 heavy slots hold all that left): every unit of mass is on a kept token
    assert hh.n < ev.cfg.heavy_tokens(BS)
    assert np.isclose(hh.score[:, :, : hh.n].sum() + hh.live.sum(), queries * HEADS * LAYERS)


# ------------------------------------------------------------ offload tier


@pytest.mark.parametrize("spill", [False, True], ids=["ram", "memmap"])
def test_offload_round_trips_k_v_bit_exactly(spill, tmp_path):
    pool, kv = make()
    rng = np.random.default_rng(7)
    seq = new_seq(kv, 24, rng)  # 6 blocks
    state = SeqKV(BS).sync(seq)
    tier = OffloadTier((LAYERS, BS, KVH, HD), pool.k.dtype, tmp_path / "spill" if spill else None, capacity=1)
    saved = {
        start: (pool.k[:, seq.block_table[i]].copy(), pool.v[:, seq.block_table[i]].copy())
        for i, start in ((1, 4), (3, 12))
    }
    bids = [seq.block_table[i] for i in (3, 1)]
    tier.offload(seq, state, 3, pool, pool.stats)
    tier.offload(seq, state, 1, pool, pool.stats)  # grows the tier past its capacity of 1
    assert tier.capacity >= 2 and [s for s, _ in tier.blocks_of(seq.id)] == [4, 12]
    assert positions_held(pool, seq) == state.start.tolist() == [0, 8, 16, 20]
    assert seq.num_stored == 16 and not seq.hashable and all(pool.blocks[b].ref_count == 0 for b in bids)
    pool.check([seq.block_table])
    pool.k[:, bids], pool.v[:, bids] = np.nan, np.nan  # the pool's copies are gone: the tier must hold its own
    starts, slots, kmin, kmax = tier.index(seq.id)
    assert starts.tolist() == [4, 12]
    for start, slot in zip(starts, slots):
        k, v = saved[int(start)]  # [L, bs, kvh, hd]
        for layer in range(LAYERS):
            for h in range(KVH):
                assert np.array_equal(tier.block_kv(np.array([slot]), 0, layer, h)[0], k[layer, :, h])
                assert np.array_equal(tier.block_kv(np.array([slot]), 1, layer, h)[0], v[layer, :, h])
        j = int(np.flatnonzero(slots == slot)[0])
        assert np.array_equal(kmin[..., j], k.min(axis=1)) and np.array_equal(kmax[..., j], k.max(axis=1))
    assert [e.kind for e in pool.stats.events] == ["offload", "offload"]
    assert [e.positions for e in pool.stats.events] == [(12, 16), (4, 8)]
    assert pool.stats.offloads == 2 and pool.stats.evictions == 0 and tier.nbytes == 2 * tier.kv[0].nbytes
    tier.drop(seq.id)
    assert not tier.entries and tier.nbytes == 0 and len(tier.free_slots) == tier.capacity
    if spill:
        assert list((tmp_path / "spill").iterdir()) == []  # the spill file leaves nothing behind
        tier.close()


def test_unwritable_offload_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(LocalkvError, match="cannot write the KV offload file"):
        OffloadTier((LAYERS, BS, KVH, HD), np.float32, blocker / "spill")
    pool, _ = make()
    with pytest.raises(LocalkvError, match="cannot write the KV offload file"):
        Evictor(EvictConfig("offload", budget=32), pool, offload_dir=blocker)


def test_quest_bound_is_an_upper_bound_and_tight_for_constant_blocks():
    pool, kv = make()
    rng = np.random.default_rng(3)
    seq = new_seq(kv, 28, rng)
    pool.k[:] *= rng.uniform(0.1, 5, (1, pool.num_blocks, 1, KVH, 1)).astype(np.float32)
    const = seq.block_table[5]
    pool.k[:, const] = rng.standard_normal((LAYERS, 1, KVH, HD))  # every token of this block has the same key
    keys = [pool.k[:, seq.block_table[i]].copy() for i in range(7)]  # [L, bs, kvh, hd]
    state = SeqKV(BS).sync(seq)
    tier = OffloadTier.for_pool(pool)
    for i in range(6, -1, -1):
        tier.offload(seq, state, i, pool, pool.stats)
    starts, _, kmin, kmax = tier.index(seq.id)
    assert starts.tolist() == [4 * i for i in range(7)]
    for _ in range(20):
        q = rng.standard_normal((KVH, 3, HD)).astype(np.float32)  # 3 query rows per kv head
        for layer in range(LAYERS):
            bound = quest_scores(q, kmin[layer], kmax[layer])  # [kvh, 3, n]
            true = np.stack([np.einsum("hrd,thd->hrt", q, keys[i][layer]).max(axis=-1) for i in range(7)], -1)
            assert np.all(bound >= true - 1e-4)
            assert np.allclose(bound[..., 5], true[..., 5], atol=1e-4)  # exact when min == max


def test_each_layer_reads_back_its_own_best_blocks():
    """Per layer and kv head, the block whose keys align with that layer's query comes back,
    with its exact K/V; the budget's recall slots bound what one layer reads."""
    pool, kv = make()
    seq = new_seq(kv, 32)  # 8 blocks; key dim 1 carries the signal
    pool.k[..., 1:] = 0.0
    pool.k[0, seq.block_table[2], :, :, 1] = 1.0  # layer 0: positions 8-11 align with q
    pool.k[1, seq.block_table[3], :, :, 1] = 1.0  # layer 1: positions 12-15
    saved = {i: (pool.k[:, seq.block_table[i]].copy(), pool.v[:, seq.block_table[i]].copy()) for i in range(8)}
    cfg = EvictConfig("offload", budget=20, sinks=4, recent=8, rerank=2)  # 5 blocks: 4 resident, 1 recall slot
    ev = Evictor(cfg, pool)
    assert cfg.recall_blocks(BS) == 1 and cfg.resident_blocks(BS) == 4
    seq.tokens.append(0)
    assert ev.make_room(seq, 1) == 0  # 9 blocks wanted, 4 may stay: sink, 2 recent, the new one
    assert [s for s, _ in ev.tier.blocks_of(seq.id)] == [4, 8, 12, 16, 20]
    assert positions_held(pool, seq) == [0, 24, 28]
    ret = ev.retriever(seq)
    q = np.zeros((1, HEADS, HD), np.float32)
    q[..., 1] = 10.0
    for layer, want in ((0, 2), (1, 3)):
        k, v = ret(layer, q)
        assert k.shape == v.shape == (KVH, BS, HD)
        for h in range(KVH):
            assert np.array_equal(k[h], saved[want][0][layer, :, h]) and np.array_equal(
                v[h], saved[want][1][layer, :, h]
            )
    assert sorted(ret.picked) == [8, 12] and ret.most == BS
    ev.recalled(seq, ret)
    assert [e.positions for e in events(pool, "recall")] == [(8, 12), (12, 16)]
    ev.recalled(seq, ev.retriever(seq))  # nothing picked this time (no forward ran): no new events
    assert len(events(pool, "recall")) == 2 and ev.active_tokens(seq) == seq.num_stored


def test_fork_copies_heavy_hitters_and_free_forgets():
    pool, kv = make()
    ev = Evictor(EvictConfig("h2o", budget=24, sinks=4, recent=4), pool)
    rng = np.random.default_rng(4)
    parent = Sequence([])
    for _ in range(8):
        h2o_step(ev, kv, parent, 4, rng, lambda mass, hh: mass.__iadd__(rng.random(mass.shape)))
    hh = ev.heavy_hitters(parent)
    assert hh.n > 0
    child = kv.fork(parent)
    ev.fork(parent, child)
    twin = ev.heavy_hitters(child)
    assert twin is not hh and twin.n == hh.n and np.array_equal(twin.k, hh.k) and np.array_equal(twin.pos, hh.pos)
    twin.k[:] = 0.0
    twin.score[:] = -1
    assert not np.array_equal(hh.k[:, :, : hh.n], twin.k[:, :, : hh.n]) and (hh.score[:, :, : hh.n] >= 0).all()
    assert ev.state(child).start.tolist() == ev.state(parent).start.tolist()
    ev.free(child)
    kv.free(child)
    assert child.id not in ev.heavy and parent.id in ev.heavy
    ev.free(parent)
    kv.free(parent)
    assert not ev.states and not ev.heavy and pool.num_free == pool.num_blocks


def test_offload_free_forgets_the_tier():
    pool, kv = make()
    ev = Evictor(EvictConfig("offload", budget=32, sinks=4), pool)
    parent = new_seq(kv, 16)
    child = kv.fork(parent)
    ev.fork(parent, child)
    parent.tokens += [0] * 8
    append(kv, parent, 8)  # two unshared blocks
    ev.tier.offload(parent, ev.state(parent), 4, pool, pool.stats)
    ev.free(child)
    assert child.id not in ev.states and parent.id in ev.states and len(ev.tier.entries) == 1
    ev.free(parent)
    assert not ev.states and not ev.tier.entries


def test_h2o_decay_fades_scores_per_query():
    pool, kv = make()
    ev = Evictor(EvictConfig("h2o", budget=24, sinks=4, recent=4, decay=0.5), pool)
    seq = new_seq(kv, 8)
    mass = ev.mass_for(seq)
    mass[:, :, 0] = 1.0
    ev.observe(seq, mass, n_queries=1)
    mass = ev.mass_for(seq)
    mass[:, :, 4] = 2.0
    ev.observe(seq, mass, n_queries=2)  # two queries: earlier scores x 0.25
    live = ev.heavy_hitters(seq).live
    np.testing.assert_allclose(live[:, :, 0], 0.25)
    np.testing.assert_allclose(live[:, :, 4], 2.0)
