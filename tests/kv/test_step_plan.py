"""One step planned once and committed as planned (Engine.plan, Engine.step): a plan that
cannot be committed changes nothing, a full disk under offload included; admission uses
check_fits' arithmetic; a step's last tokens can be rolled back (a rejected draft)."""

import errno
import os

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import LocalkvError, PoolExhausted
from localkv.generation import Generation
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler
from localkv.sequence import Sequence
from tiny_model import write_gguf

TOKENS = np.random.default_rng(29).integers(3, 261, 200).tolist()
BS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("plan") / "tiny.gguf", ctx=256)


def engine(path, **kw):
    kw = {"block_size": BS, "prefix_cache": False, "disk_cache": False, "kv_dtype": "f32"} | kw
    return Engine(EngineConfig(model=path, **kw))


def state(eng, *seqs):
    """Everything a failed step must leave as it was."""
    tier = getattr(eng.policy, "tier", None)
    files = [] if tier is None else [os.fstat(f.fileno()).st_size for f in tier.files]  # K's spill file, V's
    return (
        [(list(s.block_table), s.num_computed, s.num_stored, s.hashable) for s in seqs],
        eng.pool.num_free,
        len(eng.stats.events),
        None if tier is None else (dict(tier.entries), tier.capacity, files),
    )


def test_a_step_is_planned_once(tiny, monkeypatch):
    """The policy plans each sequence of a step once: the scheduler's batch, the pool check and
    the commit all read the one StepPlan."""
    eng = engine(tiny, evict=EvictConfig("sliding", budget=48))
    calls, plans, real_plan, real_step = [], [], eng.policy.plan, eng.step
    monkeypatch.setattr(eng.policy, "plan", lambda seq, n: calls.append(seq.id) or real_plan(seq, n))
    monkeypatch.setattr(eng, "step", lambda plan, *a: plans.append(len(plan.seqs)) or real_step(plan, *a))
    sched = Scheduler(eng)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    gens = [Generation(eng, TOKENS[i : i + 40], params, queued=True) for i in (0, 50)]
    for g in gens:
        sched.add(g)
    while not all(g.done for g in gens):
        sched.step()
    assert eng.stats.evictions > 0 and len(calls) == sum(plans)


def test_a_stale_plan_is_refused_and_changes_nothing(tiny):
    eng = engine(tiny)
    seq = Sequence(TOKENS[:20])
    eng.prefill(seq)
    seq.tokens.append(5)
    plan = eng.plan([seq], [1])
    eng.free(seq)  # the pool and the sequence changed since the plan
    before = state(eng, seq)
    with pytest.raises(RuntimeError, match="changed"):
        eng.step(plan)
    assert state(eng, seq) == before


def test_a_full_disk_under_offload_fails_the_step_before_any_sequence_moves(tiny, tmp_path, monkeypatch):
    """A's two victims fit the spill file's free slots, B's two do not: the tier must grow, the
    disk is full, and the step fails with A's blocks still in the pool, not part-way."""
    cfg = EvictConfig(policy="offload", budget=96, sinks=8, recent=16)
    eng = engine(tiny, evict=cfg, offload_dir=tmp_path)
    a, b = Sequence(TOKENS[:40]), Sequence(TOKENS[50:122])
    eng.prefill(a)
    eng.prefill(b)
    a.tokens += [5] * 16
    b.tokens += [6] * 16
    tier = eng.policy.tier
    plan = eng.plan([a, b], [16, 16])
    first, second = (len(r.victims) for r in plan.rooms)
    assert plan.fits and first <= len(tier.free_slots) < first + second

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    before, offloads = state(eng, a, b), eng.stats.offloads
    with pytest.raises(LocalkvError, match="cannot grow the KV offload file.*No space left"):
        eng.step(plan)
    assert state(eng, a, b) == before
    monkeypatch.undo()  # space again: the same plan commits
    eng.step(plan)
    assert eng.stats.offloads == offloads + first + second


