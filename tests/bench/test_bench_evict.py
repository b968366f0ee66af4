"""The perplexity harness behind the eviction benchmark, on a tiny random model."""

import math

import numpy as np
import pytest

from localkv.bench import ppl as be
from localkv.config import EngineConfig
from localkv.engine import Engine
from tiny_model import write_gguf

TOKENS = list(map(int, np.random.default_rng(2).integers(3, 261, 120)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ppl") / "tiny.gguf", ctx=256)


def make(tiny):
    return lambda cfg: Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False, evict=cfg))


def test_perplexity_matches_a_direct_computation(tiny):
    eng = make(tiny)(None)
    ppl, peak = be.perplexity(eng, TOKENS, chunk=16)
    logits = eng.score(TOKENS)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = math.exp(-np.mean([logp[i, TOKENS[i + 1]] for i in range(len(TOKENS) - 1)]))
    assert ppl == pytest.approx(want, rel=1e-4) and peak == len(TOKENS)


def test_budgets_are_respected_and_rows_reported(tiny, monkeypatch):
    monkeypatch.setattr(be, "text_tokens", lambda eng, n: TOKENS[:n])
    rows = be.run(make(tiny), n_tokens=120, budgets_pct=(30, 50), chunk=8)
    assert [(r.policy, r.budget) for r in rows] == [
        ("full", None),
        ("sliding", 36),
        ("h2o", 36),
        ("offload", 36),
        ("sliding", 60),
        ("h2o", 60),
        ("offload", 60),
    ]
    assert all(r.peak_active <= r.budget for r in rows if r.budget) and all(r.ppl > 1 for r in rows)
    assert any(r.evictions for r in rows) and any(r.offloads for r in rows)
    lines = be.verdict(rows)
    assert lines[-1] == "active KV never above budget -> PASS"
