"""Prefix cache: chained block hashes, revival from the free queue, the disk tier across engines."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager, block_hash
from localkv.sampling import SamplingParams
from localkv.sequence import Sequence
from tiny_model import write_gguf

PROMPT = list(map(int, np.random.default_rng(3).integers(3, 261, 70)))
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("pc") / "tiny.gguf", ctx=256)


def engine(path, **kw):
    kw.setdefault("block_size", 16)
    return Engine(EngineConfig(model=path, **kw))


def test_hash_is_stable_across_processes():
    code = "from localkv.kv.block_tables import block_hash; print(block_hash(b'model', None, [1, 2, 3]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == block_hash(b"model", None, [1, 2, 3])
    assert block_hash(b"model", None, [1, 2, 3]) != block_hash(b"other", None, [1, 2, 3])
    assert block_hash(b"model", 5, [1, 2, 3]) != block_hash(b"model", None, [1, 2, 3])


def test_second_request_reuses_full_blocks_and_recomputes_the_last_token(tiny):
    eng = engine(tiny, disk_cache=False)
    first = Generation(eng, PROMPT, replace(GREEDY, max_tokens=8, ignore_eos=True)).run()
    second = Generation(eng, PROMPT, replace(GREEDY, max_tokens=8, ignore_eos=True)).run()
    assert first.cached_tokens == 0 and second.cached_tokens == 64  # 4 full blocks of 16
    assert second.tokens == first.tokens
    exact = PROMPT[:64]  # block-aligned prompt: the last block is never matched (its logits are needed)
    assert [
        Generation(eng, exact, replace(GREEDY, max_tokens=2, ignore_eos=True)).run().cached_tokens for _ in range(2)
    ] == [48, 48]
    assert eng.stats.prefix_hits == 64 + 48 + 48 and eng.stats.prefix_queries == 70 * 2 + 64 * 2


def test_freed_blocks_are_revived_until_the_pool_needs_them():
    pool = BlockPool(n_layers=1, num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
    kv = KVManager(pool, salt=b"m")
    a = Sequence([1, 2, 3, 4, 5])
    kv.append_slots(a, 5)
    kv.register_full_blocks(a)
    kv.free(a)
    assert len(pool.cached) == 2 and pool.num_free == 4
    b = Sequence([1, 2, 3, 4, 9])
    assert kv.match_prefix(b) == (4, 0)  # revived from the free queue
    pool.check([b.block_table])
    kv.free(b)
    big = Sequence([7] * 8)
    kv.append_slots(big, 8)  # takes every block: cached ones lose their hash
    assert pool.cached == {}
    kv.free(big)
    assert kv.match_prefix(Sequence([1, 2, 3, 4, 9])) == (0, 0)


def test_a_hash_hit_is_verified_against_the_tokens():
    pool = BlockPool(n_layers=1, num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
    kv = KVManager(pool, salt=b"m")
    a = Sequence([1, 2, 3])
    kv.append_slots(a, 3)
    kv.register_full_blocks(a)
    pool.blocks[a.block_table[0]].tokens = (9, 9)  # as if two token runs collided on one hash
    assert kv.match_prefix(Sequence([1, 2, 3])) == (0, 0)


def test_disk_tier_serves_a_new_engine_with_identical_output(tiny):
    cold = engine(tiny)
    ref = Generation(cold, PROMPT, replace(GREEDY, max_tokens=12, ignore_eos=True)).run()
    assert cold.disk.stats()["entries"] == 4
    warm = engine(tiny)  # a fresh pool: only the disk can help
    r = Generation(warm, PROMPT, replace(GREEDY, max_tokens=12, ignore_eos=True)).run()
    assert r.cached_tokens == 64 and warm.stats.disk_hits == 64
    assert r.tokens == ref.tokens
    # entries keep the pool's dtype (f16 on the CPU by default): logits after a disk hit equal a
    # full recompute up to float summation order
    assert {r["dtype"] for r in warm.disk.ls()} == {"float16"} and warm.kv_dtype == "f16"
    eng = engine(tiny)
    s, hit = eng.open_sequence(PROMPT)
    assert hit == 64
    np.testing.assert_allclose(
        eng.prefill(s), engine(tiny, prefix_cache=False).prefill(Sequence(PROMPT)), atol=1e-4, rtol=1e-4
    )


def test_corrupt_disk_entries_are_recomputed(tiny, private_home):
    ref = Generation(engine(tiny), PROMPT, replace(GREEDY, max_tokens=10, ignore_eos=True)).run()
    for f in (private_home / "kvcache").rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    eng = engine(tiny)
    r = Generation(eng, PROMPT, replace(GREEDY, max_tokens=10, ignore_eos=True)).run()
    assert r.cached_tokens == 0 and r.tokens == ref.tokens
    assert (
        Generation(engine(tiny), PROMPT, replace(GREEDY, max_tokens=10, ignore_eos=True)).run().cached_tokens == 64
    )  # rewritten


def test_another_model_or_block_size_never_reads_the_cache(tiny, tmp_path):
    Generation(engine(tiny), PROMPT, replace(GREEDY, max_tokens=4, ignore_eos=True)).run()
    other = write_gguf(tmp_path / "other.gguf", seed=9, ctx=256)
    assert Generation(engine(other), PROMPT, replace(GREEDY, max_tokens=4, ignore_eos=True)).run().cached_tokens == 0
    assert (
        Generation(engine(tiny, block_size=8), PROMPT, replace(GREEDY, max_tokens=4, ignore_eos=True))
        .run()
        .cached_tokens
        == 0
    )


def test_unwritable_cache_dir_warns_and_still_answers(tiny, private_home):
    private_home.mkdir(parents=True, exist_ok=True)
    (private_home / "kvcache").write_text("not a directory")
    eng = engine(tiny)
    r = Generation(eng, PROMPT, replace(GREEDY, max_tokens=6, ignore_eos=True)).run()
    assert r.completion_tokens == 6 and "disk cache disabled" in eng.disk.warning
    assert (private_home / "kvcache").read_text() == "not a directory"


def test_no_cache_disables_both_tiers(tiny):
    eng = engine(tiny, prefix_cache=False)
    Generation(eng, PROMPT, replace(GREEDY, max_tokens=4, ignore_eos=True)).run()
    assert (
        Generation(eng, PROMPT, replace(GREEDY, max_tokens=4, ignore_eos=True)).run().cached_tokens == 0
        and eng.disk is None
    )


LONG = list(map(int, np.random.default_rng(4).integers(3, 261, 200)))  # 12 full blocks


def test_a_tier_too_small_for_a_prompt_keeps_its_first_blocks_and_says_so_once(tiny):
    """A prefix is reusable only from its start: a full tier keeps the prompt's first blocks and
    drops other entries by least recent use, never the prompt's own; one warning line."""
    eng = engine(tiny)
    Generation(eng, PROMPT[:40], replace(GREEDY, max_tokens=2, ignore_eos=True)).run()  # 2 older entries
    entry = sum(r["bytes"] for r in eng.disk.ls()) // eng.disk.stats()["entries"]
    small = engine(tiny, disk_cache_size=int(entry * 7.5))  # 7 entries fit: the tier is full at 7
    Generation(small, LONG, replace(GREEDY, max_tokens=2, ignore_eos=True)).run()
    assert small.disk.full and not small.disk.disabled
    warning = small.disk.warning
    assert warning.startswith("disk cache full") and "first 112 of this prompt's 200 tokens" in warning
    assert small.disk.stats()["entries"] == 7, "both older entries gave way to the prompt's first blocks"
    again = engine(tiny, disk_cache_size=int(entry * 7.5))
    r = Generation(again, LONG, replace(GREEDY, max_tokens=2, ignore_eos=True)).run()
    assert r.cached_tokens == 112 and again.stats.disk_hits == 112  # every block that fit, from the start
    assert again.disk.warning is not None and again.disk.warning.count("\n") == 0
