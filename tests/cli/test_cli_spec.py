"""--spec on the command line: the same text, the counts in --json and -v, one-line errors, and
the one line that says speculation is off for a request whose KV policy cannot roll back."""

import json

import pytest
from test_cli import assert_one_line_error, localkv

from tiny_model import byte_vocab, write_gguf

RUN = ("run", "abc abc abc abc", "--raw", "-n", "20", "--ignore-eos", "-t", "0", "--no-save")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("cli-spec") / "tiny.gguf", ctx=256))


def test_run_with_speculation_prints_the_same_text_and_its_counts(tiny, tmp_path):
    plain = localkv(*RUN, "-m", tiny, "--json", "--spec", "off", env_home=tmp_path)
    spec = localkv(*RUN, "-m", tiny, "--json", "--spec-max", "4", env_home=tmp_path)  # ngram: the default
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["text"] == b["text"] and a["speculation"]["drafted"] == 0
    s = b["speculation"]
    assert s["mode"] == "ngram" and 0 < s["accepted"] <= s["drafted"] and s["tokens_per_pass"] > 1
    # a verify pass costs at least a plain step; whether the gain passes 1 depends on the pass
    # costs the engine timed at its start (a loaded machine moves them): not asserted
    assert 0 < s["gain"] <= s["tokens_per_pass"]
    v = localkv(*RUN, "-m", tiny, "-v", "--spec", "ngram", env_home=tmp_path)
    assert "drafted tokens accepted" in v.stderr and "x the plain speed" in v.stderr


def test_a_policy_that_cannot_roll_back_says_so_in_one_verbose_line(tiny, tmp_path):
    flags = ("--spec", "ngram", "--evict", "sliding", "--kv-budget", "64", "-v")
    p = localkv(*RUN, "-m", tiny, *flags, env_home=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("speculation:")]
    assert lines == ["speculation:          off for this request: --evict sliding cannot roll back rejected drafts"]


@pytest.mark.parametrize(
    "flags, needle", [(("--spec", "draft"), "--spec"), (("--spec", "ngram", "--spec-max", "65"), "--spec-max")]
)
def test_bad_speculation_flags_are_one_line_errors(tiny, flags, needle):
    assert_one_line_error(localkv(*RUN, "-m", tiny, *flags), needle)


def test_run_with_a_draft_model_prints_the_same_text_and_its_counts(tiny, tmp_path):
    plain = localkv(*RUN, "-m", tiny, "--json", env_home=tmp_path)
    spec = localkv(*RUN, "-m", tiny, "--json", "--spec", "draft", "--draft-model", tiny, env_home=tmp_path)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    s = b["speculation"]
    assert a["text"] == b["text"] and s["mode"] == "draft" and 0 < s["accepted"] == s["drafted"]


def test_a_draft_model_of_another_vocabulary_is_one_line(tiny, tmp_path):
    vocab = byte_vocab()
    swapped = write_gguf(tmp_path / "swapped.gguf", ctx=256, meta={"tokenizer.ggml.tokens": vocab[:-2] + vocab[:-3:-1]})
    p = localkv(*RUN, "-m", tiny, "--spec", "draft", "--draft-model", str(swapped), env_home=tmp_path)
    assert_one_line_error(p, "not its tokenizer")
    served = localkv("serve", "-m", tiny, "--port", "0", "--spec", "draft", "--draft-model", str(swapped))
    assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
    assert served.stderr.strip().splitlines()[-1].startswith("error: --draft-model "), served.stderr
    assert_one_line_error(localkv(*RUN, "-m", tiny, "--spec", "ngram", "--draft-model", tiny), "--draft-model goes")
