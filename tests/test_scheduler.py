"""Continuous batching: many requests through one engine give each request the tokens it gets
alone, share the pool, join and leave between steps, and survive a pool that runs dry."""

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler
from tiny_model import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 261, n).tolist() for n in (40, 7, 23, 64, 15)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("sched") / "tiny.gguf", ctx=256)


def engine(path, **kw):
    kw.setdefault("disk_cache", False)
    return Engine(EngineConfig(model=path, block_size=8, **kw))


def drain(sched: Scheduler, gens, max_steps=10_000):
    for _ in range(max_steps):
        if all(g.done for g in gens):
            return
        sched.step()
    raise AssertionError("the scheduler did not finish its requests")


def solo(path, prompt, params=GREEDY, n=1):
    return [b.tokens for b in Generation(engine(path), prompt, params, n).run().branches]


def test_requests_batched_together_get_the_tokens_they_get_alone(tiny):
    eng = engine(tiny)
    sched = Scheduler(eng)
    gens = [Generation(eng, p, GREEDY, queued=True) for p in PROMPTS]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    for g, p in zip(gens, PROMPTS):
        assert g.result.tokens == solo(tiny, p)[0]
    assert eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check([])


def test_a_step_mixes_decodes_with_prompt_chunks(tiny, monkeypatch):
    eng = engine(tiny, prefill_chunk=16)
    steps, step = [], eng.step

    def spy(plan, *a, **k):
        steps.append(list(plan.counts))
        return step(plan, *a, **k)

    monkeypatch.setattr(eng, "step", spy)
    sched = Scheduler(eng)
    first = Generation(eng, PROMPTS[0], GREEDY, queued=True)
    sched.add(first)
    while not first.result.tokens:
        sched.step()
    late = Generation(eng, PROMPTS[3], GREEDY, queued=True)  # joins while the first decodes
    sched.add(late)
    drain(sched, [first, late])
    mixed = [c for c in steps if len(c) == 2 and c[0] == 1 and c[1] > 1]
    assert mixed, f"no step held a decode and a prompt chunk: {steps}"
    assert all(sum(c) <= 16 for c in steps)  # the token budget
    assert late.result.tokens == solo(tiny, PROMPTS[3])[0]


def test_forks_share_the_pool_with_other_requests(tiny):
    eng = engine(tiny)
    sched = Scheduler(eng)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    fork = Generation(eng, PROMPTS[0], params, n=3, queued=True)
    other = Generation(eng, PROMPTS[1], GREEDY, queued=True)
    for g in (fork, other):
        sched.add(g)
    drain(sched, [fork, other])
    assert [b.tokens for b in fork.result.branches] == solo(tiny, PROMPTS[0], params, 3)
    assert other.result.tokens == solo(tiny, PROMPTS[1])[0]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_dry_pool_preempts_the_newest_and_resumes_it(tiny):
    # 20 blocks of 8 tokens: three 64-token prompts with 24 tokens each cannot all be held at once
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # layers, block, kv heads, head dim, fp32; K and V
    eng = engine(tiny, kv_mem=20 * per_block, prefix_cache=False, kv_dtype="f32")
    assert eng.pool.num_blocks == 20
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [RNG.integers(3, 261, 64).tolist() for _ in range(3)]
    sched = Scheduler(eng)
    gens = [Generation(eng, p, params, queued=True) for p in prompts]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    assert sched.preemptions > 0
    for g, p in zip(gens, prompts):
        assert g.result.tokens == solo(tiny, p, params)[0]  # recomputed, never dropped or changed
    assert eng.pool.num_free == eng.pool.num_blocks


