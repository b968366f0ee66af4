"""The KV policies (localkv.kv.evict) on a small synthetic pool (no model)."""

import dataclasses

import numpy as np
import pytest

from localkv.backends.cpu import paged_attention
from localkv.errors import BudgetReached, LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.kv.evict import POLICIES, AttendExtras, EvictConfig, NoPolicy, RoomPlan, make_policy
from localkv.kv.evict.h2o import H2OPolicy
from localkv.kv.evict.offload import OffloadPolicy, OffloadTier, quest_scores
from localkv.kv.evict.window import SlidingPolicy, TablePositions, choose_victims, ref_counts
from localkv.sequence import HOLE, Sequence, extra_entry

BS, LAYERS, KVH, HEADS, HD = 4, 2, 2, 4, 8


def make(num_blocks=64, block_size=BS):
    pool = BlockPool(n_layers=LAYERS, num_blocks=num_blocks, block_size=block_size, n_kv_heads=KVH, head_dim=HD)
    return pool, KVManager(pool)


def policy(cfg, pool, **kw):
    return make_policy(cfg, pool, pool.stats, **kw)


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


def make_room(pol, seq, n):
    """What the engine does before appending n tokens: plan, then commit."""
    plan = pol.plan(seq, n)
    pol.make_room(seq, plan)
    return plan


def positions_held(pool, seq):
    """The first position each table entry holds, read back from the keys themselves."""
    return [int(pool.k[0, b, 0, 0, 0]) for b in seq.block_table]


def events(pool, kind):
    return [e for e in pool.stats.events if e.kind == kind]


def snapshot(pool, *seqs):
    """Everything a failed step must leave as it was."""
    return (
        [(list(s.block_table), s.num_stored, s.num_computed, s.hashable) for s in seqs],
        pool.num_free,
        len(pool.stats.events),
        pool.stats.evictions,
        pool.stats.offloads,
    )


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
        policy(EvictConfig("LRU", 64), pool)
    # the boundaries themselves are valid
    cfg = EvictConfig("sliding", budget=8, sinks=4)
    assert cfg.validate(BS) is cfg
    EvictConfig().validate(BS)
    EvictConfig("h2o", budget=16, sinks=4, recent=8).validate(BS)
    EvictConfig("h2o", budget=8, sinks=0, recent=0).validate(BS)


