"""Drafts and their rollback on the paged pool, as the engine runs them: random drafts, random
accept lengths, forks sharing blocks, prefix-cache hits. After every step the pool's ref counts
and free queue are exact, each sequence's hash chain is that of its verified tokens, every
registered block holds the tokens its hash names, and no block holding a drafted token is ever
registered in the prefix cache."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localkv.config import EngineConfig
from localkv.engine import Engine
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