def test_cancel_frees_blocks_at_once(tiny):
    eng = engine(tiny)
    sched = Scheduler(eng)
    gens = [Generation(eng, p, SamplingParams(max_tokens=200, ignore_eos=True), queued=True) for p in PROMPTS[:3]]
    for g in gens:
        sched.add(g)
    for _ in range(5):
        sched.step()
    assert eng.pool.num_free < eng.pool.num_blocks
    for g in gens[:2]:
        sched.cancel(g)
    sched.step()
    assert gens[0].done and gens[1].done and gens[0].result.finish_reason == "cancelled"
    assert not gens[2].done
    held = eng.pool.num_blocks - eng.pool.num_free
    assert held == len(gens[2].result.branches[0].seq.block_table)  # only the survivor holds blocks
    drain(sched, gens)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_shared_prompt_is_computed_once(tiny):
    eng = engine(tiny)
    system = RNG.integers(3, 261, 48).tolist()  # six full blocks every request starts with
    sched = Scheduler(eng)
    gens = [Generation(eng, system + [10 + i, 20 + i], GREEDY, queued=True) for i in range(5)]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    assert [g.result.cached_tokens for g in gens[1:]] == [48] * 4


def test_max_seqs_caps_what_runs_at_once(tiny, monkeypatch):
    eng = engine(tiny)
    sched = Scheduler(eng, max_seqs=2)
    widths, step = [], eng.step
    monkeypatch.setattr(eng, "step", lambda plan, *a, **k: widths.append(len(plan.seqs)) or step(plan, *a, **k))
    gens = [Generation(eng, p, GREEDY, queued=True) for p in PROMPTS]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    assert max(widths) == 2 and all(g.result.tokens for g in gens)


def test_requests_on_one_system_prompt_start_decoding_in_one_step(tiny):
    """The first request computes the system prompt's blocks and stops there; the others, which
    waited for those blocks only (not for the first one's own question), then run their
    questions in the same step as the first one's: every request gets its first token at once,
    and decodes from then on in one batch."""
    eng = engine(tiny, prefill_chunk=16)
    system = RNG.integers(3, 261, 40).tolist()  # five full blocks; chunks of 16 would cross them
    prompts = [system + RNG.integers(3, 261, 8).tolist() for _ in range(4)]
    sched = Scheduler(eng, token_budget=64)
    gens = [Generation(eng, p, GREEDY, queued=True) for p in prompts]
    for g in gens:
        sched.add(g)
    first_at = {}
    for step in range(100):
        if all(g.done for g in gens):
            break
        sched.step()
        first_at.update({i: step for i, g in enumerate(gens) if g.result.tokens and i not in first_at})
    assert len(set(first_at.values())) == 1, f"first tokens at steps {first_at}"
    assert [g.result.cached_tokens for g in gens[1:]] == [40] * 3  # the system prompt computed once
    for g, p in zip(gens, prompts):
        assert g.result.tokens == solo(tiny, p)[0]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_decodes_in_a_step_with_a_prompt_chunk_get_the_logits_they_get_alone(tiny):
    """Single-token rows that share a step with another request's prompt chunk run as one batch
    (over their common prefix) while the chunk runs through its own table: the logits are the
    ones each gets in a step of its own."""
    prompt, other = RNG.integers(3, 261, 40).tolist(), RNG.integers(3, 261, 20).tolist()

    def setup():
        eng = engine(tiny, kv_dtype="f32")
        root, _ = eng.open_sequence(prompt)
        eng.prefill(root)
        a, b = eng.fork(root), eng.fork(root)
        a.tokens.append(11)
        b.tokens.append(12)
        c, _ = eng.open_sequence(other)
        return eng, a, b, c

    eng, a, b, c = setup()
    mixed = eng.forward([a, b, c], counts=[1, 1, 20])
    eng, a, b, c = setup()
    alone = np.stack([eng.forward([s], counts=[n])[0] for s, n in ((a, 1), (b, 1), (c, 20))])
    np.testing.assert_allclose(mixed, alone, rtol=1e-4, atol=1e-4)


