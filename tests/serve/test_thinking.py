"""A thinking model on `localkv serve` (the tiny Qwen3 of tests/thinking_models.py, made to think),
read by the official clients: OpenAI's `reasoning_content` (an extra field of the message and of
the streamed deltas) and Ollama's `message.thinking`, whole and streamed; thinking turned off by
reasoning_effort, chat_template_kwargs and Ollama's think; /api/show's thinking capability."""

import time

import httpx
import ollama
import openai
import pytest
from thinking_models import scripted, write

from localkv.config import EngineConfig, ServeOptions
from localkv.errors import LocalkvError
from localkv.model.tokenizer import Tokenizer
from localkv.serve.metrics import parse
from localkv.serve.server import BackgroundServer

REPLY = "<think>\nThe capital: Paris.\n</think>\n\nParis."
THOUGHT, ANSWER = "The capital: Paris.", "Paris."
ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def model(vocabularies, tmp_path_factory):
    return write(tmp_path_factory.mktemp("qwen3"), "tiny-qwen3")


@pytest.fixture(scope="module")
def server(model):
    with BackgroundServer(EngineConfig(model=str(model), disk_cache=False, kv_mem="32MiB", ctx=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def name(server):
    return httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]


@pytest.fixture()
def tok(model):
    return Tokenizer.from_gguf(model)


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def oll(server):
    return ollama.Client(host=server.url, timeout=120)


def test_openai_whole_answer_has_reasoning_content(oai, tok, monkeypatch, name):
    scripted(monkeypatch, tok, REPLY)
    r = oai.chat.completions.create(model=name, messages=ASK, max_tokens=40, temperature=0, stop=["capital"])
    m = r.choices[0].message
    assert (m.content, m.reasoning_content, r.choices[0].finish_reason) == (ANSWER, THOUGHT, "stop")
    thinking = REPLY[: REPLY.index("</think>") + len("</think>")]
    assert r.usage.completion_tokens_details.reasoning_tokens == len(tok.encode(thinking, add_bos=False))


def test_openai_stream_sends_reasoning_content_deltas(oai, tok, monkeypatch, name):
    scripted(monkeypatch, tok, REPLY)
    stream = oai.chat.completions.create(model=name, messages=ASK, max_tokens=40, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (thought, "".join(d.content or "" for d in deltas)) == (THOUGHT, ANSWER)
    first = next(i for i, d in enumerate(deltas) if d.content)
    assert any(getattr(d, "reasoning_content", None) for d in deltas[:first])  # the thinking streams first


@pytest.mark.parametrize("extra", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_openai_fields_turn_the_thinking_off(oai, tok, monkeypatch, name, extra):
    scripted(monkeypatch, tok, REPLY)  # the prompt closed the thinking: the reply is all answer, tags and all
    r = oai.chat.completions.create(model=name, messages=ASK, max_tokens=40, temperature=0, extra_body=extra)
    m = r.choices[0].message
    assert (m.content, getattr(m, "reasoning_content", None)) == (REPLY, None)


@pytest.mark.parametrize(
    "body,says",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"messages": []}}, "'messages' is set by localkv"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking"),
        ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
    ],
)
def test_bad_thinking_fields_are_refused(server, body, says):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"]


def test_ollama_chat_has_message_thinking_whole_and_streamed(oll, tok, monkeypatch, name):
    opts = {"temperature": 0, "num_predict": 40}
    scripted(monkeypatch, tok, REPLY)
    r = oll.chat(model=name, messages=ASK, options=opts, think=True)
    assert (r.message.thinking, r.message.content) == (THOUGHT, ANSWER)
    scripted(monkeypatch, tok, REPLY)
    parts = list(oll.chat(model=name, messages=ASK, options=opts, stream=True))  # thinking is the default
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER
    scripted(monkeypatch, tok, REPLY)
    r = oll.generate(model=name, prompt="Capital of France?", options=opts, think="low")
    assert (r.thinking, r.response) == (THOUGHT, ANSWER)


def test_ollama_think_false_answers_without_thinking(oll, tok, monkeypatch, name):
    scripted(monkeypatch, tok, REPLY)
    r = oll.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 40}, think=False)
    assert (r.message.thinking, r.message.content) == (None, REPLY)


def test_ollama_show_lists_the_thinking_capability(oll, server, name):
    assert "thinking" in oll.show(name).capabilities
    r = httpx.post(server.url + "/api/chat", json={"model": name, "messages": ASK, "think": "max"}, timeout=60)
    assert r.status_code == 400 and "think" in r.json()["error"]


def test_the_servers_no_think_is_the_default_a_request_can_override(model, tok, monkeypatch):
    """`localkv serve --no-think`: requests that do not say get the no-thinking form; one that
    asks (reasoning_effort) thinks."""
    opts = ServeOptions(port=0, defaults={"think": False})
    cfg = EngineConfig(model=str(model), disk_cache=False, kv_mem="32MiB", ctx=1024)
    with BackgroundServer(cfg, opts) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        scripted(monkeypatch, tok, REPLY)
        plain = client.chat.completions.create(model=name, messages=ASK, max_tokens=40, temperature=0)
        assert (plain.choices[0].message.content, getattr(plain.choices[0].message, "reasoning_content", None)) == (
            REPLY,
            None,
        )
        scripted(monkeypatch, tok, REPLY)
        asked = client.chat.completions.create(
            model=name, messages=ASK, max_tokens=40, temperature=0, extra_body={"reasoning_effort": "high"}
        )
        assert (asked.choices[0].message.content, asked.choices[0].message.reasoning_content) == (ANSWER, THOUGHT)


def test_a_bad_server_wide_budget_fails_at_start():
    with pytest.raises(LocalkvError, match="reasoning budget"):
        ServeOptions(defaults={"reasoning_budget": -5}).validate()


def test_a_finished_chat_is_warmed_while_idle_so_the_next_turn_hits_up_to_its_question(
    server, oai, tok, monkeypatch, name
):
    """The template drops turn 1's thinking from turn 2's prompt; the server prefills turn 2's
    prefix as the template writes it once turn 1 is answered, so turn 2 misses only its question."""
    scripted(monkeypatch, tok, REPLY)
    system = {"role": "system", "content": "You answer in one word, and you think first. " * 8}
    first = [system, *ASK]
    warmed = metric(server, "localkv_warmed_tokens_total")
    m = oai.chat.completions.create(model=name, messages=first, max_tokens=40, temperature=0).choices[0].message
    deadline = time.monotonic() + 60
    while metric(server, "localkv_warmed_tokens_total") == warmed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "localkv_warmed_tokens_total") > warmed
    second = [*first, {"role": "assistant", "content": m.content}, {"role": "user", "content": "And of Spain?"}]
    r = oai.chat.completions.create(model=name, messages=second, max_tokens=40, temperature=0)
    text = tok.render_chat(second, variables={"enable_thinking": True})
    before_question = len(tok.encode(text[: text.index("And of Spain?")]))
    assert r.usage.prompt_tokens_details.cached_tokens >= (before_question - 1) // 16 * 16


def metric(server, key: str) -> float:
    return parse(httpx.get(server.url + "/metrics", timeout=60).text).get(key, 0.0)
