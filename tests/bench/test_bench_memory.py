"""The memory suite's allocator simulation: hand-computed cases and invariants (no model)."""

import pytest

from localkv.bench import memory as bm
from localkv.errors import LocalkvError

R = bm.Request


def test_paged_utilization_on_a_hand_made_case():
    # blocks of 4 in 16 slots; two requests of prompt 3 + output 2.
    # step 1: both admitted, 3 tokens each in one block each -> 6 of 8 slots hold tokens
    # step 2: 4 tokens each, same blocks                     -> 8 of 8
    # step 3: 5th token takes a second block, both finish and free -> 0 of 0
    res = bm.simulate(bm.PagedMemory(16, 4), [R(0, 3, 2), R(1, 3, 2)])
    assert (res.steps, res.tokens_stored, res.slots_reserved) == (3, 14, 16)
    assert res.utilization == pytest.approx(14 / 16) and res.internal_frag == pytest.approx(2 / 16)
    assert (res.reserved_later, res.never_used, res.external_frag) == (2, 0, 0.0)  # the free 4th slot at step 1
    assert (res.peak_batch, res.finished, res.preemptions) == (2, 2, 0)


def test_contiguous_reservation_math():
    # the same two requests, each reserving max_len 8 slots for its whole life
    res = bm.simulate(bm.ContiguousMemory(16, 8), [R(0, 3, 2), R(1, 3, 2)])
    assert (res.tokens_stored, res.slots_reserved) == (14, 32)  # (6 + 8) of (16 + 16)
    assert res.utilization == pytest.approx(14 / 32)
    # for later: (8-slot reservation, final 5): step 1 has 2 each to come, step 2 one each; never: 3 each per step
    assert (res.reserved_later, res.never_used) == (6, 12)
    assert res.tokens_stored + res.reserved_later + res.never_used == res.slots_reserved


def test_contiguous_external_fragmentation():
    # 20 slots, reservations of 8: two fit, the 4 left over cannot serve the third request while it waits
    res = bm.simulate(bm.ContiguousMemory(20, 8), [R(i, 3, 2) for i in range(3)])
    assert res.waiting_steps > 0 and res.external_frag == pytest.approx(4 / 20)
    assert res.mean_batch == 2 and res.finished == 3


def test_pow2_and_exact_reserve_less():
    r = R(0, 100, 30)
    assert bm.ContiguousMemory(4096, 2048, "max").size_for(r) == 2048
    assert bm.ContiguousMemory(4096, 2048, "pow2").size_for(r) == 256
    assert bm.ContiguousMemory(4096, 2048, "exact").size_for(r) == 130


def test_first_fit_coalesces_free_ranges():
    mem = bm.ContiguousMemory(40, 40, "exact")
    reqs = [R(i, 5, 5) for i in range(4)]  # 10 slots each: fills the arena
    assert all(mem.admit(r, r.prompt) for r in reqs) and not mem.admit(R(9, 1, 1), 1)
    assert [mem.held[i][0] for i in range(4)] == [0, 10, 20, 30]
    mem.free(reqs[1])
    mem.free(reqs[2])
    assert mem.gaps == [[10, 20]]  # neighbours merged
    assert mem.admit(R(5, 10, 10), 10) and mem.held[5] == (10, 20)
    for r in (reqs[0], reqs[3], R(5, 10, 10)):
        mem.free(r)
    assert mem.gaps == [[0, 40]] and mem.reserved() == 0


def _cfg(**kw):
    base = dict(
        n_requests=80,
        seed=3,
        max_len=256,
        prompt_range=(4, 128),
        output_range=(4, 128),
        arena_slots=1024,
        block_size=16,
    )
    return bm.MemoryConfig(**(base | kw))


