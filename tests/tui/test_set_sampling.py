"""/set for the sampling keys llama.cpp and Ollama users know: min_p, penalties, stop strings."""

from dataclasses import replace

import pytest

from localkv.sampling import SamplingParams
from localkv.tui.commands import Say, UseParams, run
from tests.tui.test_commands import State


@pytest.mark.parametrize(
    "line, field_, value, shown",
    [
        ("/set min_p 0.05", "min_p", 0.05, "min_p = 0.05"),
        ("/set repeat-penalty 1.1", "repeat_penalty", 1.1, "repeat_penalty = 1.1"),
        ("/set repeat_last_n -1", "repeat_last_n", -1, "repeat_last_n = -1"),
        ("/set presence_penalty 0.5", "presence_penalty", 0.5, "presence_penalty = 0.5"),
        ("/set frequency_penalty -0.25", "frequency_penalty", -0.25, "frequency_penalty = -0.25"),
        ("/set dry_multiplier 0.8", "dry_multiplier", 0.8, "dry_multiplier = 0.8"),
        ("/set dry-base 2", "dry_base", 2.0, "dry_base = 2.0"),
        ("/set dry_allowed_length 3", "dry_allowed_length", 3, "dry_allowed_length = 3"),
        ("/set dry_penalty_last_n 512", "dry_penalty_last_n", 512, "dry_penalty_last_n = 512"),
        ('/set stop "###" "User:"', "stop", ("###", "User:"), "stop = '###' User:"),
        ("/set stop </s>", "stop", ("</s>",), "stop = '</s>'"),
        ("/set stop none", "stop", (), "stop = (none)"),
    ],
)
def test_set_a_new_sampling_key(line, field_, value, shown):
    st = State(params=SamplingParams(seed=1, stop=("x",)))
    assert run(st, line) == [UseParams(replace(st.params, **{field_: value})), Say(shown)]


@pytest.mark.parametrize(
    "line, why",
    [
        ("/set min_p 2", "invalid min-p 2.0"),
        ("/set repeat_penalty 0", "invalid repeat penalty 0.0"),
        ("/set repeat_last_n 0.5", "invalid repeat_last_n '0.5': expected a number"),
        ("/set presence_penalty inf", "invalid presence penalty inf"),
        ("/set dry_multiplier -1", "invalid DRY multiplier -1.0"),
        ("/set dry_base 0.5", "invalid DRY base 0.5"),
        ("/set dry_allowed_length 1.5", "invalid dry_allowed_length '1.5': expected a number"),
        ('/set stop "unclosed', "invalid stop strings"),
    ],
)
def test_set_refuses_bad_new_values(line, why):
    (say,) = run(State(), line)
    assert say.error and why in say.text and "\n" not in say.text


def test_set_lists_the_new_keys_only_when_they_are_on():
    st = State(params=SamplingParams(seed=None, min_p=0.1, stop=("##",)))
    (say,) = run(st, "/set")
    assert "min_p 0.1" in say.text and "stop '##'" in say.text and "repeat_penalty" not in say.text
