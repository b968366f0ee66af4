"""Tool calls through `localkv serve` with real clients: the openai package (whole, streamed,
named, auto) and the OpenAI Agents SDK driving a tool loop, on the real SmolLM2 (its template
has no tools: the generic form); the bad-input contract on the tiny model."""

import asyncio
import contextlib
import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest

from localkv.config import EngineConfig
from localkv.serve.server import BackgroundServer
from resources import script
from tiny_model import write_gguf

CHAT = "/v1/chat/completions"
SMOL = "SmolLM2-135M-Instruct.Q4_1"
RATES = script("tool_call_rates")  # the tools and questions the measurement script uses
SCHEMAS, TOOLS, PROMPTS, CITIES = RATES.SCHEMAS, RATES.TOOLS, RATES.PROMPTS, RATES.CITIES
ASK = [{"role": "user", "content": "What is the weather in Paris, France, in celsius?"}]


def assert_valid(calls) -> None:
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


# ------------------------------------------------------------------ bad input (tiny model)

NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
)


@pytest.fixture(scope="module")
def tiny_http(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("tools") / "tiny.gguf", ctx=4096)
    with serving(path) as c:
        yield c


@pytest.fixture(scope="module")
def no_system_http(tmp_path_factory):
    meta = {"tokenizer.chat_template": NO_SYSTEM}
    path = write_gguf(tmp_path_factory.mktemp("tools") / "nosys.gguf", ctx=1024, meta=meta)
    with serving(path) as c:
        yield c


@contextlib.contextmanager
def serving(path):
    with (
        BackgroundServer(EngineConfig(model=str(path), disk_cache=False, kv_mem="16MiB")) as s,
        httpx.Client(base_url=s.url, timeout=120) as c,
    ):
        yield c


