"""Stop strings over streamed text: held back while they may still complete, never shown."""

from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.stops import StopScanner


def feed(stops, pieces):
    s = StopScanner(tuple(stops))
    out = [s.push(p) for p in pieces]
    return out, s


def test_a_stop_string_spanning_three_pieces_is_never_shown():
    out, s = feed(["</answer>"], ["Paris</", "ans", "wer> and more", " later"])
    assert out == ["Paris", "", "", ""] and s.hit == "</answer>"


def test_text_that_stops_being_a_stop_prefix_is_released():
    out, s = feed(["###"], ["a #", "#", "b", "c"])
    assert out == ["a ", "", "##b", "c"] and not s.hit and s.flush() == ""


def test_the_held_tail_comes_back_on_flush():
    out, s = feed(["STOP"], ["go ST"])
    assert out == ["go "] and s.flush() == "ST" and s.flush() == ""


def test_the_stop_string_that_completes_first_wins_however_the_text_is_cut():
    for pieces in (["hello world"], list("hello world"), ["hello w", "orld"]):
        out, s = feed(["o world", "llo"], pieces)
        assert "".join(out) == "he" and s.hit == "llo"
    for pieces in (["abcd"], list("abcd"), ["ab", "cd"]):
        out, s = feed(["abcd", "c"], pieces)
        assert "".join(out) == "ab" and s.hit == "c"


def test_no_stop_strings_pass_text_through():
    out, _ = feed([], ["a", "b"])
    assert out == ["a", "b"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_shown_text_is_the_text_before_the_first_stop_string_however_it_is_split(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out, s = feed(stops, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    shown = "".join(out) + ("" if s.hit else s.flush())
    # where a reader going character by character stops: the first stop string to complete
    ends = [(i + len(x), i) for x in stops if (i := text.find(x)) >= 0]
    assert shown == (text[: min(ends)[1]] if ends else text)
    assert bool(s.hit) == bool(ends)
