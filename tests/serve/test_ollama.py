"""Ollama's API on `localkv serve`, driven by the official `ollama` client (and httpx where the
client cannot send what is tested): chat, generate, streaming, structured output, options,
tags, show, ps, version, load requests, and errors in Ollama's shape."""

import json

import httpx
import ollama
import openai
import pytest

from localkv.config import EngineConfig, ServeOptions
from localkv.serve.ollama import keep_alive
from localkv.serve.openai import ApiError
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf

KEY = "test-key"
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = write_gguf(tmp_path_factory.mktemp("ollama") / "tiny.gguf", ctx=512)
    config = EngineConfig(model=str(tiny), disk_cache=False, kv_mem="16MiB")
    with BackgroundServer(config, ServeOptions(port=0, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def test_chat_answers_as_the_openai_api_does(client, server):
    r = client.chat(model="tiny", messages=HELLO, options=GREEDY)
    assert r.model == "tiny:latest" and r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and r.message.content
    assert 1 <= r.eval_count <= 12 and r.prompt_eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration > 0
    same = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=12, temperature=0
    )
    assert same.choices[0].message.content == r.message.content  # one request path, two shapes


def test_chat_stream_is_ndjson_and_adds_up_to_the_whole_answer(client, http):
    whole = client.chat(model="tiny:latest", messages=HELLO, options=GREEDY)
    parts = list(client.chat(model="tiny", messages=HELLO, options=GREEDY, stream=True))
    assert len(parts) >= 2 and [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    with http.stream("POST", "/api/chat", json={"model": "tiny", "messages": HELLO, "options": GREEDY}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")  # streams unless told not to
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and len(lines) == len(parts)


def test_generate_uses_the_chat_template_unless_raw(client):
    r = client.generate(model="tiny", prompt="hello there", options=GREEDY)
    chat = client.chat(model="tiny", messages=HELLO, options=GREEDY)
    assert r.done and r.response == chat.message.content and r.prompt_eval_count == chat.prompt_eval_count
    raw = client.generate(model="tiny", prompt="hello there", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < r.prompt_eval_count  # no template around it
    parts = list(client.generate(model="tiny", prompt="hello there", system="be brief", options=GREEDY, stream=True))
    assert parts[-1].done and parts[-1].prompt_eval_count > r.prompt_eval_count  # the system turn counts
    assert "".join(p.response for p in parts)


def test_options_map_to_sampling_and_the_context_window(client):
    seeded = dict(temperature=1.5, top_k=0, top_p=1.0, seed=7, num_predict=32)
    a, b, other = (
        client.generate(model="tiny", prompt="seeds", raw=True, options=seeded | {"seed": seed}) for seed in (7, 7, 8)
    )
    assert a.response == b.response != other.response
    assert a.eval_count == 32 and a.done_reason == "length"
    fox = dict(model="tiny", prompt="the quick brown fox", raw=True)
    assert client.generate(**fox, options=GREEDY).response == "x" * 12  # the tiny model's greedy reply
    stopped = client.generate(**fox, options=GREEDY | {"stop": ["xxx"]})
    assert stopped.response == "" and stopped.done_reason == "stop"
    a = client.chat(model="tiny", messages=HELLO, options=GREEDY)
    n = a.prompt_eval_count
    cut = client.chat(model="tiny", messages=HELLO, options={"temperature": 0, "num_ctx": n + 3})
    assert cut.eval_count == 3 and cut.done_reason == "length"  # num_ctx holds the prompt and the reply
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=HELLO, options={"num_ctx": n})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_format_json_and_a_schema_constrain_the_reply(client):
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    r = client.chat(model="tiny", messages=HELLO, format=schema, options={"seed": 1, "num_predict": 60})
    got = json.loads(r.message.content)
    assert got["a"] in ("x", "y") and isinstance(got["b"], bool) and r.done_reason == "stop"
    any_json = client.generate(model="tiny", prompt="hi", format="json", options={"seed": 2, "num_predict": 80})
    assert any_json.response.startswith("{")
    if any_json.done_reason == "stop":
        assert isinstance(json.loads(any_json.response), dict)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=HELLO, format={"type": "nonsense"})
    assert e.value.status_code == 400 and "schema" in e.value.error


def test_tags_show_ps_and_version_describe_the_one_model(client, http):
    (listed,) = client.list().models
    assert listed.model == "tiny:latest" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    shown = client.show("tiny")
    assert shown.details.family == "llama" and "llama.context_length" in shown.modelinfo
    assert shown.capabilities == ["completion"] and shown.modelfile.startswith("FROM ")
    (running,) = client.ps().models
    assert running.name == "tiny:latest" and running.context_length == 512 and running.expires_at.year == 9999
    assert http.get("/api/version").json()["version"]


def test_an_empty_request_loads_and_keep_alive_0_unloads(client):
    assert client.chat(model="tiny", messages=[]).done_reason == "load"
    assert client.generate(model="tiny", keep_alive=0).done_reason == "unload"
    assert client.list().models  # a one-model server keeps its model


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/api/chat", {"model": "other", "messages": HELLO}, 404, 'model "other" not found'),
        ("/api/show", {"model": "other"}, 404, "model 'other' not found"),
        ("/api/chat", {"messages": HELLO}, 400, "model is required"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "tool", "content": "1"}]}, 400, "tool"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "think": True}, 400, "thinking"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "format": "xml"}, 400, "invalid format"),
        ("/api/chat", {"model": "tiny", "messages": "hi"}, 400, "messages"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"temperature": "hot"}}, 400, "temperature"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"mirostat": 2}}, 400, "mirostat"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, 400, "raw"),
    ],
)
def test_bad_requests_get_ollamas_error_shape(http, path, body, status, says):
    r = http.post(path, json=body)
    assert r.status_code == status and says in r.json()["error"], r.text
    assert set(r.json()) == {"error"}


