"""Sampling: the top-k shortcut, penalties, min-p, masks and log-probabilities on crafted rows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.errors import LocalkvError
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


# ------------------------------------------------------------------ penalties, min-p, logprobs

ROW = np.array([2.0, -2.0, 1.0, 0.5, -0.5], np.float32)


def adjusted(history, **kw):
    return Sampler(SamplingParams(**kw)).adjusted(ROW, history)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_recent_tokens():
    got = adjusted([0, 1, 0], repeat_penalty=2.0)
    assert got.tolist() == [1.0, -4.0, 1.0, 0.5, -0.5]  # once per distinct token, whatever its count


def test_presence_penalty_subtracts_a_constant_once_per_recent_token():
    got = adjusted([0, 0, 0, 4], presence_penalty=0.5)
    assert got.tolist() == [1.5, -2.0, 1.0, 0.5, -1.0]


def test_frequency_penalty_subtracts_count_times_value():
    got = adjusted([0, 0, 0, 4], frequency_penalty=0.5)
    assert got.tolist() == [0.5, -2.0, 1.0, 0.5, -1.0]


def test_penalties_combine_as_llama_cpp_orders_them():
    got = adjusted([0, 0, 1], repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    assert got.tolist() == [1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 1.0, 0.5, -0.5]


@pytest.mark.parametrize("last_n,penalized", [(1, {3}), (2, {0, 3}), (0, set()), (-1, {0, 2, 3})])
def test_penalties_look_only_at_the_last_n_tokens(last_n, penalized):
    got = adjusted([2, 0, 3], repeat_penalty=4.0, repeat_last_n=last_n)
    assert {i for i in range(ROW.size) if got[i] != ROW[i]} == penalized


def test_neutral_penalties_leave_the_row_untouched_and_uncopied():
    s = Sampler(SamplingParams(repeat_penalty=1.0))
    assert s.adjusted(ROW, [0, 1]) is ROW


def test_a_repeat_penalty_moves_greedy_off_a_repeated_token():
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.5))
    assert s(ROW) == 0 and s(ROW, history=[0]) == 2


def test_penalties_change_the_sampled_distribution():
    row = np.zeros(4, np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=5, frequency_penalty=1.0))
    draws = np.bincount([s(row, history=[1, 1, 1]) for _ in range(3000)], minlength=4) / 3000
    # token 1 keeps e^-3 of its weight: p = e^-3 / (3 + e^-3)
    assert abs(draws[1] - np.exp(-3) / (3 + np.exp(-3))) < 0.01 and all(abs(draws[[0, 2, 3]] - draws[0]) < 0.05)


@pytest.mark.parametrize("min_p,kept", [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.7, {0})])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(min_p, kept):
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(1.0, 0, 1.0, 1, min_p=min_p))
    assert {s(row) for _ in range(600)} == kept


def test_logprobs_are_the_log_softmax_of_the_penalized_row_at_temperature_one():
    row = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 2
    for t in (0.0, 0.3, 1.7):
        s = Sampler(SamplingParams(temperature=t, seed=2, logprobs=5, repeat_penalty=3.0))
        tok = s(row, history=[7, 9])
        seen = s.adjusted(row, [7, 9]).astype(np.float64)
        want = seen - seen.max() - np.log(np.exp(seen - seen.max()).sum())
        lp = s.last
        assert lp.token == tok and lp.logprob == pytest.approx(want[tok], abs=1e-9)
        assert [i for i, _ in lp.top] == np.argsort(-want)[:5].tolist()
        assert [v for _, v in lp.top] == pytest.approx(np.sort(want)[::-1][:5].tolist(), abs=1e-9)


def test_logprobs_zero_gives_the_token_alone_and_none_records_nothing():
    s = Sampler(SamplingParams(temperature=0, logprobs=0))
    s(ROW)
    assert s.last.top == () and s.last.token == 0
    s = Sampler(SamplingParams(temperature=0))
    s(ROW)
    assert s.last is None


class OnlyOdd:
    """A matcher allowing odd token ids, recording what it was given."""

    def __init__(self, n):
        self.n, self.accepted = n, []

    def allowed(self):
        return np.arange(self.n) % 2 == 1

    def accept(self, token):
        self.accepted.append(token)


def test_a_matcher_masks_the_row_and_sees_every_drawn_token():
    row = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    m = OnlyOdd(290)  # a vocabulary smaller than the model's rows: the padded rows are masked too
    s = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=1, logprobs=3), m)
    picks = [s(row) for _ in range(200)]
    assert all(p % 2 == 1 and p < 290 for p in picks) and m.accepted == picks
    assert all(i % 2 == 1 for i, _ in s.last.top)
    assert Sampler(SamplingParams(temperature=0), OnlyOdd(300))(row) == max(range(1, 300, 2), key=lambda i: row[i])


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"min_p": 1.5}, "min-p"),
        ({"repeat_penalty": 0.0}, "repeat penalty"),
        ({"repeat_penalty": float("nan")}, "repeat penalty"),
        ({"repeat_last_n": -2}, "repeat-last-n"),
        ({"presence_penalty": float("inf")}, "presence penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency penalty"),
        ({"stop": ("",)}, "stop string"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_values_are_one_line_errors(kw, needle):
    with pytest.raises(LocalkvError) as e:
        SamplingParams(**kw).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_stop_takes_one_string_or_any_sequence():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
