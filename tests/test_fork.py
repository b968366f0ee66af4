"""Forked sequences share blocks by reference count; copy-on-write keeps every branch exact."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import LocalkvError, PoolExhausted
from localkv.generation import Generation
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.sampling import SamplingParams
from localkv.sequence import Sequence
from tiny_model import write_gguf

PROMPT = list(np.random.default_rng(7).integers(3, 261, 37))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("fork") / "tiny.gguf", ctx=256)


# ------------------------------------------------------------ allocator properties

ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 7), st.integers(1, 20)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_refcounts_equal_tables_holding_each_block(script):
    pool = BlockPool(n_layers=1, num_blocks=24, block_size=4, n_kv_heads=1, head_dim=2)
    kv = KVManager(pool)
    live: list[Sequence] = []
    for op, pick, n in script:
        try:
            if op == "new" or not live:
                s = Sequence([0] * n)
                kv.append_slots(s, n)
                live.append(s)
            elif op == "append":
                s = live[pick % len(live)]
                s.tokens += [1] * n
                kv.append_slots(s, n)
            elif op == "fork":
                live.append(kv.fork(live[pick % len(live)]))
            else:
                kv.free(live.pop(pick % len(live)))
        except PoolExhausted:
            pass  # an error must leave the pool consistent too
        pool.check([s.block_table for s in live])
        for s in live:
            assert len(s.block_table) == -(-s.num_stored // 4)
            assert not any(b in pool.free_queue for b in s.block_table)
    for s in live:
        kv.free(s)
    assert pool.num_free == pool.num_blocks
    pool.check([])


def test_shared_full_blocks_are_never_copied():
    pool = BlockPool(n_layers=1, num_blocks=10, block_size=4, n_kv_heads=1, head_dim=2)
    kv = KVManager(pool)
    a = Sequence([0] * 8)
    kv.append_slots(a, 8)  # two full blocks
    b = kv.fork(a)
    kv.append_slots(b, 1)
    kv.append_slots(a, 1)
    assert a.block_table[:2] == b.block_table[:2] and pool.stats.cow_copies == 0
    assert a.block_table[2] != b.block_table[2]


# ------------------------------------------------------------ equivalence with unshared runs


def test_forked_branches_give_the_same_logits_as_solo_runs(tiny):
    eng = Engine(EngineConfig(model=tiny, block_size=4, prefix_cache=False))
    root = Sequence(list(PROMPT))
    eng.prefill(root)
    kids = [eng.kv.fork(root) for _ in range(3)]
    branches = [root] + kids
    for i, s in enumerate(branches):
        s.tokens.append(10 + i)
    batched = eng.decode(branches)
    for i, s in enumerate(branches):
        s.tokens.append(20 + i)
    batched2 = eng.decode(branches)
    assert eng.stats.cow_copies == 3  # 37 tokens: the last block is partly filled and shared
    for i in range(4):
        solo = Sequence(PROMPT + [10 + i, 20 + i])
        ref = Engine(EngineConfig(model=tiny, block_size=4, prefix_cache=False))
        seq = Sequence(PROMPT + [10 + i])
        np.testing.assert_allclose(batched[i], ref.prefill(seq), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(batched2[i], ref.prefill(solo), rtol=1e-4, atol=1e-4)


def test_branch_texts_equal_solo_generations(tiny):
    eng = Engine(EngineConfig(model=tiny, block_size=8))
    params = SamplingParams(temperature=40.0, seed=11)
    res = Generation(eng, PROMPT, replace(params, max_tokens=12, ignore_eos=True), n=4).run()
    assert eng.pool.num_free == eng.pool.num_blocks  # every branch freed
    for i, b in enumerate(res.branches):
        solo = Generation(
            eng, PROMPT, SamplingParams(temperature=40.0, seed=11 + i, max_tokens=12, ignore_eos=True)
        ).run()
        assert b.tokens == solo.tokens
    assert len({tuple(b.tokens) for b in res.branches}) > 1  # different seeds, different branches


@pytest.mark.parametrize("n", [3, 8])  # 3 rows: kernel groups of 2 and 1 (or a gemv per row); 8: one kernel call
def test_branches_decode_together(tiny, monkeypatch, n):
    """One forward per step for all live branches, and in it one matmul call per weight and
    layer whose input holds every branch's row (not a branch after another)."""
    from localkv.backends import cpu as ops_numpy

    eng = Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False))
    forwards, weight_rows, logit_rows = [], [], []
    forward, linear = eng.model.forward, ops_numpy.linear

    def counting_forward(tokens, *a, **k):
        forwards.append(len(tokens))
        return forward(tokens, *a, **k)

    def counting_linear(x, w, kind):
        (logit_rows if kind == "output" else weight_rows).append(len(x))
        return linear(x, w, kind)

    monkeypatch.setattr(eng.model, "forward", counting_forward)
    monkeypatch.setattr(eng.backend, "linear", counting_linear)  # the model's weight matmuls
    monkeypatch.setattr(ops_numpy.backend, "linear", counting_linear)  # the logits (backends.cpu.backend.logits)
    Generation(eng, PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), n=n).run()
    layers = eng.model_config.n_layers
    assert forwards == [len(PROMPT)] + [n] * 5  # the prompt once, then 5 steps of n rows each
    assert weight_rows == [len(PROMPT)] * 4 * layers + [n] * 4 * layers * 5
    if eng.cpu_kernels:  # logits through the kernels too: the prompt's last row, then all n rows at once
        assert logit_rows == [1] + [n] * 5


def test_sharing_holds_fewer_blocks_than_unshared(tiny):
    eng = Engine(EngineConfig(model=tiny, block_size=16, prefix_cache=False))
    prompt = (PROMPT * 4)[:128]  # 8 full blocks
    res = Generation(eng, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), n=8).run()
    # 8 shared prompt blocks + per branch ceil(19 / 16) = 2 blocks of its own
    assert res.peak_blocks == 8 + 8 * 2
    assert res.unshared_blocks == 8 * (-(-(128 + 19) // 16))
    assert res.cow_copies == 0


def test_branch_count_and_pool_limits(tiny):
    eng = Engine(EngineConfig(model=tiny, block_size=16, kv_mem=2 * 2 * 16 * 2 * 16 * 4 * 10))  # 10 blocks
    with pytest.raises(LocalkvError, match="invalid branch count"):
        Generation(eng, PROMPT, SamplingParams(max_tokens=5), n=0).run()
    with pytest.raises(PoolExhausted, match="8 branches"):
        Generation(eng, PROMPT, SamplingParams(max_tokens=40), n=8).run()
    assert eng.pool.num_free == eng.pool.num_blocks