def fn(name="f", parameters=None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD = [
    ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"type": "frobnicate"}}})]}, "tools[0]"),
    ({"tools": [fn(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})]}, "tools[0]"),
    ({"tools": [fn(name="no spaces")]}, "tools[0].function.name"),
    ({"tools": [fn(), fn()]}, "tools"),
    ({"tools": "f"}, "tools"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [fn()], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [fn()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [fn()], "response_format": {"type": "json_object"}}, "response_format"),
]
BAD_HISTORY = [
    ([{"role": "assistant", "content": None, "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}], "messages[1].tool_calls[0]"),
    ([{"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[1].tool_calls"),
]  # fmt: skip


def assert_one_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    assert err["param"] is not None and err["param"].startswith(param or "")


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_get_one_json_error(tiny_http, extra, param):
    assert_one_error(tiny_http.post(CHAT, json={"messages": ASK} | extra), 400, param)


@pytest.mark.parametrize("history,param", BAD_HISTORY, ids=[p for _, p in BAD_HISTORY])
def test_bad_tool_history_gets_one_json_error(tiny_http, history, param):
    assert_one_error(tiny_http.post(CHAT, json={"messages": ASK + history, "tools": [fn()]}), 400, param)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_template_that_cannot_take_tools_is_a_400(no_system_http, choice):
    r = no_system_http.post(CHAT, json={"messages": ASK, "tools": [fn()], "tool_choice": choice})
    assert_one_error(r, 400, "tools")
    assert "cannot take tools" in r.json()["error"]["message"]
    assert no_system_http.post(CHAT, json={"messages": ASK, "max_tokens": 2}).status_code == 200  # no tools: fine


def test_tools_on_the_tiny_model_call_by_the_grammar(tiny_http):
    """Random weights, but `required` still makes a call that parses and matches its schema."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 1000}
    body |= {"temperature": 0, "parallel_tool_calls": False}  # random weights would call on and on
    r = tiny_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    r = r.json()
    assert r["choices"][0]["finish_reason"] == "tool_calls", r
    for c in r["choices"][0]["message"]["tool_calls"]:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


def test_each_choice_streams_its_own_calls(tiny_http):
    """n=2 through the openai client's stream helper: each choice's calls, reassembled, are the
    whole reply's (seeded sampling: the two choices differ, each is reproducible)."""
    client = openai.OpenAI(base_url=str(tiny_http.base_url) + "/v1", api_key="none", max_retries=0)
    args = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2, "seed": 3}
    args |= {"max_tokens": 1000, "temperature": 0.7}
    whole = client.chat.completions.create(**args).choices
    with client.chat.completions.stream(**args) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion().choices
    assert len(whole) == len(streamed) == 2
    for w, st in zip(whole, streamed):
        assert st.finish_reason == w.finish_reason == "tool_calls"
        got = [(c.function.name, c.function.arguments) for c in st.message.tool_calls]
        assert got == [(c.function.name, c.function.arguments) for c in w.message.tool_calls]


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def smol(real_model_path):
    with BackgroundServer(EngineConfig(model=str(real_model_path), disk_cache=False, kv_mem="512MiB")) as s:
        yield s


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(client, **kw):
    args = {"model": SMOL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120} | kw
    return client.chat.completions.create(**args)


@pytest.mark.model
def test_required_makes_calls_that_validate(client):
    r = ask(client, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid(choice.message.tool_calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)


@pytest.mark.model
def test_a_named_choice_calls_that_function(client):
    r = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert_valid(calls)


@pytest.mark.model
def test_none_answers_in_text(client):
    r = ask(client, tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.model
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassembled_by_the_client_equal_the_whole_reply(client, choice):
    whole = ask(client, tool_choice=choice).choices[0]
    args = {"model": SMOL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    with client.chat.completions.stream(**args, tool_choice=choice) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert not streamed.message.content and not whole.message.content


@pytest.mark.model
def test_sampled_required_requests_all_parse_and_validate(client):
    """Issue 34's target on 24 requests (scripts/tool_call_rates.py runs the 100): sampled at
    temperature 0.8, each its own seed and question, every call parses and matches its schema."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        q = PROMPTS[i % len(PROMPTS)].format(c=CITIES[i // len(PROMPTS) % len(CITIES)])
        r = ask(client, messages=[{"role": "user", "content": q}], tool_choice="required", temperature=0.8, seed=i)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(24)))
    for c in choices:
        assert c.finish_reason == "tool_calls"
        assert_valid(c.message.tool_calls)


@pytest.mark.model
def test_auto_calls_the_model_emits_all_validate(client):
    """With `auto` the model chooses; after a first call and its result SmolLM2 calls again,
    through the lazy grammar: every call it emits parses and matches its schema."""
    replies = [
        ask(client, messages=RATES.after_a_call(i), tool_choice="auto", temperature=0.8, seed=i).choices[0]
        for i in range(6)
    ]
    calls = [c for r in replies for c in r.message.tool_calls or ()]
    assert calls and all(r.finish_reason == "tool_calls" for r in replies if r.message.tool_calls)
    assert_valid(calls)


# ------------------------------------------------------------------ a framework's tool loop


@pytest.mark.model
def test_an_agents_sdk_tool_loop_reuses_the_prefix(smol):
    """Five turns of the OpenAI Agents SDK: each a call, the tool's result, a final answer. The
    agent's hooks ask for a call first and for text once the tool has answered (SmolLM2 left
    to choose calls again and again). From turn 2 on, each prompt is an earlier one grown:
    >= 90% of the prompt tokens hit the prefix cache."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny and 21 C in {city}."

    class CallThenAnswer(agents.AgentHooks):
        async def on_start(self, context, agent):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="required")

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    client = openai.AsyncOpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=SMOL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=40),
        hooks=CallThenAnswer(),
        reset_tool_choice=False,
    )

    async def loop():
        history, turns = [], []
        for city in CITIES[:5]:
            result = await agents.Runner.run(agent, [*history, {"role": "user", "content": f"Weather in {city}?"}])
            assert isinstance(result.final_output, str) and result.final_output
            history = result.to_input_list()
            turns.append([r.usage for r in result.raw_responses])
        return turns

    turns = asyncio.run(loop())
    assert seen == CITIES[:5] and all(len(t) == 2 for t in turns)  # a call, then the answer, each turn
    later = [u for t in turns[1:] for u in t]
    prompt = sum(u.input_tokens for u in later)
    hit = sum(u.input_tokens_details.cached_tokens for u in later) / prompt
    print(f"prefix hit rate over turns 2..5: {hit:.3f} of {prompt} prompt tokens")
    assert hit >= 0.9