def test_config_is_frozen():
    cfg = EvictConfig("sliding", budget=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 32
    assert dataclasses.replace(cfg, budget=32).budget == 32 and cfg.budget == 64


def valid_configs():
    for policy_ in ("sliding", "h2o", "offload"):
        for bs in (4, 16):
            for budget in range(2 * bs, 40 * bs, 3):
                for sinks in (0, 1, 4, bs + 1):
                    for recent in (None, 0, bs - 1, 3 * bs):
                        cfg = EvictConfig(policy_, budget, sinks, recent)
                        try:
                            yield cfg.validate(bs), bs
                        except LocalkvError:
                            pass


def test_budget_split_rules():
    """Resident blocks + side slots = the budget; the side slots are the policy's share of the
    room (none for sliding) and leave the recent window at least one block; a step appends at
    most the recent window (at least one token)."""
    checked = 0
    for cfg, bs in valid_configs():
        side, room, recent = cfg.side_blocks(bs), cfg.room_blocks(bs), cfg.recent_tokens(bs)
        assert cfg.resident_blocks(bs) + side == cfg.budget // bs
        assert cfg.sink_tokens(bs) + (cfg.resident_blocks(bs) - 1) * bs >= recent  # the window fits the pool
        assert cfg.chunk_limit(bs) == max(1, recent)
        if cfg.policy == "sliding":
            assert side == 0
        share = {"sliding": 0.0, "h2o": cfg.heavy_share, "offload": cfg.recall_share}[cfg.policy]
        if cfg.recent is None:
            assert side * bs + recent == room * bs  # the window gets what the side slots leave
            if room:
                assert recent >= bs and side <= share * room
        else:
            assert recent == cfg.recent and (side == 0 or side + -(-recent // bs) == room)
        assert cfg.heavy_tokens(bs) == (side * bs if cfg.policy == "h2o" else 0)
        assert cfg.recall_blocks(bs) == (side if cfg.policy == "offload" else 0)
        checked += 1
    assert checked > 1000
    # the default shares, on one budget: h2o spends half the room on heavy hitters, offload 90% on recall
    assert EvictConfig("h2o", budget=32, sinks=4).side_blocks(BS) == 6 // 2
    assert EvictConfig("offload", budget=64, sinks=4).side_blocks(BS) == int(14 * 0.9)
    assert EvictConfig().chunk_limit(BS) is None


def test_make_policy_gives_each_policy_its_class():
    pool, _ = make()
    classes = {"none": NoPolicy, "sliding": SlidingPolicy, "h2o": H2OPolicy, "offload": OffloadPolicy}
    assert set(classes) == set(POLICIES)
    for name, cls in classes.items():
        pol = policy(EvictConfig(name, budget=32), pool)
        assert type(pol) is cls and pol.config.policy == name
        assert pol.chunk_limit() == EvictConfig(name, budget=32).chunk_limit(BS)


# ------------------------------------------------------------ choosing victims


def test_sliding_keeps_sinks_and_recent_and_drops_oldest_first():
    pool, kv = make()
    pol = policy(EvictConfig("sliding", budget=16, sinks=4), pool)  # recent: 8
    seq = Sequence([])
    for t in range(60):
        seq.tokens.append(t)
        make_room(pol, seq, 1)
        append(kv, seq, 1)
        held = positions_held(pool, seq)
        assert held == pol.state(seq).table.start.tolist() and held == sorted(held)
        assert held[0] == 0  # the sink block
        covered = {p for s in held for p in range(s, s + BS)}
        assert set(range(max(0, seq.num_computed - 8), seq.num_computed)) <= covered  # the recent window
        assert len(seq.block_table) <= 4 and seq.num_stored <= 16
        assert pol.extras(seq) is None
        pool.check([seq.block_table])
    evicted = [e.positions for e in events(pool, "evict")]
    assert evicted == [(s, s + BS) for s in range(4, 4 + BS * len(evicted), BS)]  # oldest first, no gaps
    assert len(evicted) == pool.stats.evictions == 60 // BS - 4
    assert not seq.hashable


def h2o_step(pol, kv, seq, n, rng, mass_fn):
    """plan + make_room + append n tokens + a mass array filled by mass_fn(mass, hh) + after_forward."""
    seq.tokens += [0] * n
    make_room(pol, seq, n)
    append(kv, seq, n, rng)
    ex = pol.extras(seq)
    mass_fn(ex.mass, pol.state(seq).heavy)
    pol.after_forward(seq, ex, 1)


def test_h2o_each_layer_head_keeps_its_own_top_tokens():
    """Per layer and kv head, the tokens with the most attention mass stay (their exact K/V),
    whichever blocks they came from; sinks and the recent window stay in the table."""
    pool, kv = make()
    cfg = EvictConfig("h2o", budget=24, sinks=4, recent=4)  # 6 blocks: sink, recent, spare; 3 blocks = 12 heavy slots
    pol = policy(cfg, pool)
    assert cfg.heavy_tokens(BS) == 12 and cfg.resident_blocks(BS) == 3
    rng = np.random.default_rng(2)
    favourite = {(l, h): {5 + 7 * l + 3 * h, 9 + 11 * l + 5 * h} for l in range(LAYERS) for h in range(KVH)}

    def mass_fn(mass, hh):  # token p gets 0.01 * p, each layer-head's favourites get 10
        base = np.zeros(mass.shape[2] - hh.n)
        first = pol.state(seq).table.start
        ctx = np.concatenate([np.arange(s, s + BS) for s in first])[: len(base)]
        for (l, h), fav in favourite.items():
            mass[l, h, hh.n :] = 0.01 * ctx + np.where(np.isin(ctx, list(fav)), 10.0, 0.0)

    saved_k = {}
    seq = Sequence([])
    for _ in range(60):
        h2o_step(pol, kv, seq, 1, rng, mass_fn)
        for i, b in enumerate(seq.block_table):
            saved_k[int(pol.state(seq).table.start[i])] = pool.k[:, b].copy()
    hh = pol.state(seq).heavy
    assert hh.n == 12 and pol.active_tokens(seq) == seq.num_stored + 12 <= cfg.budget
    assert positions_held(pool, seq)[0] == 0 and len(seq.block_table) <= 3
    for (l, h), fav in favourite.items():
        held = sorted(hh.pos[l, h, : hh.n].tolist())
        assert set(fav) <= set(held)  # the favourites beat later tokens' larger 0.01 * p
        for j in range(hh.n):  # exact K/V of the token each slot claims to hold
            p = int(hh.pos[l, h, j])
            start = p - p % BS
            assert np.array_equal(hh.k[l, h, j], saved_k[start][l, p - start, h])
        k, v = pol.extras(seq).kv(l, None)
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
    pol = policy(EvictConfig("h2o", budget=28, sinks=4, recent=8, decay=1.0), pool)  # plain sums: the reference adds
    cap = pol.config.heavy_tokens(BS)
    assert cap == 12  # 7 blocks: sink, 2 recent, spare, 3 blocks of heavy-hitter slots
    rng = np.random.default_rng(9)
    total = {}  # (l, h, pos) -> accumulated mass
    alive = {(l, h): set() for l in range(LAYERS) for h in range(KVH)}  # reference heavy sets
    seq = Sequence([])

    def mass_fn(mass, hh):
        mass[:] = rng.random(mass.shape)
        first = pol.state(seq).table.start
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
        h2o_step(pol, kv, seq, n, rng, mass_fn)
        hh = pol.state(seq).heavy
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
    table = TablePositions(BS).sync(seq)
    cfg = EvictConfig("sliding", budget=8, sinks=0, recent=0)
    assert choose_victims(table, 3, cfg, ref_counts(seq, pool)) == [0, 1]
    # even when the incoming tokens would fill it and put it wholly behind the recent window
    assert choose_victims(table, 3, cfg, ref_counts(seq, pool), incoming=6) == [0, 1]


def test_shared_blocks_are_never_chosen():
    pool, kv = make()
    parent = new_seq(kv, 12)
    child = kv.fork(parent)  # blocks 0-2 now have ref_count 2
    parent.tokens += [0] * 12
    append(kv, parent, 12)
    table = TablePositions(BS).sync(parent)  # the shared ones are the oldest
    cfg = EvictConfig("h2o", budget=8, sinks=0, recent=4)
    assert choose_victims(table, 5, cfg, ref_counts(parent, pool)) == [3, 4]
    # the child holds only shared blocks: nothing may go, and planning says so
    pol = policy(EvictConfig("h2o", budget=8, sinks=0, recent=0), pool)
    before = snapshot(pool, parent, child)
    with pytest.raises(BudgetReached, match="shared with another sequence"):
        pol.plan(child, 1)
    assert snapshot(pool, parent, child) == before and child.hashable
    pool.check([parent.block_table, child.block_table])


@pytest.mark.parametrize("name", ["sliding", "h2o", "offload"])
def test_a_plan_that_cannot_make_enough_room_changes_nothing(name):
    """Two of the five blocks that would have to go may go (the rest are shared): planning
    raises before anything leaves, instead of evicting two and then giving up."""
    pool, kv = make()
    parent = new_seq(kv, 12)
    child = kv.fork(parent)
    parent.tokens += [0] * 12
    append(kv, parent, 12)  # 6 blocks: 3 shared, 3 its own (the newest in the recent window)
    pol = policy(EvictConfig(name, budget=8, sinks=0, recent=4), pool)
    assert choose_victims(pol.state(parent).table, 5, pol.config, ref_counts(parent, pool), 1) == [3, 4]
    before = snapshot(pool, parent, child)
    with pytest.raises(BudgetReached, match="shared"):
        pol.plan(parent, 1)
    assert snapshot(pool, parent, child) == before
    pool.check([parent.block_table, child.block_table])


def test_planning_changes_nothing_and_committing_frees_exactly_the_victims():
    """The engine's two-sequence step under sliding (budget 48, blocks of 16): A must drop one
    block, B needs one more; with no free block the pool check fails on the plans alone."""
    bs = 16
    pool, kv = make(num_blocks=4, block_size=bs)
    pol = policy(EvictConfig("sliding", budget=48), pool)
    a, b = new_seq(kv, 48), new_seq(kv, 10)  # 3 full blocks, 1 partial: the pool is full
    a.tokens.append(0)
    b.tokens += [0] * 16
    counts = [1, min(16, pol.chunk_limit())]
    before = snapshot(pool, a, b)
    plans = [pol.plan(s, n) for s, n in zip((a, b), counts)]
    assert plans == [RoomPlan([1]), RoomPlan([])] and plans == [pol.plan(s, n) for s, n in zip((a, b), counts)]
    assert snapshot(pool, a, b) == before and a.hashable and not pool.stats.events
    need = sum(kv.need(s, n) for s, n in zip((a, b), counts))
    freed = sum(len(p.victims) for p in plans)
    assert need == 2 and pool.num_free + freed == 1  # the engine raises PoolExhausted here: nothing changed
    # committing A's plan alone frees exactly its victims
    pol.make_room(a, plans[0])
    assert pool.num_free == freed and a.num_stored == 32 and len(events(pool, "evict")) == 1


def test_a_stale_or_foreign_plan_is_a_caller_bug():
    pool, kv = make()
    parent = new_seq(kv, 12)
    child = kv.fork(parent)
    for name in ("sliding", "h2o", "offload"):
        pol = policy(EvictConfig(name, budget=8, sinks=0, recent=0), pool)
        for victims in ([0], [5], [1, 0]):  # shared, past the table, not ascending
            with pytest.raises(RuntimeError, match="bug in the caller's logic"):
                pol.make_room(child, RoomPlan(victims))
    with pytest.raises(RuntimeError, match="bug in the caller's logic"):
        policy(EvictConfig(), pool).make_room(child, RoomPlan([2]))
    pos = TablePositions(BS).sync(parent)
    parent.block_table.pop()
    with pytest.raises(RuntimeError, match="shrank"):
        pos.sync(parent)


def test_policy_none_never_evicts_and_stops_at_its_budget():
    pool, kv = make()
    pol = policy(EvictConfig(), pool)
    seq = Sequence([])
    for t in range(40):
        seq.tokens.append(t)
        assert make_room(pol, seq, 1) == RoomPlan()
        append(kv, seq, 1)
        assert pol.extras(seq) is None and pol.active_tokens(seq) == seq.num_stored
    assert len(seq.block_table) == 10 and not pool.stats.events
    capped = policy(EvictConfig(budget=41), pool)
    assert capped.plan(seq, 1) == RoomPlan()  # exactly at the budget
    with pytest.raises(BudgetReached, match="KV budget of 41 tokens is full.*policy none"):
        capped.plan(seq, 2)


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
    pol = policy(cfg, pool)
    seq, limit = Sequence([]), pol.chunk_limit()
    recent, sinks = cfg.recent_tokens(bs), cfg.sink_tokens(bs)
    while seq.num_computed < 400:
        n = int(rng.integers(1, limit + 1)) if seq.num_computed < 100 else 1  # "prefill" chunks, then decode
        seq.tokens += [0] * n
        free = pool.num_free
        plan = make_room(pol, seq, n)
        assert pool.num_free == free + len(plan.victims)
        slots = kv.append_slots(seq, n)
        pos = np.arange(seq.num_computed - n, seq.num_computed)
        pool.k.reshape(LAYERS, -1, KVH, HD)[:, slots] = rng.standard_normal((LAYERS, n, KVH, HD))
        pool.k.reshape(LAYERS, -1, KVH, HD)[:, slots, :, :1] = pos[None, :, None, None]
        ex = pol.extras(seq)
        if ex is not None and ex.mass is not None:
            ex.mass += rng.random(ex.mass.shape).astype(np.float32)
        pol.after_forward(seq, ex, n)
        assert len(seq.block_table) <= cfg.resident_blocks(bs) <= cfg.budget // bs
        assert pol.active_tokens(seq) <= cfg.budget
        held = positions_held(pool, seq)
        assert held == pol.state(seq).table.start.tolist() == sorted(held)
        assert held[: sinks // bs] == list(range(0, sinks, bs))
        covered = {p for s in held for p in range(s, s + bs)}
        assert set(range(max(0, seq.num_computed - recent), seq.num_computed)) <= covered
        assert seq.num_stored == (len(held) - 1) * bs + (seq.num_computed - held[-1])
        pool.check([seq.block_table])
    gone = pool.stats.evictions + pool.stats.offloads
    assert gone == seq.num_computed // bs - seq.num_stored // bs > 0
    pol.free(seq)
    kv.free(seq)
    assert pool.num_free == pool.num_blocks and not pol.seqs
    assert not isinstance(pol, OffloadPolicy) or not pol.tier.entries


def test_mass_is_per_layer_and_kv_head_and_covers_heavy_hitters():
    """Real attention mass from paged_attention in every layer, heavy hitters included: each
    query hands each query head's unit to the keys of its kv head, in that layer."""
    pool, kv = make()
    pol = policy(EvictConfig("h2o", budget=24, sinks=4, recent=4, decay=1.0), pool)  # no fading: mass is conserved
    rng = np.random.default_rng(1)
    seq = Sequence([])
    queries = 0
    for n in (4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1):  # prefill chunks, then decode: blocks leave the table
        seq.tokens += [0] * n
        make_room(pol, seq, n)
        append(kv, seq, n, rng)
        ex, hh = pol.extras(seq), pol.state(seq).heavy
        assert ex.mass.shape == (LAYERS, KVH, hh.n + seq.num_stored)
        q = rng.standard_normal((n, HEADS, HD)).astype(np.float32)
        for layer in range(LAYERS):
            extra = ex.kv(layer, q) if ex.kv is not None else None
            paged_attention(
                q, pool.k[layer], pool.v[layer], np.asarray(seq.block_table), seq.num_stored, 0.3, ex.mass[layer], extra
            )
        np.testing.assert_allclose(ex.mass.sum(axis=2), n * HEADS // KVH, rtol=1e-5)
        pol.after_forward(seq, ex, n)
        queries += n
    hh = pol.state(seq).heavy
    assert hh.n > 0 and pool.stats.evictions > 0
    # no token was dropped yet (12 heavy slots hold all that left): every unit of mass is on a kept token
    assert hh.n < pol.config.heavy_tokens(BS)
    assert np.isclose(hh.score[:, :, : hh.n].sum() + hh.live.sum(), queries * HEADS * LAYERS)


# ------------------------------------------------------------ offload tier


@pytest.mark.parametrize("spill", [False, True], ids=["ram", "memmap"])
def test_offload_round_trips_k_v_bit_exactly(spill, tmp_path):
    pool, kv = make()
    rng = np.random.default_rng(7)
    seq = new_seq(kv, 24, rng)  # 6 blocks
    table = TablePositions(BS).sync(seq)
    tier = OffloadTier((LAYERS, BS, KVH, HD), pool.k.dtype, tmp_path / "spill" if spill else None, capacity=1)
    saved = {
        start: (pool.k[:, seq.block_table[i]].copy(), pool.v[:, seq.block_table[i]].copy())
        for i, start in ((1, 4), (3, 12))
    }
    bids = [seq.block_table[i] for i in (3, 1)]
    tier.offload(seq, table, 3, pool, pool.stats)
    tier.offload(seq, table, 1, pool, pool.stats)  # grows the tier past its capacity of 1
    assert tier.capacity >= 2 and [s for s, _ in tier.blocks_of(seq.id)] == [4, 12]
    assert positions_held(pool, seq) == table.start.tolist() == [0, 8, 16, 20]
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
    assert pool.stats.offloads == 2 and pool.stats.evictions == 0
    assert tier.nbytes == 2 * sum(a[0].nbytes for a in tier.kv)
    tier.drop(seq.id)
    assert not tier.entries and tier.nbytes == 0 and len(tier.free_slots) == tier.capacity
    if spill:
        assert list((tmp_path / "spill").iterdir()) == []  # the spill file leaves nothing behind
        tier.close()


def test_offloading_a_shared_block_is_a_caller_bug():
    pool, kv = make()
    seq = new_seq(kv, 8)
    kv.fork(seq)
    tier = OffloadTier.for_pool(pool)
    with pytest.raises(RuntimeError, match="shared.*bug in the caller's logic"):
        tier.offload(seq, TablePositions(BS).sync(seq), 0, pool, pool.stats)
    assert len(seq.block_table) == 2 and not tier.entries


def test_unwritable_offload_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(LocalkvError, match="cannot write the KV offload file"):
        OffloadTier((LAYERS, BS, KVH, HD), np.float32, blocker / "spill")
    pool, _ = make()
    with pytest.raises(LocalkvError, match="cannot write the KV offload file"):
        policy(EvictConfig("offload", budget=32), pool, offload_dir=blocker)


def test_quest_bound_is_an_upper_bound_and_tight_for_constant_blocks():
    pool, kv = make()
    rng = np.random.default_rng(3)
    seq = new_seq(kv, 28, rng)
    pool.k[:] *= rng.uniform(0.1, 5, (1, pool.num_blocks, 1, KVH, 1)).astype(np.float32)
    const = seq.block_table[5]
    pool.k[:, const] = rng.standard_normal((LAYERS, 1, KVH, HD))  # every token of this block has the same key
    keys = [pool.k[:, seq.block_table[i]].copy() for i in range(7)]  # [L, bs, kvh, hd]
    table = TablePositions(BS).sync(seq)
    tier = OffloadTier.for_pool(pool)
    for i in range(6, -1, -1):
        tier.offload(seq, table, i, pool, pool.stats)
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
    pol = policy(cfg, pool)
    assert cfg.recall_blocks(BS) == 1 and cfg.resident_blocks(BS) == 4
    seq.tokens.append(0)
    assert make_room(pol, seq, 1) == RoomPlan([1, 2, 3, 4, 5])  # 9 blocks wanted, 4 may stay
    assert [s for s, _ in pol.tier.blocks_of(seq.id)] == [4, 8, 12, 16, 20]
    assert positions_held(pool, seq) == [0, 24, 28]
    ex = pol.extras(seq)
    ret = ex.kv
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
    pol.after_forward(seq, ex, 1)
    assert [e.positions for e in events(pool, "recall")] == [(8, 12), (12, 16)]
    assert pol.active_tokens(seq) == seq.num_stored + BS
    pol.after_forward(seq, pol.extras(seq), 1)  # nothing picked this time (no forward ran): no new events
    assert len(events(pool, "recall")) == 2 and pol.active_tokens(seq) == seq.num_stored


def test_positioned_keys_put_each_recalled_block_where_it_was_computed():
    """The same picks as extra keys, laid out by position per kv head: the pool's blocks at
    theirs, the recalled block (its exact K/V) at its own, holes for the blocks left in the
    tier; the recall events and active tokens as with extra keys."""
    pool, kv = make()
    seq = new_seq(kv, 32)
    pool.k[..., 1:] = 0.0
    pool.k[0, seq.block_table[2], :, :, 1] = 1.0  # layer 0: positions 8-11 align with q
    pool.k[1, seq.block_table[3], :, :, 1] = 1.0  # layer 1: positions 12-15
    saved = {i: (pool.k[:, seq.block_table[i]].copy(), pool.v[:, seq.block_table[i]].copy()) for i in range(8)}
    pol = policy(EvictConfig("offload", budget=20, sinks=4, recent=8, rerank=2), pool)
    seq.tokens.append(0)
    make_room(pol, seq, 1)
    ex = pol.extras(seq)
    q = np.zeros((1, HEADS, HD), np.float32)
    q[..., 1] = 10.0
    for layer, want in ((0, 2), (1, 3)):
        at = ex.positioned(layer, q)
        resident = [seq.block_table[0], *[HOLE] * 5, *seq.block_table[1:]]
        resident[want] = extra_entry(0)
        assert at.n_ctx == 32 and at.tables.tolist() == [resident] * KVH
        k, v = at.extra
        assert k.shape == v.shape == (KVH, 1, BS, HD) and k.dtype == pool.k.dtype
        for h in range(KVH):
            assert np.array_equal(k[h, 0], saved[want][0][layer, :, h])
            assert np.array_equal(v[h, 0], saved[want][1][layer, :, h])
    pol.after_forward(seq, ex, 1)
    assert [e.positions for e in events(pool, "recall")] == [(8, 12), (12, 16)]
    assert pol.active_tokens(seq) == seq.num_stored + BS


def test_positioned_keys_with_every_block_recalled_attend_as_the_whole_table():
    """Recall slots for every offloaded block: paged_attention over the keys by position gives
    what it gave over the whole table before the offload (tests/backends/test_positioned_attention.py:
    with the kernels, the same bits)."""
    pool, kv = make()
    rng = np.random.default_rng(7)
    seq = new_seq(kv, 32, rng)
    full = np.asarray(seq.block_table).copy()
    saved = pool.k[:, full].copy()  # [layers, position block, bs, kvh, hd]
    pol = policy(EvictConfig("offload", budget=52, sinks=4, recent=8), pool)  # 13 blocks: 4 resident, 9 recall
    seq.tokens.append(0)
    make_room(pol, seq, 1)
    assert pool.stats.offloads == 5 and pol.config.recall_blocks(BS) >= 5
    ex = pol.extras(seq)
    q = rng.standard_normal((3, HEADS, HD)).astype(np.float32)  # positions 29-31, in the last block
    for layer in range(LAYERS):
        kl, vl = pool.k[layer], pool.v[layer]
        at = ex.positioned(layer, q)
        assert at.n_ctx == 32 and (at.tables >= 0).sum(axis=1).tolist() == [3] * KVH and HOLE not in at.tables
        for h, j in zip(*np.nonzero(at.tables < HOLE)):
            assert np.array_equal(at.extra[0][h, -2 - at.tables[h, j]], saved[layer, j, :, h])
        got = paged_attention(q, kl, vl, at.tables, at.n_ctx, 0.3, extra=at.extra, head_tables=True)
        np.testing.assert_allclose(got, paged_attention(q, kl, vl, full, 32, 0.3), rtol=1e-5, atol=1e-6)
    pol.after_forward(seq, ex, 3)
    assert len(events(pool, "recall")) == 5


def test_fork_copies_heavy_hitters_and_free_forgets():
    pool, kv = make()
    pol = policy(EvictConfig("h2o", budget=24, sinks=4, recent=4), pool)
    rng = np.random.default_rng(4)
    parent = Sequence([])
    for _ in range(8):
        h2o_step(pol, kv, parent, 4, rng, lambda mass, hh: mass.__iadd__(rng.random(mass.shape)))
    hh = pol.state(parent).heavy
    assert hh.n > 0
    child = kv.fork(parent)
    pol.fork(parent, child)
    twin = pol.state(child).heavy
    assert twin is not hh and twin.n == hh.n and np.array_equal(twin.k, hh.k) and np.array_equal(twin.pos, hh.pos)
    twin.k[:] = 0.0
    twin.score[:] = -1
    assert not np.array_equal(hh.k[:, :, : hh.n], twin.k[:, :, : hh.n]) and (hh.score[:, :, : hh.n] >= 0).all()
    assert pol.state(child).table.start.tolist() == pol.state(parent).table.start.tolist()
    pol.free(child)
    kv.free(child)
    assert child.id not in pol.seqs and parent.id in pol.seqs
    pol.free(parent)
    kv.free(parent)
    assert not pol.seqs and pool.num_free == pool.num_blocks


def test_offload_free_forgets_the_tier():
    pool, kv = make()
    pol = policy(EvictConfig("offload", budget=32, sinks=4), pool)
    parent = new_seq(kv, 16)
    child = kv.fork(parent)
    pol.fork(parent, child)
    parent.tokens += [0] * 8
    append(kv, parent, 8)  # two unshared blocks
    pol.tier.offload(parent, pol.state(parent).table, 4, pool, pool.stats)
    pol.free(child)
    assert child.id not in pol.seqs and parent.id in pol.seqs and len(pol.tier.entries) == 1
    pol.free(parent)
    assert not pol.seqs and not pol.tier.entries


def test_h2o_decay_fades_scores_per_query():
    pool, kv = make()
    pol = policy(EvictConfig("h2o", budget=24, sinks=4, recent=4, decay=0.5), pool)
    seq = new_seq(kv, 8)
    ex = pol.extras(seq)
    ex.mass[:, :, 0] = 1.0
    pol.after_forward(seq, ex, 1)
    ex = pol.extras(seq)
    ex.mass[:, :, 4] = 2.0
    pol.after_forward(seq, ex, 2)  # two queries: earlier scores x 0.25
    live = pol.state(seq).heavy.live
    np.testing.assert_allclose(live[:, :, 0], 0.25)
    np.testing.assert_allclose(live[:, :, 4], 2.0)
    pol.after_forward(seq, AttendExtras(), 1)  # no mass: nothing to fold
    np.testing.assert_allclose(live[:, :, 4], 2.0)
