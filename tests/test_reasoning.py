"""Thinking models (localkv/reasoning.py): the streamed split of a reply into thinking and answer
however its text is cut, the families told apart by their templates, the thinking switch in the
rendered prompt, and a Generation on tiny Qwen3 and R1-distill models made to think (their real
vocabulary and templates): the split, the budget's forced closing tag, stop strings, a grammar
and a tool call's trigger that bind only in the answer."""

import dataclasses
import json

import pytest
from thinking_models import scripted, write

from localkv import reasoning
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.events import Delta, Finished
from localkv.generation import Generation
from localkv.model.tokenizer import Tokenizer
from localkv.reasoning import ANSWER, FAMILIES, OPENING, THINKING, Splitter
from localkv.sampling import Constraint, SamplingParams
from localkv.scheduler import Scheduler
from localkv.toolcalls import Choice, prepare, read_tools
from tiny_model import CHATML, write_gguf

THINK = FAMILIES[-1]  # the generic <think> rule
ASK = [{"role": "user", "content": "Capital of France?"}]


def split_in_pieces(state: str, text: str, cuts: list[int]) -> tuple[str, str]:
    s, thought, answer = Splitter(THINK, state), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        t, x = s.push(text[a:b])
        thought, answer = thought + t, answer + x
    t, x = s.flush()
    return thought + t, answer + x


@pytest.mark.parametrize(
    "state,text,want",
    [
        (OPENING, "<think>\nLet me see.\nParis.\n</think>\n\nParis.", ("Let me see.\nParis.", "Paris.")),
        (OPENING, "\n<think>x</think>y", ("x", "y")),
        (OPENING, "Paris, no <think> here.", ("", "Paris, no <think> here.")),
        (OPENING, "<thin", ("", "<thin")),  # ended before it could be the tag: the model's text
        (THINKING, "Hmm.\n</think>\n\nParis.", ("Hmm.", "Paris.")),
        (THINKING, "cut short </thi", ("cut short </thi", "")),  # ended inside the thinking: all of it
        (THINKING, "</think>", ("", "")),
        (ANSWER, "<think>a</think>b", ("", "<think>a</think>b")),  # thinking off: nothing is parsed
    ],
)
def test_a_reply_splits_the_same_however_its_text_is_cut(state, text, want):
    assert split_in_pieces(state, text, []) == want
    assert split_in_pieces(state, text, list(range(1, len(text)))) == want  # a character at a time
    for i in range(1, len(text)):  # and every cut in two
        assert split_in_pieces(state, text, [i]) == want, i


def test_whitespace_inside_the_thinking_streams_once_more_text_comes():
    s = Splitter(THINK, THINKING)
    assert s.push("a\n") == ("a", "")  # the newline may be the thinking's last: held
    assert s.push("\nb") == ("\n\nb", "")


@pytest.fixture(scope="module")
def qwen3(vocabularies, tmp_path_factory):
    path = write(tmp_path_factory.mktemp("qwen3"), "tiny-qwen3")
    return Engine(EngineConfig(model=str(path), disk_cache=False, kv_mem="32MiB", ctx=1024, threads=2))


@pytest.fixture(scope="module")
def r1(vocabularies, tmp_path_factory):
    path = write(tmp_path_factory.mktemp("r1"), "tiny-r1-distill")
    return Engine(EngineConfig(model=str(path), disk_cache=False, kv_mem="32MiB", ctx=1024, threads=2))


def test_the_families_are_told_apart_by_their_templates(qwen3, r1):
    assert reasoning.family(qwen3.tokenizer.chat_template).name == "qwen3"
    assert reasoning.family(r1.tokenizer.chat_template).name == "deepseek-r1"
    assert reasoning.family(CHATML) is None
    assert reasoning.family(CHATML + "<think>").name == "think"


def test_no_think_renders_each_templates_no_thinking_form(qwen3, r1):
    def prompt(eng, **kw):
        return reasoning.chat(eng.tokenizer, ASK, SamplingParams(**kw))

    text, plan = prompt(qwen3)
    assert text.endswith("<|im_start|>assistant\n") and plan.start == OPENING  # Qwen3 opens its own <think>
    text, plan = prompt(qwen3, think=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and plan.start == ANSWER
    assert prompt(qwen3, reasoning_budget=0)[0] == text  # a budget of 0 is the same form
    text, plan = prompt(r1)
    assert text.endswith("<｜Assistant｜><think>\n") and plan.start == THINKING  # R1's template opens it
    text, plan = prompt(r1, think=False)
    assert text.endswith("<｜Assistant｜><think>\n</think>") and plan.start == ANSWER  # llama.cpp's switch


def test_a_template_without_a_switch_gets_the_closed_block_appended(r1):
    tok = r1.tokenizer
    original = tok.chat_template.replace("{% if not enable_thinking %}{{- '</think>' -}}{% endif %}", "")
    assert "enable_thinking" not in original  # DeepSeek's own template
    bare = Tokenizer.__new__(Tokenizer)
    bare.__dict__.update({k: v for k, v in tok.__dict__.items() if k != "_template"})
    bare.chat_template = original
    text, plan = reasoning.chat(bare, ASK, SamplingParams(think=False))
    assert text.endswith("<｜Assistant｜><think>\n\n</think>\n\n") and plan.start == ANSWER
    assert reasoning.seal(CHATML + "<think>", "<|im_start|>assistant\n", SamplingParams(think=False)).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )


def run(eng: Engine, messages=ASK, **kw) -> tuple[Generation, list]:
    tools = kw.pop("tools", None)
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 60), **kw)
    text, plan = reasoning.chat(eng.tokenizer, messages, params, tools=tools)
    g = Generation(eng, eng.tokenizer.encode(text), params, reasoning=plan)
    sched, events = Scheduler(eng), []  # as the server drives it: every event, Finished too
    sched.add(g)
    while not g.done:
        sched.step()
        events += list(g.events())
    return g, events


