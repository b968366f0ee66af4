"""Drafts and their rollback on the paged pool, as the engine runs them: random drafts, random
accept lengths, forks sharing blocks, prefix-cache hits. After every step the pool's ref counts
and free queue are exact, each sequence's hash chain is that of its verified tokens, every
registered block holds the tokens its hash names, and no block holding a drafted token is ever
registered in the prefix cache. A draft model's sequences, rolled back to each branch's verified
tokens, keep the draft pool as exact."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.sampling import Sampler, SamplingParams
from localkv.spec.draft import DraftModel
from tiny_model import write_gguf

BS = 4


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("rollback") / "tiny.gguf", ctx=256)
    probe = Engine(EngineConfig(model=path, disk_cache=False, block_size=BS))
    per_block = probe.kv_bytes_per_token * BS
    return Engine(EngineConfig(model=path, disk_cache=False, block_size=BS, kv_mem=96 * per_block))


def check(eng: Engine, live: list):
    pool, kv = eng.pool, eng.kv
    pool.check([s.block_table for s in live])
    for s in live:
        full = s.num_stored // BS
        assert s.block_hashes == kv.chain(s.tokens, full), "hash chain != the verified tokens'"
        for i, bid in enumerate(s.block_table):
            b = pool.blocks[bid]
            if b.hash is not None:
                assert i < full and b.hash == s.block_hashes[i] and b.tokens == tuple(s.tokens[i * BS : (i + 1) * BS])


def unregistered_past(eng: Engine, seq, verified: int):
    """No block of seq past its verified full blocks is findable in the prefix cache."""
    for bid in seq.block_table[verified // BS :]:
        assert eng.pool.blocks[bid].hash is None, "a block holding a drafted token was registered"


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "draft", "draft", "draft", "fork", "free"]),
        st.integers(0, 7),  # which sequence
        st.integers(0, 9),  # draft length / prompt length
        st.integers(0, 9),  # accepted
        st.lists(st.integers(3, 6), min_size=10, max_size=10),  # tokens (few values: prefix hits)
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_rollback_keeps_ref_counts_free_queue_and_hashes_exact(eng, script):
    live = []
    try:
        for op, pick, n, a, toks in script:
            if op == "new" or not live:
                seq, _ = eng.open_sequence(toks[: max(2, n)] + toks)
                eng.forward([seq], counts=[len(seq.pending)])
                live.append(seq)
            elif op == "fork":
                live.append(eng.fork(live[pick % len(live)]))
            elif op == "free":
                eng.free(live.pop(pick % len(live)))
            else:
                seq = live[pick % len(live)]
                verified = len(seq.tokens) + 1  # the sampled token, then the draft
                d = min(n, 200 - verified)
                seq.tokens += toks[: 1 + d]
                plan = eng.plan([seq], [1 + d])
                if not plan.fits:
                    del seq.tokens[verified - 1 :]
                    continue
                rows = eng.step(plan, drafts=[d])
                assert rows.shape[0] == 1 + d
                unregistered_past(eng, seq, verified)
                eng.settle(seq, d, min(a, d))
                assert len(seq.tokens) == seq.num_stored == verified + min(a, d)
            check(eng, live)
    finally:
        for s in live:
            eng.free(s)
    eng.pool.check([])
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    """An engine with the tiny model as its own draft model, in a small shared pool."""
    path = write_gguf(tmp_path_factory.mktemp("rollback-draft") / "tiny.gguf", ctx=256)
    probe = Engine(EngineConfig(model=path, disk_cache=False, block_size=BS))
    per_block = probe.kv_bytes_per_token * BS
    cfg = EngineConfig(model=path, disk_cache=False, block_size=BS, kv_mem=2 * 64 * per_block)
    return Engine(replace(cfg, spec="draft", draft_model=str(path)))


draft_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "draft", "draft", "draft", "close"]),
        st.integers(0, 7),  # which branch
        st.integers(0, 9),  # draft length / prompt length
        st.integers(0, 9),  # accepted
        st.lists(st.integers(3, 6), min_size=10, max_size=10),  # tokens (few values: prefix hits)
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draft_ops)
def test_a_draft_models_sequences_roll_back_to_the_verified_tokens(drafting, script):
    """Branches drafting with a draft model, random accept lengths and a random next token (a
    resample or the bonus): after each proposal the draft sequence holds the verified tokens
    and the draft's, computed but its last; the draft pool's ref counts and hashes stay exact,
    and closing every branch frees every block."""
    eng = drafting.draft
    branches: list[tuple[DraftModel, list[int]]] = []
    greedy = Sampler(SamplingParams(temperature=0))
    try:
        for op, pick, n, a, toks in script:
            if op == "new" or not branches:
                model = DraftModel(eng, Sampler(SamplingParams(temperature=0)), greedy, frozenset(), 0)
                branches.append((model, toks[: max(2, n)] + toks))
            elif op == "close":
                branches.pop(pick % len(branches))[0].close()
            else:
                model, verified = branches[pick % len(branches)]
                proposal = model.draft(verified, n)
                if n:
                    seq = model.seq
                    assert len(proposal) <= n and seq.tokens == verified + proposal
                    if proposal:
                        assert seq.num_computed == len(seq.tokens) - 1
                verified += proposal[: min(a, len(proposal))] + [toks[a]]
            check(eng, [m.seq for m, _ in branches if m.seq is not None])
    finally:
        for m, _ in branches:
            m.close()
    eng.pool.check([])
    assert eng.pool.num_free == eng.pool.num_blocks