def test_each_request_reports_its_own_kv_figures_in_a_shared_scheduler(tiny):
    """Two requests in one step loop: each one's peak blocks and copies-on-write are those of its
    own sequences (what it gets alone), not the pool's."""
    eng = engine(tiny, prefix_cache=False)
    sched = Scheduler(eng)
    fork = Generation(eng, PROMPTS[2], GREEDY, n=3, queued=True)  # 23 tokens: 3 branches share the partial block
    lone = Generation(eng, PROMPTS[1], GREEDY, queued=True)
    for g in (fork, lone):
        sched.add(g)
    drain(sched, [fork, lone])
    alone = Generation(engine(tiny, prefix_cache=False), PROMPTS[2], GREEDY, n=3).run()
    assert (fork.result.peak_blocks, fork.result.cow_copies) == (alone.peak_blocks, alone.cow_copies)
    assert fork.result.cow_copies == 2  # the last branch to write holds the block alone
    assert lone.result.cow_copies == 0 and lone.result.peak_blocks == -(-(7 + 12 - 1) // 8)


class FakeRequest:
    """The scheduler's Request protocol and no more: one sequence that appends token 5 until it
    has max_tokens, and a log of what the scheduler did to it."""

    n = 1

    def __init__(self, name: str, engine: Engine, prompt: list[int], max_tokens: int, log: list):
        self.name, self.engine, self.prompt, self.max_tokens, self.log = name, engine, prompt, max_tokens, log
        self.seq, self.generated, self.done = None, [], False

    def admit(self):
        self.log.append(("admit", self.name, self.engine.pool.num_free))
        self.seq, _ = self.engine.open_sequence(self.prompt)
        self.seq.tokens += self.generated  # a preempted request recomputes what it had

    def schedulable(self):
        return [self.seq] if self.seq is not None and self.seq.pending else []

    def prefilling(self):
        return self.seq is not None and self.seq.num_computed < len(self.prompt)

    def prompt_computed(self):
        return min(self.seq.num_computed, len(self.prompt)) if self.seq is not None else 0

    def on_logits(self, rows):
        self.generated.append(5)
        if len(self.generated) == self.max_tokens:
            self.cancel("done")
        else:
            self.seq.tokens.append(5)

    def out_of_budget(self, seq, reason):
        self.cancel("kv_budget")

    def preempt(self):
        self.log.append(("preempt", self.name))
        self.engine.free(self.seq)
        self.seq = None

    def cancel(self, reason):
        self.log.append((reason, self.name))
        if self.seq is not None:
            self.engine.free(self.seq)
        self.seq, self.done = None, True


def test_admission_is_first_come_and_preemption_takes_the_newest(tiny):
    """Four requests of 24 prompt tokens growing to 48 (6 blocks each) in a pool of 14 blocks:
    requests are admitted in arrival order and only while the pool holds their start; when it
    runs short, the newest running request is preempted and goes back to the head of the queue,
    ahead of those that arrived after it. Replayed against a model of that rule."""
    eng = engine(tiny, kv_mem=14 * engine(tiny).pool.bytes_per_block, prefix_cache=False)
    sched, log = Scheduler(eng, max_seqs=3), []
    reqs = [FakeRequest(c, eng, RNG.integers(3, 261, 24).tolist(), 24, log) for c in "ABCD"]
    for r in reqs:
        sched.add(r)
    drain(sched, reqs)
    waiting, running = list("ABCD"), []
    for what, name, *free in log:
        if what == "admit":
            assert name == waiting.pop(0) and (free[0] >= 4 or not running), log  # 24 tokens and the first: 4 blocks
            running.append(name)
        elif what == "preempt":
            assert name == running.pop(), log
            waiting.insert(0, name)
        else:
            running.remove(name)
    assert not waiting and not running and sched.preemptions == sum(w == "preempt" for w, *_ in log) > 0
    assert all(r.generated == [5] * 24 for r in reqs) and eng.pool.num_free == eng.pool.num_blocks