def test_errors_reach_the_client_as_response_errors(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HELLO)
    assert e.value.status_code == 404
    keyless = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as e:
        keyless.list()
    assert e.value.status_code == 401


def test_options_ollama_sets_up_its_runner_with_are_accepted(client):
    r = client.chat(model="tiny", messages=HELLO, options=GREEDY | {"num_thread": 2, "num_gpu": 99, "use_mmap": True})
    assert r.done


def test_keep_alive_reads_seconds_and_go_durations():
    assert keep_alive(None) == 300 and keep_alive(0) == 0 and keep_alive("0") == 0
    assert keep_alive("1h30m") == 5400 and keep_alive("1.5s") == 1.5 and keep_alive(-1) == float("inf")
    assert keep_alive("-1m") == float("inf")
    for bad in ("5", "m", "5 m", True, [1]):
        with pytest.raises(ApiError):
            keep_alive(bad)


@pytest.mark.model
def test_the_ollama_client_on_the_real_model(real_model_path):
    """chat, generate, streaming, a schema, tags and show with SmolLM2, named as Ollama would."""
    config = EngineConfig(model=str(real_model_path), disk_cache=False, kv_mem="256MiB")
    with BackgroundServer(config) as s:
        c = ollama.Client(host=s.url, timeout=300)
        (listed,) = c.list().models
        name = listed.model
        assert name == "SmolLM2-135M-Instruct.Q4_1:latest" and listed.details.quantization_level == "Q4_1"
        ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = c.chat(model=name, messages=ask, options={"temperature": 0, "num_predict": 16})
        assert "Paris" in r.message.content and r.done_reason == "stop"
        parts = list(c.chat(model=name, messages=ask, options={"temperature": 0, "num_predict": 16}, stream=True))
        assert "".join(p.message.content for p in parts) == r.message.content
        g = c.generate(model=name, prompt=ask[0]["content"], options={"temperature": 0, "num_predict": 16})
        assert g.response == r.message.content
        # no other keys: with them allowed, greedy SmolLM2 may go on adding some past num_predict
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
        j = c.chat(model=name, messages=ask, format=schema, options={"temperature": 0, "num_predict": 40})
        assert "Paris" in json.loads(j.message.content)["city"]
        shown = c.show(name)
        assert shown.details.family == "llama" and "im_start" in shown.template


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}, "name"),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only assistant"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "arguments",
        ),
        ({"role": "tool", "content": "1", "tool_name": 7}, "tool_name"),
    ],
)
def test_bad_tool_history_gets_ollamas_error_shape(http, message, says):
    r = http.post("/api/chat", json={"model": "tiny", "messages": [*HELLO, message], "tools": [WEATHER]})
    assert r.status_code == 400 and says in r.json()["error"], r.text
    assert set(r.json()) == {"error"}


@pytest.mark.model
def test_the_ollama_client_gets_tool_calls_that_validate(real_model_path):
    """A tools chat through /api/chat: after a call and its result in the history (the turn where
    SmolLM2 calls again), the reply's calls come parsed as Ollama sends them, each valid
    against its schema, the same streamed as whole."""
    import jsonschema

    config = EngineConfig(model=str(real_model_path), disk_cache=False, kv_mem="256MiB")
    history = [
        {"role": "user", "content": "What is the weather in Paris and then in Rome, in celsius?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"},
    ]  # fmt: skip
    with BackgroundServer(config) as s:
        c = ollama.Client(host=s.url, timeout=300)
        name = c.list().models[0].model
        opts = {"temperature": 0, "num_predict": 64}
        r = c.chat(model=name, messages=history, tools=[WEATHER], options=opts)
        assert r.message.tool_calls, r.message.content
        for call in r.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
        parts = list(c.chat(model=name, messages=history, tools=[WEATHER], options=opts, stream=True))
        calls = [call for p in parts for call in (p.message.tool_calls or [])]
        assert [(k.function.name, dict(k.function.arguments)) for k in calls] == [
            (k.function.name, dict(k.function.arguments)) for k in r.message.tool_calls
        ]
        assert "".join(p.message.content for p in parts) == r.message.content
