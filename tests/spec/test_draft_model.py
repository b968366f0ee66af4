"""--spec draft: a draft model of the same vocabulary drafts, the target verifies. Greedy text
equals plain decoding token for token (a narrower draft, and the target as its own draft, which
accepts everything), for forks and the scheduler's mixed batches; sampled tokens keep the
target's law (exact probabilities on a top-k support, chi-square over seeds); a draft of another
vocabulary is refused in one line; the draft pool's ref counts are exact after its rollbacks."""

from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare
from spec.test_speculation import GREEDY, PROMPT, engine, mixed_requests, run, run_mixed, tokens
from test_one_answer import models  # noqa: F401 (a fixture)

from localkv.errors import LocalkvError
from localkv.generation import Generation
from localkv.sampling import Constraint, Sampler, SamplingParams
from tiny_model import byte_vocab, write_gguf

TARGET = "llama-Q4_1"


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A draft of the targets' vocabulary: one layer, narrower, other weights."""
    path = tmp_path_factory.mktemp("draft") / "draft.gguf"
    return str(write_gguf(path, quant="Q8_0", ctx=1024, seed=7, n_layers=1, dim=128, ffn=256, n_heads=2))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A draft that disagrees: one layer of other weights and its own output matrix (a tied one
    predicts much as the target's tied one does)."""
    path = tmp_path_factory.mktemp("draft") / "other.gguf"
    return str(write_gguf(path, quant="Q8_0", ctx=1024, seed=11, n_layers=1, tied=False))


def drafting(model, draft: str, **kw):
    return engine(model, spec="draft", draft_model=draft, **kw)


def check_draft_pool(eng):
    eng.draft.pool.check([])
    assert eng.draft.pool.num_free == eng.draft.pool.num_blocks, "draft blocks leaked"


def test_greedy_text_is_the_same_with_a_draft_model(models, narrow):  # noqa: F811
    path = models(TARGET)
    want = run(engine(path))
    eng = drafting(path, narrow, spec_max=5)
    got = run(eng)
    assert tokens(got) == tokens(want)
    s = got.speculation()
    assert s["mode"] == "draft" and s["drafted"] > 0
    check_draft_pool(eng)


def test_the_target_as_its_own_draft_accepts_everything(models):  # noqa: F811
    path = models(TARGET)
    want = run(engine(path))
    eng = drafting(path, str(path.path))
    got = run(eng)
    assert tokens(got) == tokens(want)
    s = got.speculation()
    assert s["drafted"] > 0 and s["accepted"] == s["drafted"]
    check_draft_pool(eng)


def test_a_draft_model_samples_with_dry_as_the_target_does(models):  # noqa: F811
    """The target as its own draft under DRY: the draft's sampler penalizes as the target's does
    (the same breakers, the same history), so every drafted token is accepted."""
    path = models(TARGET)
    params = replace(GREEDY, dry_multiplier=0.8, dry_allowed_length=1)
    want = run(engine(path), params=params)
    eng = drafting(path, str(path.path))
    got = run(eng, params=params)
    assert tokens(got) == tokens(want)
    s = got.speculation()
    assert s["drafted"] > 0 and s["accepted"] == s["drafted"]
    check_draft_pool(eng)


def test_a_draft_that_disagrees_is_rejected_and_rolled_back(models, other):  # noqa: F811
    """Rejections at various positions, the text still the target's."""
    path = models(TARGET)
    params = replace(GREEDY, max_tokens=40, repeat_penalty=1.3)
    want = run(engine(path), params=params)
    eng = drafting(path, other, spec_max=4)
    got = run(eng, params=params)
    assert tokens(got) == tokens(want)
    s = got.speculation()
    assert 0 <= s["accepted"] < s["drafted"]
    check_draft_pool(eng)


@pytest.mark.parametrize("trigger", ["", "c"], ids=["strict", "lazy"])
def test_a_constrained_reply_drafts_on_a_copy_of_its_grammar(models, narrow, trigger):  # noqa: F811
    """The draft masks its rows with a copy of the branch's matcher (strict, and lazy from its
    trigger on): the text equals plain constrained decoding, and the drafts mostly pass."""
    path = models(TARGET)
    regex = Constraint("regex", "[a-f]{3,30}" if not trigger else "c[a-f]{3,30}", trigger=trigger)
    params = SamplingParams(temperature=0, max_tokens=40, constraint=regex)
    want = run(engine(path), params=params)
    got = run(drafting(path, narrow), params=params)
    assert got.text == want.text and got.tokens == want.tokens
    s = got.speculation()
    assert s["accepted"] > 0


def test_forked_branches_each_draft_with_their_own_sequence(models, narrow):  # noqa: F811
    path = models(TARGET)
    sampled = replace(GREEDY, temperature=0.9, seed=3)
    for params in (GREEDY, sampled):
        want = run(engine(path), params=params, n=3)
        eng = drafting(path, narrow)
        got = run(eng, params=params, n=3)
        if params is GREEDY:
            assert tokens(got) == tokens(want)
        assert all(b.spec.drafted > 0 for b in got.branches)
        check_draft_pool(eng)


def test_the_scheduler_mixes_draft_model_and_plain_requests(models, narrow):  # noqa: F811
    path = models(TARGET)
    prompts, params = mixed_requests()
    alone = [run(engine(path), p, q) for p, q in zip(prompts, params)]
    eng = drafting(path, narrow, prefill_chunk=32)
    gens = run_mixed(eng, prompts, params)
    for i, (g, a) in enumerate(zip(gens, alone)):
        assert g.result.tokens == a.tokens, f"request {i}"
    assert tokens(gens[4].result) == [alone[0].tokens] * 2
    assert eng.stats.drafted > 0
    eng.pool.check([])
    assert eng.pool.num_free == eng.pool.num_blocks
    check_draft_pool(eng)


# ------------------------------------------------------------ the sampled law

LOGITS = np.array([2.0, 1.6, 1.1, 0.9, -0.5, 0.3], dtype=np.float32)
DRAFT_LOGITS = np.array([0.2, 1.9, -1.0, 1.5, 0.8, 0.0], dtype=np.float32)  # q far from p
HISTORY = [1, 1, 3]
PARAMS = [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.3, seed=0),
]
DRAWS = 6_000


