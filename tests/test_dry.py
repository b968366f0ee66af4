"""DRY ("Don't Repeat Yourself"): the penalty against a brute-force reading of llama.cpp's rule on
random histories (breakers and windows included), the documented values, the breaker mask, the
parameters' checks, and the fields of the OpenAI and Ollama APIs."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.dry import DEFAULT_BREAKERS, apply_dry, breaker_mask, max_exponent
from localkv.errors import LocalkvError
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Sampler, SamplingParams
from localkv.serve import ollama, openai
from localkv.serve.openai import ApiError

VOCAB = 10  # the rows' size; histories also hold ids past it (a model's padded rows)
BREAK = 9  # the token the crafted histories use as a breaker ("\n")


def reference(window, multiplier, base, allowed, breakers, size) -> np.ndarray:
    """What llama.cpp subtracts, read off its definition one end at a time: for every earlier
    end i, the longest suffix of the window also ending at i (not past the last breaker), and
    the token after i; the longest such suffix per token, at least `allowed` long, costs
    multiplier x base ** (length - allowed), the exponent clamped."""
    w, n = list(window), len(window)
    limit = next((k for k in range(n) if w[n - 1 - k] in breakers), n)
    best: dict[int, int] = {}
    for i in range(n - 1):
        z = 0
        while z <= i and w[i - z] == w[n - 1 - z]:
            z += 1
        z = min(z, limit)
        if z >= allowed:
            best[w[i + 1]] = max(best.get(w[i + 1], 0), z)
    out = np.zeros(size, np.float32)
    top = max_exponent(base)
    for t, z in best.items():
        if t < size and t not in breakers:
            e = min(z - allowed, top) if top else z - allowed
            out[t] = np.float32(min(multiplier * base**e, float(np.finfo(np.float32).max)))
    return out


def mask_of(breakers, size=VOCAB) -> np.ndarray:
    m = np.zeros(size, bool)
    m[list(breakers)] = True
    return m


@st.composite
def histories(draw):
    """Short random runs over a small alphabet with copies of their own tails pasted on: long
    repeats, overlapping ones and loops, which random tokens alone would rarely give."""
    h = draw(st.lists(st.integers(0, VOCAB + 1), max_size=40))
    for _ in range(draw(st.integers(0, 3))):
        if h:
            k = draw(st.integers(1, len(h)))
            h = h + h[-k:] * draw(st.integers(1, 6))
        h += draw(st.lists(st.integers(0, VOCAB + 1), max_size=3))
    return h


@settings(max_examples=400, deadline=None)
@given(
    history=histories(),
    allowed=st.integers(0, 5),
    base=st.sampled_from([1.0, 1.0000005, 1.5, 1.75, 3.0, 1e12]),
    multiplier=st.sampled_from([0.8, 2.5]),
    breakers=st.sets(st.integers(0, VOCAB + 1), max_size=3),
    last_n=st.integers(-1, 80),
)
def test_dry_matches_the_brute_force_reference(history, allowed, base, multiplier, breakers, last_n):
    logits = np.linspace(-3, 3, VOCAB).astype(np.float32)
    p = SamplingParams(dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n)
    breakers = {b for b in breakers if b < VOCAB - 1}  # the mask is shorter than the row: ids past it break nothing
    got = Sampler(p, breakers=mask_of(breakers, VOCAB - 1)).adjusted(logits, history)
    window = history if last_n < 0 else history[max(0, len(history) - last_n) :] if last_n else []
    want = logits - reference(window, multiplier, base, allowed, breakers, VOCAB)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_a_long_loop_without_breakers_clamps_the_exponent_as_llama_cpp_does():
    history = [1, 2, 3] * 1500
    row = np.zeros(4, np.float32)
    apply_dry(row, history, 1.0, 1.75, 2)
    top = max_exponent(1.75)  # 158: 1.75 ** 158 is near float32's largest
    assert row[1] == np.float32(-(1.75**top)) and row[2] == row[3] == 0
    np.testing.assert_array_equal(row, -reference(history, 1.0, 1.75, 2, set(), 4))


class OnlyThree:
    """A grammar matcher that allows token 3 alone."""

    def allowed(self):
        return np.arange(6) == 3

    def accept(self, token):
        pass

    def copy(self):
        return self


def test_a_grammar_that_leaves_only_a_penalized_token_still_draws_it():
    history = [0, 1, 2, 3] * 200 + [0, 1, 2]  # 3 would continue an 800-token loop
    s = Sampler(SamplingParams(dry_multiplier=5.0, seed=1), OnlyThree())
    row = s.adjusted(np.zeros(6, np.float32), history, OnlyThree().allowed())
    assert np.isfinite(row[3]) and row[3] < -1e38
    assert s(np.zeros(6, np.float32), history) == 3


def test_the_documented_value_for_a_known_case():
    # a b c d a b c: the suffix "a b c" (3 tokens) is followed by d earlier, so d would make it 4
    history = [0, 1, 2, 3, 0, 1, 2]
    row = np.zeros(6, np.float32)
    apply_dry(row, history, 0.8, 1.75, 2)
    assert row[3] == np.float32(-0.8 * 1.75 ** (3 - 2))
    assert np.count_nonzero(row) == 1  # a, b, c are repeated but would continue no repeat: untouched


def test_llama_cpps_worked_example():
    # llama.cpp's comment: "a b c c b c y a b c" gives c 3, b 1, y 2 as the repeats they continue
    a, b, c, y = 0, 1, 2, 3
    row = np.zeros(4, np.float32)
    apply_dry(row, [a, b, c, c, b, c, y, a, b, c], 1.0, 2.0, 1)
    assert row.tolist() == [0.0, -(2.0**0), -(2.0**2), -(2.0**1)]


def test_repeats_shorter_than_the_allowed_length_and_fresh_tokens_are_untouched():
    row = np.zeros(8, np.float32)
    apply_dry(row, [4, 5, 6, 7, 4, 5, 6, 1, 2], 0.8, 1.75, 2)  # the end "1 2" was never seen before
    assert not row.any()
    apply_dry(row, [4, 5, 6, 4], 0.8, 1.75, 2)  # "4" alone repeats: shorter than 2
    assert not row.any()


def test_a_breaker_ends_a_repeat_and_is_never_penalized_itself():
    x, a, b, c = 0, 1, 2, 3
    history = [x, a, b, BREAK, c, a, b, BREAK, c]  # "a b \n c" again, but the repeat counts from "\n"
    row = np.zeros(VOCAB, np.float32)
    apply_dry(row, history, 0.8, 1.75, 2)
    assert row[a] < 0  # without breakers: "a b \n c" would continue with a
    row[:] = 0
    apply_dry(row, history, 0.8, 1.75, 2, mask_of({BREAK}))
    assert not row.any()
    row[:] = 0
    apply_dry(row, [x, a, b, BREAK, x, a, b], 0.8, 1.75, 2, mask_of({BREAK}))
    assert not row.any()  # "\n" would continue "x a b" but is a breaker


@pytest.mark.parametrize("last_n, penalty", [(-1, 1.75), (13, 1.75), (12, 1.0), (11, 0.0), (0, 0.0)])
def test_the_window_is_the_last_n_tokens(last_n, penalty):
    history = [0, 1, 2, 3] + [5] * 6 + [0, 1, 2]  # "0 1 2" then 3 at the start; "1 2" 3 from 12 back
    logits = np.zeros(6, np.float32)
    got = Sampler(SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=last_n)).adjusted(logits, history)
    assert got[3] == -penalty and np.count_nonzero(got) == (penalty > 0)


def test_off_by_default_and_with_a_zero_window():
    logits = np.zeros(4, np.float32)
    assert Sampler(SamplingParams()).adjusted(logits, [1, 2, 1, 2, 1]) is logits
    off = SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=0)
    assert not off.penalized and Sampler(off).adjusted(logits, [1, 2, 1, 2, 1]) is logits


def test_breaker_mask_reads_each_tokens_text():
    pieces = [b"a", b"\n", b"x:y", b'"', b"**", b" the", b"\n\n", b"\xe2\x80"]
    assert breaker_mask(pieces, DEFAULT_BREAKERS).tolist() == [0, 1, 1, 1, 1, 0, 1, 0]
    assert breaker_mask(pieces, ("th",)).tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    assert not breaker_mask(pieces, ()).any()


def test_the_tokenizer_keeps_its_breaker_mask():
    pieces = [b"<s>", b"a", b"\n", b"b:"]
    tok = Tokenizer(lambda s: [], pieces, {"<s>": 0}, {}, 0, None, False, None, set())
    m = tok.breaker_mask(DEFAULT_BREAKERS)
    assert m.tolist() == [False, False, True, True] and tok.breaker_mask(DEFAULT_BREAKERS) is m
    assert tok.breaker_mask(("a",)).tolist() == [False, True, False, False]


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("dry_multiplier", -0.1, "invalid DRY multiplier -0.1"),
        ("dry_multiplier", math.inf, "invalid DRY multiplier inf"),
        ("dry_base", 0.9, "invalid DRY base 0.9"),
        ("dry_base", math.nan, "invalid DRY base nan"),
        ("dry_allowed_length", -1, "invalid DRY allowed length -1"),
        ("dry_penalty_last_n", -2, "invalid DRY penalty-last-n -2"),
        ("dry_sequence_breakers", ("\n", ""), "invalid DRY sequence breaker"),
    ],
)
def test_bad_values_are_one_clear_error(field, value, says):
    with pytest.raises(LocalkvError, match=says) as e:
        SamplingParams(**{field: value}).validate()
    assert "\n" not in str(e.value)


def test_the_log_records_dry_only_when_it_is_on():
    assert "dry_multiplier" not in SamplingParams().as_dict()
    d = SamplingParams(dry_multiplier=0.8, dry_base=2.0).as_dict()
    assert d["dry_multiplier"] == 0.8 and d["dry_base"] == 2.0 and d["dry_allowed_length"] == 2
    assert d["dry_sequence_breakers"] == list(DEFAULT_BREAKERS) and "repeat_penalty" not in d


@pytest.mark.parametrize(
    "kw, lookback",
    [
        ({}, 0),
        ({"dry_multiplier": 0.8}, -1),
        ({"dry_multiplier": 0.8, "dry_penalty_last_n": 100}, 100),
        ({"dry_multiplier": 0.8, "dry_penalty_last_n": 100, "repeat_penalty": 1.1}, 100),
        ({"dry_multiplier": 0.8, "dry_penalty_last_n": 10, "repeat_penalty": 1.1}, 64),
        ({"dry_penalty_last_n": 100, "repeat_penalty": 1.1, "repeat_last_n": -1}, -1),
    ],
)
def test_lookback_is_the_widest_window_a_penalty_reads(kw, lookback):
    assert SamplingParams(**kw).lookback == lookback


# ------------------------------------------------------------------ the APIs' fields

DRY_FIELDS = {"dry_multiplier": 0.8, "dry_base": 2, "dry_allowed_length": 3, "dry_penalty_last_n": 256}
HELLO = [{"role": "user", "content": "hi"}]


def test_openai_fields_reach_the_sampling_values():
    ask = openai.parse_chat({"messages": HELLO, **DRY_FIELDS})
    assert {k: ask.values[k] for k in DRY_FIELDS} == DRY_FIELDS
    assert "dry_multiplier" not in openai.parse_chat({"messages": HELLO}).values


@pytest.mark.parametrize(
    "field, value",
    [
        ("dry_multiplier", -1),
        ("dry_multiplier", "high"),
        ("dry_base", 0.5),
        ("dry_allowed_length", 1.5),
        ("dry_allowed_length", -1),
        ("dry_penalty_last_n", -2),
    ],
)
def test_openai_refuses_bad_values_with_a_400_naming_the_field(field, value):
    with pytest.raises(ApiError) as e:
        openai.parse_chat({"messages": HELLO, field: value})
    assert e.value.status == 400 and e.value.param == field


def test_ollama_options_reach_the_sampling_values_and_refuse_bad_ones():
    call = ollama.parse_chat({"model": "m", "messages": HELLO, "options": DRY_FIELDS}, print)
    assert {k: call.ask.values[k] for k in DRY_FIELDS} == DRY_FIELDS
    with pytest.raises(ApiError) as e:
        ollama.parse_chat({"model": "m", "messages": HELLO, "options": {"dry_base": 0.5}}, print)
    assert e.value.status == 400 and "dry_base" in e.value.message
