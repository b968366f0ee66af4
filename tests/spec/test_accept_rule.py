"""The speculative-sampling rule for a draft proposed with certainty (prompt lookup's q is
one-hot): the position draws its token as a plain step does, one draw of the sampler's stream,
and the draft is kept where they agree; so the drafted token comes out with probability
p(token), the token's law is p's after every transform, and the draws are a plain run's."""

import numpy as np
import pytest
from scipy.stats import chisquare

from localkv.sampling import Sampler, SamplingParams

LOGITS = np.array([2.0, 1.6, 1.1, 0.9, -0.5, 0.3], dtype=np.float32)
HISTORY = [1, 1, 3]  # penalized tokens
PARAMS = [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.3, seed=0),
]
DRAWS = 6_000


def law(params: SamplingParams) -> np.ndarray:
    """p over the vocabulary: what a draw without a draft gives (the sampler's transforms)."""
    s = Sampler(params)
    idx, probs = s._distribution(s.adjusted(LOGITS, HISTORY), None)
    p = np.zeros(LOGITS.size)
    p[idx] = probs
    return p


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "truncated-and-penalized"])
@pytest.mark.parametrize("draft", [0, 2, 4], ids=["likely", "middling", "outside-the-support"])
def test_a_drafted_token_leaves_the_distribution_unchanged(params, draft):
    p = law(params)
    s = Sampler(params)
    seen = np.bincount([s(LOGITS, HISTORY, draft) for _ in range(DRAWS)], minlength=LOGITS.size)
    support = p > 0
    assert not seen[~support].any(), "a token outside the support was drawn"
    assert chisquare(seen[support], p[support] * DRAWS).pvalue > 1e-4


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "truncated-and-penalized"])
def test_the_draft_is_accepted_with_its_probability(params):
    """P(the drafted token comes out) = p(token): the acceptance step alone."""
    p = law(params)
    s = Sampler(params)
    hits = sum(s(LOGITS, HISTORY, 1) == 1 for _ in range(DRAWS))
    assert abs(hits / DRAWS - p[1]) < 4 * np.sqrt(p[1] * (1 - p[1]) / DRAWS)


def test_greedy_ignores_the_draft():
    s = Sampler(SamplingParams(temperature=0))
    assert [s(LOGITS, (), d) for d in (None, 0, 3, 5)] == [0, 0, 0, 0]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "truncated-and-penalized"])
def test_the_draws_are_a_plain_runs_whatever_is_drafted(params):
    plain, drafted = Sampler(params), Sampler(params)
    drafts = np.random.default_rng(1).integers(0, LOGITS.size, 500)
    assert [drafted(LOGITS, HISTORY, int(d)) for d in drafts] == [plain(LOGITS, HISTORY) for _ in drafts]
