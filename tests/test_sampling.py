"""Sampling helpers: the top-k shortcut picks what argpartition picks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.sampling import Sampler, SamplingParams, top_k_indices


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 20000), k=st.integers(1, 64), seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_top_k_indices_matches_argpartition(n, k, seed, ties):
    rng = np.random.default_rng(seed)
    row = rng.standard_normal(n).astype(np.float32)
    if ties:  # few distinct values: many ties at the boundary
        row = np.round(row * 2) / 2
    k = min(k, n)
    got = top_k_indices(row, k)
    assert len(got) == k and len(set(got.tolist())) == k
    assert np.array_equal(np.sort(row[got]), np.sort(row[np.argpartition(row, -k)[-k:]]))


def test_seeded_sampling_is_reproducible_and_stays_in_the_top_k():
    row = np.random.default_rng(3).standard_normal(49152).astype(np.float32) * 3
    top = set(np.argpartition(row, -5)[-5:].tolist())
    a = [Sampler(SamplingParams(1.0, 5, 1.0, 7))(row) for _ in range(3)]
    s = Sampler(SamplingParams(1.0, 5, 1.0, 7))
    b = [s(row) for _ in range(50)]
    assert a == [b[0]] * 3 and set(b) <= top and len(set(b)) > 1
    assert Sampler(SamplingParams(0.0))(row) == int(np.argmax(row))


@pytest.mark.parametrize("top_p,kept", [(0.05, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2})])
def test_top_p_keeps_the_smallest_head_reaching_p(top_p, kept):
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(1.0, 0, top_p, 1))
    assert {s(row) for _ in range(400)} == kept
