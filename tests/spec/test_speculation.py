"""Speculative decoding changes how many tokens a pass yields, never the text: greedy output with
drafts verified equals the output without, token for token, for every architecture, forks, the
scheduler's mixed batches, a grammar and stop strings; the pool is exact after every rollback.

Random tiny models tend to repeat one token, which prompt lookup drafts perfectly; an oracle
drafter (the reference continuation, cut and corrupted at random) exercises every accept length,
rejection at every position included.
"""

from dataclasses import replace

import numpy as np
import pytest
from test_one_answer import MODELS, models  # noqa: F401 (a fixture)
from test_scheduler import drain

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation, _history
from localkv.kv.evict import EvictConfig
from localkv.sampling import Constraint, SamplingParams
from localkv.scheduler import Scheduler
from localkv.spec.control import PassCost, Speculator
from localkv.spec.ngram import NgramIndex

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
RNG = np.random.default_rng(31)
BASE = RNG.integers(3, 261, 48).tolist()
PROMPT = BASE + RNG.integers(3, 261, 20).tolist() + BASE[:24]  # its end repeats its start: lookup drafts


def engine(model, **kw) -> Engine:
    """An engine of one of test_one_answer's models (a path and its K/V format)."""
    kw.setdefault("kv_dtype", model.kv_dtype)
    kw.setdefault("disk_cache", False)
    kw.setdefault("ctx", 512)
    kw.setdefault("block_size", 8)
    return Engine(EngineConfig(model=model.path, threads=2, **kw))


def oracle(monkeypatch, want: dict[tuple, list[int]], seed: int = 0):
    """Drafts from the reference continuations `want` (the prompt's tuple -> prompt + its tokens):
    a random length, corrupted at a random position half the time."""
    rng = np.random.default_rng(seed)
    calls = []

    def propose(self, tokens, limit, siblings=(), decoding=1):
        full = next((w for w in want.values() if w[: len(tokens)] == tokens), None)
        if full is None:  # a sampled reply: random drafts
            full = tokens + rng.integers(3, 261, limit).tolist()
        out = full[len(tokens) : len(tokens) + int(rng.integers(0, limit + 1))]
        if out and rng.random() < 0.5:
            out[int(rng.integers(len(out)))] = int(rng.integers(3, 261))
        calls.append(len(out))
        return out

    monkeypatch.setattr(Speculator, "propose", propose)
    return calls


def run(eng: Engine, prompt=PROMPT, params=GREEDY, n: int = 1):
    r = Generation(eng, prompt, params, n).run()
    eng.pool.check([])
    if eng.pool.num_free != eng.pool.num_blocks:
        pytest.fail("blocks leaked")
    return r


def tokens(r) -> list[list[int]]:
    return [b.tokens for b in r.branches]


def mixed_requests():
    """The scheduler tests' requests: (prompts, params) of four greedy ones."""
    prompts = [PROMPT, PROMPT[10:], BASE * 2, RNG.integers(3, 261, 30).tolist()]
    return prompts, [GREEDY, replace(GREEDY, max_tokens=9), replace(GREEDY, max_tokens=31), GREEDY]


def run_mixed(eng, prompts, params) -> list:
    """Those requests, a 2-branch fork and a sampled one, through one Scheduler (token budget
    40) to the end: the Generations."""
    sched = Scheduler(eng, token_budget=40)
    gens = [Generation(eng, p, q, queued=True) for p, q in zip(prompts, params)]
    gens.append(Generation(eng, PROMPT, GREEDY, n=2, queued=True))
    gens.append(Generation(eng, BASE * 2, replace(GREEDY, temperature=0.9, seed=5), queued=True))
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    return gens


@pytest.mark.parametrize("name", MODELS)
def test_greedy_text_is_the_same_with_speculation(models, name, monkeypatch):  # noqa: F811
    """Every architecture: prompt lookup and the oracle's random accept lengths give the text of
    plain decoding (one answer per prompt: a verified row is the row a one-token step gives)."""
    path = models(name)
    want = run(engine(path))
    looked = run(engine(path, spec="ngram"))
    assert tokens(looked) == tokens(want), f"{name}: prompt lookup"
    assert looked.speculation()["drafted"] > 0
    calls = oracle(monkeypatch, {0: PROMPT + want.tokens})
    drafted = run(engine(path, spec="ngram", spec_max=5))
    assert tokens(drafted) == tokens(want), f"{name}: oracle drafts"
    s = drafted.speculation()
    assert 0 < s["accepted"] < s["drafted"] and max(calls) > 1


