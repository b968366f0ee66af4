"""Eviction policies wired into the engine: bounded memory, runs past the context, clear stops."""

from dataclasses import replace

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import BudgetReached, LocalkvError, PoolExhausted
from localkv.generation import Generation
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.sequence import Sequence
from tiny_model import write_gguf

PROMPT = list(map(int, np.random.default_rng(11).integers(3, 261, 40)))
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ev") / "tiny.gguf", ctx=128)


def engine(path, policy="none", budget=None, **kw):
    return Engine(
        EngineConfig(
            model=path, block_size=8, prefix_cache=False, evict=EvictConfig(policy=policy, budget=budget), **kw
        )
    )


@pytest.mark.parametrize("policy", ["sliding", "h2o", "offload"])
def test_budget_holds_and_generation_runs_past_the_context(tiny, policy):
    eng = engine(tiny, policy, budget=48)
    r = Generation(eng, PROMPT, replace(GREEDY, max_tokens=200, ignore_eos=True)).run()
    assert r.completion_tokens == 200 and r.finish_reason == "length"  # 240 tokens > 128 context
    assert r.peak_active_tokens <= 48
    moved = eng.stats.evictions + eng.stats.offloads
    assert moved >= (240 - 48) // 8 - 1
    kinds = {e.kind for e in eng.stats.events}
    assert kinds >= ({"offload"} if policy == "offload" else {"evict"})
    assert eng.pool.num_free == eng.pool.num_blocks  # everything released, offload tier included


def test_policy_changes_nothing_while_the_budget_is_not_reached(tiny):
    ref = Generation(engine(tiny), PROMPT, replace(GREEDY, max_tokens=30, ignore_eos=True)).run().tokens
    for policy in ("sliding", "h2o", "offload"):
        assert (
            Generation(engine(tiny, policy, budget=96), PROMPT, replace(GREEDY, max_tokens=30, ignore_eos=True))
            .run()
            .tokens
            == ref
        )


def test_offload_reads_back_what_it_moved_out(tiny):
    """Offload attends to every offloaded block while they fit the recall slots: the logits
    equal the full cache's, though the pool held at most 4 blocks of the sequence."""
    tokens = list(map(int, np.random.default_rng(5).integers(3, 261, 90)))
    full = engine(tiny, kv_dtype="f32").score(tokens)  # f32 K/V: the two must agree to float rounding
    cfg = EvictConfig(policy="offload", budget=96, sinks=8, recent=16)  # 12 blocks: 4 resident, 8 recall slots
    eng = Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False, evict=cfg, kv_dtype="f32"))
    got = eng.score(tokens)
    assert eng.stats.offloads >= 7 and eng.stats.recalls >= 7 and eng.stats.evictions == 0
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.policy.tier.entries


def test_h2o_attends_to_its_heavy_hitters(tiny):
    """While the heavy-hitter slots can hold every token that left the table, h2o loses
    nothing: the logits equal the full cache's, though the pool held at most 4 blocks."""
    tokens = list(map(int, np.random.default_rng(6).integers(3, 261, 90)))
    full = engine(tiny, kv_dtype="f32").score(tokens)  # f32 K/V: the two must agree to float rounding
    cfg = EvictConfig(policy="h2o", budget=96, sinks=8, recent=16)  # 12 blocks: 4 resident, 64 heavy slots
    eng = Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False, evict=cfg, kv_dtype="f32"))
    seq_peak = []
    real_step = eng.step

    def step(plan, *a, **kw):
        out = real_step(plan, *a, **kw)
        seq = plan.seqs[0]
        seq_peak.append((len(seq.block_table), eng.policy.active_tokens(seq)))
        return out

    eng.step = step
    got = eng.score(tokens)
    assert eng.stats.evictions >= 7 and max(b for b, _ in seq_peak) <= 4 and max(a for _, a in seq_peak) <= 96
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.policy.seqs


def test_policy_none_stops_with_a_clear_reason(tiny):
    eng = engine(tiny, "none", budget=48)
    r = Generation(eng, PROMPT, replace(GREEDY, max_tokens=50, ignore_eos=True)).run()
    assert r.finish_reason == "kv_budget" and "budget of 48" in r.stop_detail
    assert r.prompt_tokens + r.completion_tokens <= 49
    with pytest.raises(BudgetReached, match="more than the KV budget"):
        Generation(eng, PROMPT * 2, replace(GREEDY, max_tokens=5))


def test_shared_blocks_are_never_evicted_from_under_a_fork(tiny):
    eng = engine(tiny, "sliding", budget=48)
    # the 40-token prompt is shared by both branches: when the budget is full, nothing may go, so
    # the first branch to need room stops; its blocks freed, the other's are its own to evict
    r = Generation(eng, PROMPT, replace(GREEDY, max_tokens=30, ignore_eos=True), n=2).run()
    first, second = r.branches
    assert first.finish_reason == "kv_budget" and "shared" in first.stop_detail
    assert second.finish_reason == "length" and eng.stats.evictions > 0
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_step_that_fails_the_pool_check_changes_nothing(tiny):
    """sliding, budget 48, blocks of 16, a pool of 4 blocks: A (48 tokens) must drop a block
    to take one more token, B (10 tokens) needs a second block for 16 more. One block would be
    free after A's eviction, two are needed: the step fails before A loses anything."""
    per_block = 2 * Engine(EngineConfig(model=tiny, block_size=16, prefix_cache=False)).pool.k[:, 0].nbytes
    cfg = EngineConfig(
        model=tiny, block_size=16, kv_mem=4 * per_block, prefix_cache=False, evict=EvictConfig("sliding", budget=48)
    )
    eng = Engine(cfg)
    tokens = PROMPT + PROMPT
    a, b = Sequence(tokens[:48]), Sequence(tokens[:10])
    eng.prefill(a)
    eng.prefill(b)
    assert eng.pool.num_free == 0 and eng.policy.chunk_limit() == 16
    a.tokens.append(5)
    b.tokens += tokens[10:26]
    table = list(a.block_table)
    n_events = len(eng.stats.events)
    with pytest.raises(PoolExhausted, match="needs 2 blocks, 1 are free"):
        eng.forward([a, b])
    assert (a.block_table, a.num_stored, a.num_computed, a.hashable) == (table, 48, 48, True)
    assert (len(b.block_table), b.num_stored) == (1, 10)
    assert eng.stats.evictions == 0 and len(eng.stats.events) == n_events and eng.pool.num_free == 0
    eng.free(b)  # with B gone, the same step for A alone runs: it evicts one block and appends
    eng.forward([a])
    assert (len(a.block_table), a.num_stored, a.hashable, eng.stats.evictions) == (3, 33, False, 1)


@pytest.mark.parametrize(
    "cfg,msg",
    [
        (EvictConfig(policy="lru", budget=64), "unknown"),
        (EvictConfig(policy="sliding", budget=8), "budget"),
    ],
)
def test_bad_policy_settings_fail_before_generation(tiny, cfg, msg):
    with pytest.raises(LocalkvError, match=msg):
        Engine(EngineConfig(model=tiny, block_size=8, evict=cfg))


def test_unwritable_offload_dir(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LocalkvError):
        Engine(
            EngineConfig(
                model=tiny, block_size=8, evict=EvictConfig(policy="offload", budget=64), offload_dir=blocker / "sub"
            )
        )