def test_admission_counts_blocks_as_check_fits_does(tiny):
    """admits(prompt, n) holds exactly when check_fits finds the free blocks for the prompt and
    one token per branch."""
    eng = engine(tiny, kv_mem=12 * engine(tiny).pool.bytes_per_block)
    hold = Sequence(TOKENS[:40])
    eng.prefill(hold)  # 5 blocks held: 7 free
    assert eng.pool.num_free == 7
    for n_prompt in (1, 7, 8, 23, 24, 47, 55, 56, 90):
        for n in (1, 2, 3, 5):
            try:
                eng.check_fits(n_prompt, 1, n)
                fits = True
            except PoolExhausted:
                fits = False
            assert eng.admits(n_prompt, n) == fits, (n_prompt, n)


# ------------------------------------------------------------ rollback


def test_rollback_drops_a_rejected_draft(tiny):
    """A decoding sequence runs a 12-token draft in one step (blocks 2 and 3 fill and are
    registered) and keeps 2 of it: block 2 is partly filled again and leaves the prefix cache,
    block 3 is freed keeping its hash (its K/V is still that of its tokens), blocks 0 and 1 are
    untouched; the next token's logits are those of the kept tokens alone."""
    eng = engine(tiny, prefix_cache=True)
    seq = Sequence(TOKENS[:21])
    eng.prefill(seq)
    seq.tokens += TOKENS[21:33]
    eng.step(eng.plan([seq], [12]))
    pool, table, hashes = eng.pool, list(seq.block_table), list(seq.block_hashes)
    assert len(table) == 5 and all(pool.blocks[b].hash is not None for b in table[:4])
    eng.rollback(seq, 10)
    assert seq.tokens == TOKENS[:23] and seq.num_computed == seq.num_stored == 23
    assert seq.block_table == table[:3] and seq.block_hashes == hashes[:2]
    assert [pool.blocks[b].hash for b in table[:2]] == hashes[:2] and pool.blocks[table[2]].hash is None
    assert pool.blocks[table[3]].ref_count == 0 and pool.lookup(hashes[3], tuple(TOKENS[24:32])) == table[3]
    pool.check([seq.block_table])
    seq.tokens.append(7)
    got = eng.forward([seq])[0]
    np.testing.assert_allclose(got, engine(tiny).score(TOKENS[:23] + [7])[-1], rtol=1e-4, atol=1e-4)


def test_rollback_into_a_shared_block_leaves_the_other_sequence_alone(tiny):
    eng = engine(tiny, prefix_cache=True)
    parent = Sequence(TOKENS[:33])
    eng.prefill(parent)
    child = eng.fork(parent)
    table, hashes = list(parent.block_table), list(parent.block_hashes)
    eng.rollback(child, 10)  # block 2, shared, is partly filled for the child: it keeps its hash
    assert eng.pool.blocks[table[2]].hash == hashes[2] and child.block_table == table[:3]
    child.tokens.append(7)
    eng.forward([child])  # the child's first write copies block 2
    assert child.cow_copies == 1 and child.block_table[2] != table[2]
    assert (parent.block_table, parent.block_hashes, parent.num_stored) == (table, hashes, 33)
    eng.pool.check([parent.block_table, child.block_table])


def test_rollback_is_refused_where_it_cannot_be_undone(tiny):
    eng = engine(tiny, evict=EvictConfig("sliding", budget=48))
    seq = Sequence(TOKENS[:30])
    eng.prefill(seq)
    before = state(eng, seq)
    with pytest.raises(LocalkvError, match="sliding cannot drop tokens"):
        eng.rollback(seq, 3)
    assert state(eng, seq) == before and len(seq.tokens) == 30
    seq.tokens.append(5)  # pending: not a computed tail
    with pytest.raises(RuntimeError, match="bug in the caller's logic"):
        engine(tiny).rollback(seq, 1)