def test_sampled_text_is_the_same_with_prompt_lookup_drafts_of_any_length(models, monkeypatch):  # noqa: F811
    """A seeded, sampled reply with penalties: each verified position draws its token as a plain
    step does, so random drafts of random lengths (what the measured pass costs make of a draft
    varies with the machine's load) leave the text as it was; some are accepted."""
    path = models("llama-Q4_1")
    for seed in range(4):  # the test model's logits lie far apart: at 60 its draws leave the argmax
        params = replace(GREEDY, temperature=60.0, top_k=40, repeat_penalty=1.1, max_tokens=48, seed=seed)
        want = run(engine(path), params=params)
        monkeypatch.undo()
        oracle(monkeypatch, {0: PROMPT + want.tokens}, seed=seed)
        got = run(engine(path, spec="ngram", spec_max=6), params=params)
        assert tokens(got) == tokens(want), f"seed {seed}"
        s = got.speculation()
        assert 0 < s["accepted"] < s["drafted"]


def test_forked_branches_speculate_each_on_its_own(models, monkeypatch):  # noqa: F811
    path = models("llama-Q4_1")
    want = run(engine(path), n=3)
    oracle(monkeypatch, {0: PROMPT + want.tokens}, seed=1)
    got = run(engine(path, spec="ngram"), n=3)
    assert tokens(got) == tokens(want)
    assert all(b.spec.drafted > 0 for b in got.branches)


def test_the_scheduler_mixes_speculating_and_plain_requests(models, monkeypatch):  # noqa: F811
    """Greedy requests of several lengths, a fork and a sampled one, through one scheduler with
    a small token budget: each greedy one gets its text alone without speculation, drafts were
    verified, and every block comes back."""
    path = models("llama-Q4_1")
    prompts, params = mixed_requests()
    alone = [run(engine(path), p, q) for p, q in zip(prompts, params)]
    oracle(monkeypatch, {i: p + a.tokens for i, (p, a) in enumerate(zip(prompts, alone))}, seed=4)
    eng = engine(path, spec="ngram", prefill_chunk=32)
    gens = run_mixed(eng, prompts, params)
    for i, (g, a) in enumerate(zip(gens, alone)):
        assert g.result.tokens == a.tokens, f"request {i}"
    assert tokens(gens[4].result) == [alone[0].tokens] * 2
    assert eng.stats.drafted > eng.stats.accepted > 0
    eng.pool.check([])
    assert eng.pool.num_free == eng.pool.num_blocks


def test_dry_reads_only_the_verified_history_so_speculation_keeps_the_text(models, monkeypatch):  # noqa: F811
    """DRY's penalty at a position depends on the tokens picked before it only: greedy text with
    DRY on is the same with prompt lookup and with the oracle's drafts, rejected at any position."""
    path = models("llama-Q4_1")
    params = replace(GREEDY, max_tokens=40, dry_multiplier=0.8, dry_allowed_length=1)
    want = run(engine(path), params=params)
    assert want.tokens != run(engine(path), params=replace(params, dry_multiplier=0)).tokens  # DRY bites
    assert tokens(run(engine(path, spec="ngram"), params=params)) == tokens(want)
    oracle(monkeypatch, {0: PROMPT + want.tokens}, seed=7)
    got = run(engine(path, spec="ngram", spec_max=5), params=params)
    assert tokens(got) == tokens(want)
    s = got.speculation()
    assert 0 < s["accepted"] < s["drafted"]


def test_a_verified_positions_history_reaches_as_far_back_as_dry_looks():
    toks = list(range(200))
    dry = replace(GREEDY, dry_multiplier=0.8)
    assert _history(toks, 150, dry) == toks[:150]  # DRY's default window: the whole context
    assert _history(toks, 150, replace(dry, dry_penalty_last_n=100, repeat_penalty=1.1)) == toks[50:150]
    assert _history(toks, 150, GREEDY) == ()


def test_a_grammar_sees_only_accepted_tokens(models, monkeypatch):  # noqa: F811
    """A constrained reply: the oracle's corrupted drafts are rejected by the mask or the argmax;
    the text equals plain constrained decoding and matches the grammar."""
    path = models("llama-Q4_1")
    params = SamplingParams(temperature=0, max_tokens=40, constraint=Constraint("regex", "[a-f]{3,30}"))
    want = run(engine(path), params=params)
    oracle(monkeypatch, {0: PROMPT + want.tokens}, seed=2)
    got = run(engine(path, spec="ngram"), params=params)
    assert got.text == want.text and got.tokens == want.tokens
    assert got.speculation()["drafted"] > 0


def test_stop_strings_end_a_speculating_reply_where_they_end_a_plain_one(models, monkeypatch):  # noqa: F811
    path = models("llama-Q4_1")
    plain = run(engine(path))
    eng = engine(path)
    stop = eng.tokenizer.decode(plain.tokens[5:7])  # text that first appears mid-reply
    params = replace(GREEDY, stop=(stop,))
    want = run(eng, params=params)
    oracle(monkeypatch, {0: PROMPT + plain.tokens}, seed=3)
    got = run(engine(path, spec="ngram"), params=params)
    assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, "stop")