def test_workload_is_seeded_and_bounded():
    cfg = _cfg()
    a, b = bm.make_workload(cfg), bm.make_workload(cfg)
    assert a == b and a != bm.make_workload(_cfg(seed=4))
    assert all(4 <= r.prompt <= 128 and 1 <= r.output <= 128 and r.final <= 256 for r in a)
    capped = bm.make_workload(_cfg(max_len=64))
    assert all(r.final <= 64 and r.prompt <= 63 for r in capped)


def test_paged_pool_invariants_every_step_and_preemption():
    cfg = _cfg(arena_slots=512)  # small: forces preemptions
    reqs = bm.make_workload(cfg)
    mem = bm.PagedMemory(cfg.arena_slots, cfg.block_size)

    def check(m, running):
        m.pool.check(m.tables())
        assert m.reserved() == sum(m.reserved_by(r) for r, _ in running)
        assert all(m.reserved_by(r) == -(-s // m.bs) * m.bs for r, s in running)  # a block only when full

    res = bm.simulate(mem, reqs, check=check)
    assert res.finished == len(reqs) and res.preemptions > 0 and res.recomputed_tokens > 0
    assert mem.pool.num_free == mem.pool.num_blocks and not mem.seqs
    assert res.tokens_stored + res.reserved_later + res.never_used == res.slots_reserved
    assert res.peak_reserved <= cfg.arena_slots


def test_run_paged_beats_contiguous_on_the_same_memory():
    reqs, results = bm.run(_cfg())
    names = [r.allocator for r in results]
    assert names == ["paged", "contiguous", "contiguous-pow2", "contiguous-exact"]
    paged, contig = results[0], results[1]
    assert all(r.finished == len(reqs) for r in results)
    assert paged.utilization > contig.utilization and paged.mean_batch > contig.mean_batch
    assert paged.external_frag == 0
    assert contig.peak_batch == 1024 // 256
    row = paged.row()
    assert {
        "utilization",
        "internal_frag",
        "reserved_for_later",
        "never_used",
        "external_frag",
        "mean_batch",
        "peak_batch",
        "preemptions",
    } <= row.keys()
    assert len(paged.series["step"]) == len(paged.series["reserved"]) <= 2000


def test_arena_from_kv_mem():
    assert bm.arena_slots(1 << 30) == 23296  # 1GiB of SmolLM2-135M fp32 K/V, whole 16-token blocks
    assert bm.arena_slots(1 << 30, 32) % 32 == 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_requests=0),
        dict(block_size=12),
        dict(arena_slots=100),
        dict(prompt_range=(0, 10)),
        dict(output_range=(9, 3)),
    ],
)
def test_bad_configs(kw):
    with pytest.raises(LocalkvError):
        _cfg(**kw).validate()


def test_each_kv_format_fills_the_same_memory_with_more_requests():
    """The per-format table: SmolLM2's bytes per token in each layout, the tokens the same memory
    holds, and the paged pool running more requests at once (and preempting less) as they shrink."""
    from localkv.bench import memory_suite
    from localkv.bench.options import Options

    rep = memory_suite.run(Options(quick=True))
    ((name, _, rows),) = rep.more
    by = {r["kv_dtype"]: r for r in rows}
    assert [by[d]["bytes_per_token"] for d in ("f16", "q8_0", "q4_0", "q8_0:q4_0")] == [23040, 12240, 6480, 9360]
    assert by["f16"]["arena_slots"] == 4096 and by["q8_0"]["arena_slots"] == 4096 * 23040 // 12240 // 16 * 16
    assert by["q8_0"]["tokens_per_gib"] == (1 << 30) // 12240 // 16 * 16
    assert by["f16"]["mean_batch"] < by["q8_0"]["mean_batch"] <= by["q4_0"]["mean_batch"]  # quick: 64 requests in all
    assert by["q8_0"]["preemptions"] <= by["f16"]["preemptions"]
    assert rep.targets[-1].name == "tokens in the same pool, q8_0 vs f16 K/V" and rep.targets[-1].ok is None
