"""Prompt-lookup drafting: the longest recent match of the context's end, proposing what
followed it, from an index kept up to date token by token."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localkv.errors import LocalkvError
from localkv.spec import control
from localkv.spec.control import Speculator, share
from localkv.spec.ngram import NgramIndex


def brute(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by scanning: longest suffix first, most recent earlier occurrence."""
    end = len(tokens)
    for n in range(min(n_max, end), n_min - 1, -1):
        suffix = tokens[end - n :]
        for p in range(end - 1, n - 1, -1):  # p: the position just past an occurrence
            if tokens[p - n : p] == suffix:
                out = tokens[p : p + k]
                while len(out) < k:
                    out.append(out[p + len(out) - end])
                return out
    return []


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    t = [1, 2, 3, 9, 8, 7, 3, 5, 5, 1, 2, 3]  # (1, 2, 3) was followed by 9; (3,) more recently by 5
    assert NgramIndex(1, 4).draft(t, 3) == [9, 8, 7]


def test_the_most_recent_occurrence_is_the_source():
    t = [4, 5, 10, 4, 5, 20, 4, 5]
    assert NgramIndex(2, 2).draft(t, 1) == [20]


def test_a_match_near_the_end_continues_its_loop():
    assert NgramIndex(2, 4).draft([6, 7, 6, 7], 5) == [6, 7, 6, 7, 6]
    assert NgramIndex(1, 4).draft([3, 3], 4) == [3, 3, 3, 3]


def test_no_match_or_too_short_a_context_drafts_nothing():
    assert NgramIndex(2, 4).draft([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 4).draft([1], 4) == []
    assert NgramIndex(1, 4).draft([1, 2, 1], 0) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=60),
    st.lists(st.integers(1, 8), min_size=1, max_size=8),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_the_incremental_index_drafts_what_a_scan_finds(tokens, cuts, n_min, extra):
    """Fed the context piece by piece (as a branch grows), the index proposes what a scan of the
    whole context proposes, at every point."""
    n_max, ix, end = n_min + extra, NgramIndex(n_min, n_min + extra), 0
    for cut in cuts * 8:
        end = min(len(tokens), end + cut)
        for k in (1, 4):
            assert ix.draft(tokens[:end], k) == brute(tokens[:end], k, n_min, n_max)
        if end == len(tokens):
            break


def test_a_fork_drafts_from_its_siblings_where_its_own_tokens_have_no_match():
    prompt = [1, 2, 3]
    mine, sib = NgramIndex(2, 4), NgramIndex(2, 4)
    sib.update(prompt + [4, 5, 9, 8, 7, 6])  # a sibling that wrote "4 5" and went on
    assert mine.draft(prompt + [4, 5], 3, (sib,)) == [9, 8, 7]
    assert mine.draft(prompt + [4, 5], 3) == []


def test_a_longer_match_in_a_sibling_beats_a_shorter_one_here_and_a_tie_stays_here():
    mine, sib = NgramIndex(1, 3), NgramIndex(1, 3)
    sib.update([7, 8, 9, 4])
    assert mine.draft([5, 9, 6, 8, 9], 2, (sib,)) == [4]  # (8, 9) in the sibling over (9,) here
    assert NgramIndex(1, 3).draft([9, 6, 1, 9], 2, (sib,)) == [6, 1]  # (9,) here and there: here


def test_a_shrinking_context_is_a_caller_bug():
    ix = NgramIndex(1, 2)
    ix.update([1, 2, 3])
    with pytest.raises(RuntimeError, match="caller's logic"):
        ix.update([1, 2])


def test_the_draft_length_grows_on_whole_acceptance_and_falls_past_a_rejection():
    sp = Speculator.ngram(8, 2, 4)
    assert sp.k == 8
    sp.record(8, 2)
    assert sp.k == 3
    sp.record(3, 3)
    assert sp.k == 6
    sp.record(6, 0)
    assert sp.k == 1
    sp.record(1, 1)
    sp.record(2, 2)
    sp.record(4, 4)
    assert sp.k == 8
    assert (sp.drafted, sp.accepted, sp.passes) == (24, 12, 6)


def test_drafts_rejected_outright_in_a_row_rest_the_lookup():
    sp = Speculator.ngram(8, 1, 2)
    tokens = [5, 6, 5, 6, 5]
    sp.record(1, 0)
    assert sp.propose(tokens, 8) == [6]  # one miss: no rest yet
    rests = []
    for _ in range(6):
        sp.record(1, 0)
        skipped = 0
        while sp.propose(tokens, 8) == []:
            skipped += 1
        rests.append(skipped)
    assert rests == [2, 4, 8, 16, 16, 16]
    sp.record(1, 1)
    assert sp.rest == 0 and sp.propose(tokens, 8) == [6, 5]


def test_many_decoding_sequences_draft_less_then_not_at_all():
    assert [share(n, 500, 8) for n in (1, 2, 4, 8, 16, 17)] == [8, 8, 4, 2, 1, 0]
    assert share(1, 3, 8) == 3  # the step's budget bounds it too
    assert share(0, 500, 8) == 0


@pytest.mark.parametrize(
    "args, what",
    [(("fast", 8, 4, 2), "--spec"), (("ngram", 65, 4, 2), "--spec-max"), (("ngram", 8, 2, 3), "n-gram sizes")],
)
def test_bad_settings_are_one_clear_error(args, what):
    with pytest.raises(LocalkvError, match=what):
        control.check(*args)