def test_max_tokens_and_the_end_token_cut_a_draft(models, monkeypatch):  # noqa: F811
    """A draft never runs a branch past max_tokens; an end token inside an accepted draft ends it."""
    path = models("llama-Q4_1")
    params = replace(GREEDY, max_tokens=7)
    want = run(engine(path), params=params)
    oracle(monkeypatch, {0: PROMPT + want.tokens + [0] * 20})
    got = run(engine(path, spec="ngram"), params=params)
    assert got.tokens == want.tokens and got.finish_reason == "length"
    eng = engine(path, spec="ngram")
    stop = next(iter(eng.tokenizer.stop_ids))
    monkeypatch.setattr(Speculator, "propose", lambda self, toks, limit, siblings=(), decoding=1: [stop] * limit)
    ended = run(eng, params=replace(GREEDY, ignore_eos=False))
    assert ended.finish_reason in ("stop", "length")


def test_a_policy_that_cannot_roll_back_turns_speculation_off(models):  # noqa: F811
    path = models("llama-Q4_1")
    eng = engine(path, spec="ngram", evict=EvictConfig(policy="sliding", budget=64, sinks=8))
    r = run(eng)
    assert r.spec == "off" and "--evict sliding" in r.spec_note
    assert r.speculation()["drafted"] == 0


def test_a_pool_too_small_for_the_drafts_drops_them_before_preempting(models, monkeypatch):  # noqa: F811
    """Requests that outgrow a small pool: drafts go first, then the newest request is preempted
    and recomputed; every greedy text is still its text alone without speculation."""
    path = models("llama-Q4_1")
    prompts = [RNG.integers(3, 261, n).tolist() for n in (120, 100, 90)]
    params = replace(GREEDY, max_tokens=40)
    alone = [run(engine(path), p, params) for p in prompts]
    oracle(monkeypatch, {i: p + a.tokens for i, (p, a) in enumerate(zip(prompts, alone))}, seed=5)
    probe = engine(path)
    per_block = probe.kv_bytes_per_token * probe.block_size
    eng = engine(path, spec="ngram", prefix_cache=False, kv_mem=48 * per_block, ctx=256)
    sched = Scheduler(eng)
    batches, batch, preempt = [], sched._batch, sched._preempt_newest
    monkeypatch.setattr(sched, "_batch", lambda undrafted: batches.append(batch(undrafted)) or batches[-1])

    def preempt_without_drafts(keep):
        assert not any(batches[-1][3]), "preempted while the batch still had drafts"
        return preempt(keep)

    monkeypatch.setattr(sched, "_preempt_newest", preempt_without_drafts)
    gens = [Generation(eng, p, params, queued=True) for p in prompts]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    assert sched.preemptions > 0 and eng.stats.drafted > 0
    for i, (g, a) in enumerate(zip(gens, alone)):
        assert g.result.tokens == a.tokens, f"request {i}"
    eng.pool.check([])
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_kv_budget_ends_a_speculating_reply_at_the_same_token(models, monkeypatch):  # noqa: F811
    """Policy none with a budget: a draft that would pass it is dropped, not the branch ended."""
    path = models("llama-Q4_1")
    budget = EvictConfig(policy="none", budget=len(PROMPT) + 13)
    params = replace(GREEDY, max_tokens=40)
    want = run(engine(path, evict=budget), params=params)
    assert want.finish_reason == "kv_budget"
    oracle(monkeypatch, {0: PROMPT + want.tokens + [7] * 40}, seed=6)
    got = run(engine(path, evict=budget, spec="ngram"), params=params)
    assert (got.tokens, got.finish_reason) == (want.tokens, "kv_budget")
    assert got.speculation()["drafted"] > 0


def test_each_branch_of_a_fork_drafts_from_its_siblings_too(models, monkeypatch):  # noqa: F811
    path = models("llama-Q4_1")
    seen, draft = [], NgramIndex.draft
    monkeypatch.setattr(
        NgramIndex, "draft", lambda self, toks, k, others=(): seen.append(len(others)) or draft(self, toks, k, others)
    )
    monkeypatch.setattr(PassCost, "best", lambda self, k, accept, decoding=1: k)  # every draft found, drafted
    sampled = replace(GREEDY, temperature=0.9, seed=3)
    r = run(engine(path, spec="ngram"), params=sampled, n=3)
    assert seen and set(seen) == {2} and r.speculation()["drafted"] > 0


def test_the_draft_cap_is_the_modes_unless_set(models):  # noqa: F811
    """--spec-max 0 (the default) is 15 under prompt lookup on greedy text, a verify pass of one
    16-row block of the weight kernel (PassCost then cuts each draft to what pays), and 8 on
    sampled text and with a draft model; a value given is kept."""
    from localkv.sampling import Sampler
    from localkv.spec.control import for_branch, k_max

    assert [k_max(0, "ngram"), k_max(0, "ngram", greedy=False), k_max(0, "draft"), k_max(5, "draft")] == [15, 8, 8, 5]
    eng = engine(models("llama-Q4_1"), spec="ngram")
    for t, want in ((0.0, 15), (0.8, 8)):
        sampler = Sampler(SamplingParams(temperature=t, seed=1))
        assert for_branch("ngram", eng, sampler, frozenset(), 4).k_max == want
