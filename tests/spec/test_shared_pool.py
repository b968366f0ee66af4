"""Requests learn from each other: every prompt-lookup branch records its verified tokens in the
engine's shared n-gram pool (spec/shared), and a branch whose own context finds nothing drafts
from it; the pool's memory is fixed."""

from dataclasses import replace

import numpy as np
from test_one_answer import models  # noqa: F401 (a fixture)
from test_speculation import GREEDY, engine, run, tokens

from localkv.spec.shared import SharedNgrams


def test_a_recorded_text_is_drafted_back_and_an_unseen_one_is_not():
    pool = SharedNgrams(n=3, slots=1024)
    text = list(range(100, 140))
    pool.record(text, 0, len(text))
    assert pool.draft(text[:10], 8) == text[10:18]
    assert pool.draft([1, 2, 3], 8) == []
    assert pool.draft(text[:2], 8) == [], "shorter than the context hashed"
    pool.clear()
    assert pool.draft(text[:10], 8) == [] and not pool._key.any()
    pool.record(text, 0, len(text))
    assert pool.draft(text[:10], 8) == text[10:18], "and learns again"
    size = pool._key.nbytes + pool._next.nbytes
    pool.record(list(range(10_000)), 0, 10_000)  # more contexts than slots: older ones overwritten
    assert pool._key.nbytes + pool._next.nbytes == size


def test_a_second_request_drafts_from_the_first_ones_reply(models):  # noqa: F811
    """A reply that does not repeat itself (sampled: the test model's logits lie far apart, so
    at 60 its draws leave the argmax) finds little to draft in its own context; the same
    request again on the same engine (a regenerated answer with its seed, another client's
    identical request) drafts the reply the first one wrote, and the text is the same."""
    path = models("llama-Q4_1")
    prompt = np.random.default_rng(5).integers(3, 261, 40).tolist()
    params = replace(GREEDY, temperature=60.0, top_k=40, seed=3, max_tokens=48)
    eng = engine(path, spec="ngram", prefix_cache=False)
    first = run(eng, prompt, params)
    second = run(eng, prompt, params)
    assert tokens(second) == tokens(first)
    a, b = first.speculation(), second.speculation()
    assert b["accepted"] >= a["accepted"] + 20 and b["tokens_per_pass"] > 2, (a, b)