def test_qwen3_thinking_and_answer_stream_apart(qwen3, monkeypatch):
    scripted(monkeypatch, qwen3.tokenizer, "<think>\nThe capital is Paris.\n</think>\n\nParis.")
    g, events = run(qwen3, stop=("capital",))  # a stop string inside the thinking does not stop the reply
    r = g.result
    assert (r.reasoning, r.text, r.finish_reason) == ("The capital is Paris.", "Paris.", "stop")
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.reasoning for d in deltas) == r.reasoning and "".join(d.text for d in deltas) == r.text
    assert any(d.reasoning and not d.text for d in deltas)  # streamed, not only at the end
    fin = next(e for e in events if isinstance(e, Finished))
    close = qwen3.tokenizer.encode("</think>", add_bos=False)
    assert fin.usage.reasoning_tokens == r.tokens.index(close[0]) + 1


def test_a_stop_string_in_the_answer_still_stops_it(qwen3, monkeypatch):
    scripted(monkeypatch, qwen3.tokenizer, "<think>\nParis.\n</think>\n\nParis. More text")
    r = run(qwen3, stop=("Paris",))[0].result
    assert (r.reasoning, r.text, r.stop_detail) == ("Paris.", "", "stop string 'Paris'")


def test_r1_starts_inside_its_thinking(r1, monkeypatch):
    scripted(monkeypatch, r1.tokenizer, "Paris, surely.\n</think>\n\nParis.")
    r = run(r1)[0].result
    assert (r.reasoning, r.text) == ("Paris, surely.", "Paris.")


def test_no_think_leaves_the_reply_whole(qwen3, monkeypatch):
    scripted(monkeypatch, qwen3.tokenizer, "Paris. <think>x</think>")
    r = run(qwen3, think=False)[0].result
    assert (r.reasoning, r.text) == ("", "Paris. <think>x</think>")


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_a_budget_of_n_thinks_n_tokens_then_the_closing_tag(qwen3, monkeypatch, budget):
    tok = qwen3.tokenizer
    scripted(monkeypatch, tok, "<think>\n" + " one two three" * 5 + "\n</think>\n\nParis.")
    r = run(qwen3, reasoning_budget=budget)[0].result
    opened, closed = tok.encode("<think>", add_bos=False), tok.encode("</think>", add_bos=False)
    assert r.tokens[0] == opened[0]
    assert r.tokens[1 + budget] == closed[0] and closed[0] not in r.tokens[: 1 + budget]
    assert r.reasoning == tok.decode(r.tokens[1 : 1 + budget]).strip()
    assert r.branches[0].reasoning_tokens == budget + 2


def test_a_budget_holds_when_drafts_are_verified_several_tokens_a_pass(qwen3, monkeypatch):
    """Prompt lookup drafts the repeated thinking; the forced closing tag is still the token
    after the budget's last, and the text is what decoding one token at a time gives."""
    tok = qwen3.tokenizer
    reply = "<think>\n" + " one two three" * 6 + "\n</think>\n\n" + "Paris. " * 6
    scripted(monkeypatch, tok, reply)
    one_by_one = run(qwen3, reasoning_budget=12)[0].result
    spec = Engine(dataclasses.replace(qwen3.config, spec="ngram"))
    scripted(monkeypatch, tok, reply)
    r = run(spec, reasoning_budget=12)[0].result
    assert r.speculation()["accepted"] > 0
    assert (r.tokens, r.reasoning, r.text) == (one_by_one.tokens, one_by_one.reasoning, one_by_one.text)
    assert r.tokens[13] == tok.encode("</think>", add_bos=False)[0]


def test_a_budget_forces_a_closing_tag_of_many_tokens(tmp_path, monkeypatch):
    """A byte-level vocabulary: every tag is 7 or 8 tokens, each cut anywhere by the stream."""
    template = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    path = write_gguf(tmp_path / "b.gguf", ctx=512, meta={"tokenizer.chat_template": template})
    eng = Engine(EngineConfig(model=str(path), disk_cache=False, kv_mem="8MiB"))
    tok = eng.tokenizer
    assert reasoning.family(tok.chat_template).name == "think"
    scripted(monkeypatch, tok, "abcdefghijklmnop")
    r = run(eng, reasoning_budget=5)[0].result
    closed = tok.encode("</think>", add_bos=False)
    assert len(closed) == 8 and r.tokens[5:13] == closed
    assert r.reasoning == "abcde"


def test_a_grammar_holds_from_the_closing_tag_on(qwen3, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    scripted(monkeypatch, qwen3.tokenizer, "<think>\nJSON, then: {not json}\n</think>\n\nnot json either")
    r = run(qwen3, constraint=Constraint("json_schema", json.dumps(schema)))[0].result
    assert r.reasoning == "JSON, then: {not json}"
    assert json.loads(r.text)["a"] in (1, 2)


def test_a_tool_calls_trigger_inside_the_thinking_does_not_bind(qwen3, monkeypatch):
    tok = qwen3.tokenizer
    tools = read_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    plan = prepare(tools, Choice("auto"), tok)
    assert plan.family.trigger == "<tool_call>"
    scripted(monkeypatch, tok, "<think>\nI could write <tool_call> now.\n</think>\n\nNo call.")
    r = run(qwen3, tools=plan, constraint=plan.constraint)[0].result
    assert (r.reasoning, r.text) == ("I could write <tool_call> now.", "No call.")
    assert plan.parse(r.text)[1] == []