def law(s: Sampler, logits) -> np.ndarray:
    idx, probs = s._distribution(s.adjusted(logits, HISTORY), None)
    out = np.zeros(logits.size)
    out[idx] = probs
    return out


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "truncated-and-penalized"])
def test_a_token_drafted_from_q_keeps_the_targets_law(params):
    """x ~ q (the draft's row under the same transforms), then the rule: the token's law is p,
    not q (accepting every draft would give q, which the test tells apart)."""
    target, draft = Sampler(params), Sampler(params, stream=1)
    p, q = law(target, LOGITS), law(draft, DRAFT_LOGITS)
    assert np.abs(p - q).sum() > 0.3, "the test needs q far from p"
    seen = np.zeros(LOGITS.size, int)
    for _ in range(DRAWS):
        x, qx = draft.propose(DRAFT_LOGITS, HISTORY, None)
        seen[target(LOGITS, HISTORY, x, qx)] += 1
    support = p > 0
    assert not seen[~support].any(), "a token outside p's support was drawn"
    assert chisquare(seen[support], p[support] * DRAWS).pvalue > 1e-4


def test_the_end_to_end_law_of_a_verified_token_is_the_targets(models, other):  # noqa: F811
    """The first two tokens of a reply over many seeds, drafted by the other model: the second
    is a verified draft (or its resample); their joint frequencies match p(t1) p(t2 | t1),
    computed exactly from the target's own logits under the same transforms."""
    path = models(TARGET)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, max_tokens=3, ignore_eos=True)
    plain, eng = engine(path), drafting(path, other)
    prompt = PROMPT[:40]
    first = law_of(plain, prompt, params)
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in law_of(plain, prompt + [a], params).items()}
    seen: dict[tuple[int, int], int] = {}
    drafted = 0
    n = 1_500
    for seed in range(n):
        r = Generation(eng, prompt, replace(params, seed=seed)).run()
        seen[tuple(r.tokens[:2])] = seen.get(tuple(r.tokens[:2]), 0) + 1
        drafted += r.speculation()["drafted"]
    assert drafted >= n, "the second token was not a verified draft"
    assert set(seen) <= set(joint), "a pair outside the target's support"
    cells = sorted(joint)
    assert chisquare([seen.get(c, 0) for c in cells], [joint[c] * n for c in cells]).pvalue > 1e-4
    check_draft_pool(eng)


def law_of(eng, prompt: list[int], params: SamplingParams) -> dict[int, float]:
    s = Sampler(params)
    idx, probs = s._distribution(s.adjusted(eng.score(prompt)[-1], prompt), None)
    return {int(i): float(p) for i, p in zip(idx, probs) if p > 0}


# ------------------------------------------------------------ refusals and the draft's pool


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path):  # noqa: F811
    path = models(TARGET)
    vocab = byte_vocab()
    swapped = {"tokenizer.ggml.tokens": vocab[:-2] + vocab[:-3:-1]}  # "Ġt" and "he" trade ids
    renamed = str(write_gguf(tmp_path / "renamed.gguf", ctx=1024, meta=swapped))
    with pytest.raises(LocalkvError, match="token 259 differs"):
        drafting(path, renamed)
    grown = {"tokenizer.ggml.tokens": vocab + ["xyz"], "tokenizer.ggml.token_type": [3] * 3 + [1] * 259}
    more = str(write_gguf(tmp_path / "more.gguf", ctx=1024, vocab=262, meta=grown))
    with pytest.raises(LocalkvError, match="262 tokens, the model's 261"):
        drafting(path, more)
