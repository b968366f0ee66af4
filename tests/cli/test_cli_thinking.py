"""`localkv run` with a thinking model (the tiny Qwen3 of tests/thinking_models.py, made to
think): the answer on stdout, the thinking on stderr (or dropped, or beside the text in
--json), --no-think's prompt, the budget, the thinking kept in the conversation log."""

import io
import json
import sys

import pytest
from thinking_models import scripted, write

import localkv.generation
from localkv.cli import main
from localkv.conversations.store import ConversationStore
from localkv.model.tokenizer import Tokenizer
from tiny_model import write_gguf

REPLY = "<think>\nThe capital: Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def qwen3(vocabularies, tmp_path_factory):
    return write(tmp_path_factory.mktemp("qwen3"), "tiny-qwen3")


@pytest.fixture()
def tok(qwen3):
    return Tokenizer.from_gguf(qwen3)


def test_show_says_whether_a_model_thinks(qwen3, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["show", str(qwen3)]) == 0
    assert "thinking          yes, <think>...</think> (qwen3)" in capsys.readouterr().out
    assert main(["show", str(qwen3), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["thinking"] == "qwen3"
    assert main(["show", str(write_gguf(tmp_path / "t.gguf")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["thinking"] is None


def cli(monkeypatch, capsys, model, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    base = ["run", "-m", str(model), "--kv-mem", "16MiB", "--ctx", "512", "-t", "0", "-n", "40"]
    rc = main([*base, *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_the_answer_goes_to_stdout_and_the_thinking_to_stderr(qwen3, tok, monkeypatch, capsys):
    scripted(monkeypatch, tok, REPLY)
    out, err = cli(monkeypatch, capsys, qwen3, "--stop", "capital", "Capital of France?")
    assert out == "Paris.\n"
    assert err == "The capital: Paris.\n"  # not a terminal: no dimming
    with ConversationStore() as st:  # the log keeps the thinking apart from the answer
        reply = st.latest_leaf(st.latest_conversation())
        assert (reply.content, reply.reasoning) == ("Paris.", "The capital: Paris.")


def test_hide_thinking_drops_it(qwen3, tok, monkeypatch, capsys):
    scripted(monkeypatch, tok, REPLY)
    assert cli(monkeypatch, capsys, qwen3, "--hide-thinking", "--no-save", "Capital?") == ("Paris.\n", "")
    scripted(monkeypatch, tok, REPLY)
    out, err = cli(monkeypatch, capsys, qwen3, "--no-stream", "--no-save", "Capital?")
    assert (out, err) == ("Paris.\n", "The capital: Paris.\n")


def test_json_has_the_reasoning_beside_the_text(qwen3, tok, monkeypatch, capsys):
    scripted(monkeypatch, tok, REPLY)
    out, err = cli(monkeypatch, capsys, qwen3, "--json", "--no-save", "Capital?")
    got = json.loads(out)
    assert (got["text"], got["reasoning"], err) == ("Paris.", "The capital: Paris.", "")
    answer = len(tok.encode("\n\nParis.", add_bos=False))
    assert got["reasoning_tokens"] == got["completion_tokens"] - answer  # the tokens up to </think>


def prompts_seen(monkeypatch) -> list[str]:
    seen, init = [], localkv.generation.Generation.__init__

    def spy(self, engine, prompt_ids, *args, **kw):
        seen.append(engine.tokenizer.decode(prompt_ids))
        init(self, engine, prompt_ids, *args, **kw)

    monkeypatch.setattr(localkv.generation.Generation, "__init__", spy)
    return seen


@pytest.mark.parametrize("flag", [["--no-think"], ["--reasoning-budget", "0"]])
def test_no_think_renders_the_templates_no_thinking_form(qwen3, tok, monkeypatch, capsys, flag):
    scripted(monkeypatch, tok, "Paris. <think>")
    seen = prompts_seen(monkeypatch)
    out, err = cli(monkeypatch, capsys, qwen3, *flag, "--no-save", "Capital?")
    assert seen[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (out, err) == ("Paris. <think>\n", "")  # nothing is parsed as thinking


def test_a_budget_closes_the_thinking(qwen3, tok, monkeypatch, capsys):
    scripted(monkeypatch, tok, "<think>\n" + " and so on" * 10 + "\n</think>\n\nParis.")
    out, _ = cli(monkeypatch, capsys, qwen3, "--reasoning-budget", "3", "--json", "--no-save", "Capital?")
    got = json.loads(out)
    assert got["reasoning_tokens"] == 5  # <think>, 3 tokens, </think>
    assert got["reasoning"] == "and so"  # "\n", " and", " so"
