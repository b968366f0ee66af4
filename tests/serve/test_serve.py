"""`localkv serve` with real clients (the openai package, httpx) against a server on a free
loopback port: answers, streams, shared blocks, stop strings, seeds, concurrency, dropped
clients (no leaked block), bad bodies, preemption on a small pool, the CLI."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from localkv.config import EngineConfig, ServeOptions
from localkv.serve.metrics import parse
from localkv.serve.runner import Runner
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf

KEY = "test-key"
RNG = np.random.default_rng(11)
LONG = 8000  # tokens: a reply that is still being generated while the test looks (the tiny model's context: 8,192)
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", ctx=8192)


def config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), disk_cache=False, kv_mem=kw.pop("kv_mem", "32MiB"), **kw)


@pytest.fixture(scope="module")
def server(tiny):
    with BackgroundServer(config(tiny), ServeOptions(port=0, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def on_engine(server, fn):
    """fn() on the engine's thread, between steps."""
    return server.runner.call(fn).result(timeout=120)


def settle(server):
    """Wait until the scheduler has nothing left (cancels are taken at its next step)."""
    deadline = time.monotonic() + 60  # a bound on the wait, not a timing check
    while time.monotonic() < deadline:
        if not on_engine(server, lambda: server.runner.scheduler.busy):
            return
        time.sleep(0.01)
    raise AssertionError("the server never went idle")


def assert_no_leak(server):
    settle(server)

    def check():
        pool = server.runner.engine.pool
        pool.check([])  # free queue in sync with ref counts, cached hashes consistent
        return pool.num_free, pool.num_blocks, [b.id for b in pool.blocks if b.ref_count]

    free, total, held = on_engine(server, check)
    assert held == [] and free == total


def metric(http, key: str) -> float:
    return parse(http.get("/metrics").text).get(key, 0.0)


def random_prompt(n: int) -> list[int]:
    return RNG.integers(3, 261, n).tolist()


# ------------------------------------------------------------------ answers


def test_chat_answer_has_openai_shape_and_usage(client, server):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny" and len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 8
    again = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == c.message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the prompt's full blocks came from the cache
    assert_no_leak(server)


def test_stream_gives_the_same_text_as_the_whole_answer(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_sse_ends_with_done(http):
    body = {"messages": HELLO, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_completions_whole_streamed_and_batched_prompts(client, http):
    r = client.completions.create(model="tiny", prompt="once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1 and r.usage.completion_tokens <= 6
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="once upon a time", max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == r.choices[0].text
    many = http.post(
        "/v1/completions",
        json={"prompt": [random_prompt(3), random_prompt(20)], "n": 2, "max_tokens": 4, "temperature": 0},
    )
    assert many.status_code == 200, many.text
    choices = many.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]  # greedy
    assert many.json()["usage"]["prompt_tokens"] == 3 + 20


def test_models_and_health(server, http):
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert http.get("/v1/models/tiny").status_code == 200
    bare = httpx.get(server.url + "/health")  # no key needed
    assert bare.status_code == 200 and bare.json()["status"] == "ok"


# ------------------------------------------------------------------ sharing, stops, seeds


def test_n_choices_share_the_prompts_blocks(http, server):
    prompt = random_prompt(100)  # six full blocks and a partly filled one, shared by the forks
    cow0 = metric(http, "localkv_cow_copies_total")
    body = {
        "prompt": prompt,
        "n": 4,
        "max_tokens": LONG,
        "temperature": 1,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: {"))  # the forks exist once text flows
        during = parse(http.get("/metrics").text)
    assert during['localkv_kv_blocks{state="shared"}'] >= 6
    assert metric(http, "localkv_cow_copies_total") - cow0 >= 3  # each fork's first write copied the shared tail
    whole = http.post("/v1/completions", json=body | {"stream": False, "max_tokens": 12}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["completion_tokens"] == 48 and whole["usage"]["prompt_tokens"] == 100
    assert_no_leak(server)


def test_stop_strings_end_the_reply_before_them(http):
    base = {"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 1, "seed": 5, "ignore_eos": True}
    full = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    cut = next((i for i in range(3, len(full) - 3) if full[i : i + 2].isascii() and full[i : i + 2].strip()), None)
    if cut is None:
        pytest.skip(f"the tiny model's greedy text has no plain two-character stop to pick: {full!r}")
    stop = full[cut : cut + 2]
    got = http.post("/v1/completions", json=base | {"stop": [stop, "never-there"]}).json()["choices"][0]
    assert got["text"] == full[: full.index(stop)] and got["finish_reason"] == "stop"


def test_a_seed_reproduces_a_sampled_reply(client):
    kw = dict(model="tiny", prompt="seeds", max_tokens=32, temperature=1.5, top_p=1.0, extra_body={"top_k": 0})
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    c = client.completions.create(**kw, seed=8).choices[0].text
    assert a == b and a != c


def test_logprobs(client, http):
    r = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)  # greedy: the top
    chunks = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    legacy = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "logprobs": 2, "ignore_eos": True})
    lp = legacy.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"][0] == 0


def test_response_format_constrains_the_reply(client, http):
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, response_format=fmt, seed=1)
    assert json.loads(r.choices[0].message.content)["a"] in ("x", "y") and r.choices[0].finish_reason == "stop"
    broken = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    refused = http.post(CHAT, json={"messages": HELLO, "response_format": broken})
    assert refused.status_code == 400 and "schema" in refused.json()["error"]["message"]


# ------------------------------------------------------------------ many clients


def test_16_concurrent_streams_get_what_they_get_alone(client, server):
    prompts = [[{"role": "user", "content": f"question number {i}: " + "why " * (i % 5)}] for i in range(16)]
    kw = dict(model="tiny", max_tokens=20, temperature=0)
    alone = [client.chat.completions.create(messages=m, **kw).choices[0].message.content for m in prompts]
    got: dict[int, str] = {}

    def stream(i):
        parts = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(messages=prompts[i], **kw, stream=True)
            if c.choices
        ]
        got[i] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(16)] == alone
    assert_no_leak(server)


def test_dropped_clients_leave_no_block_behind(server, http):
    cancelled0 = metric(http, 'localkv_requests_total{outcome="cancelled"}')
    body = {"max_tokens": LONG, "ignore_eos": True, "stream": True}

    def drop(i):
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            if i % 5 == 4:  # a whole-answer client that gives up waiting
                with pytest.raises(httpx.ReadTimeout):  # the request went out whole; its answer is never read
                    body_whole = body | {"prompt": random_prompt(30), "stream": False}
                    c.post("/v1/completions", json=body_whole, timeout=httpx.Timeout(60, read=0.3))
                return
            with c.stream("POST", "/v1/completions", json=body | {"prompt": random_prompt(20 + i)}) as r:
                lines = r.iter_lines()
                for _ in range(1 + i % 3):
                    next(lines)

    threads = [threading.Thread(target=drop, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert_no_leak(server)
    assert metric(http, 'localkv_requests_total{outcome="cancelled"}') - cancelled0 == 50
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------ refusals

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD = [  # path, body, status, param
    (CHAT, b"{not json", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b"\xff\xfe", 400, None),
    (CHAT, [1, 2], 400, None),
    (CHAT, {"model": "tiny"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "temperature": 3}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": HELLO, "top_k": -1}, 400, "top_k"),
    (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 1.5}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_completion_tokens"),
    (CHAT, {"messages": HELLO, "n": 0}, 400, "n"),
    (CHAT, {"messages": HELLO, "n": 1000}, 400, "n"),
    (CHAT, {"messages": HELLO, "seed": -1}, 400, "seed"),
    (CHAT, {"messages": HELLO, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": HELLO, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": HELLO, "presence_penalty": 9}, 400, "presence_penalty"),
    (CHAT, {"messages": HELLO, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"messages": HELLO, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": HELLO, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": HELLO, "model": "gpt-4o"}, 404, "model"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [5, 99999]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, None),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": [5] * 8200}, 400, "prompt"),  # past the 8,192-token context
    (COMPLETIONS, {"prompt": "hi", "n": 100, "max_tokens": 2000}, 413, "max_tokens"),  # more than the whole pool
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_bodies_get_openai_errors(http, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_errors_of_the_protocol(server, http, client):
    assert http.post(CHAT, content=b"x" * (17 << 20)).status_code == 413
    assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
    assert http.get(CHAT).status_code == 405
    if_wrong = httpx.post(server.url + CHAT, json={"messages": HELLO}, headers={"Authorization": "Bearer nope"})
    assert if_wrong.status_code == 401 and if_wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=[5] * 8200)


def test_a_full_server_answers_429(tiny):
    with BackgroundServer(config(tiny), ServeOptions(port=0, max_seqs=1, max_queue=0)) as s:
        gate = threading.Event()
        s.runner.call(gate.wait)  # hold the engine between two steps: the first request stays in flight
        first = {}
        asker = threading.Thread(
            target=lambda: first.update(r=httpx.post(s.url + COMPLETIONS, json={"prompt": "a", "max_tokens": 2}))
        )
        asker.start()
        for _ in range(1000):
            if s.runner.in_flight:
                break
            time.sleep(0.01)
        refused = httpx.post(s.url + COMPLETIONS, json={"prompt": "b"})
        gate.set()
        asker.join(60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_busy"
        assert refused.headers["retry-after"] == "1"
        assert first["r"].status_code == 200
        assert httpx.post(s.url + COMPLETIONS, json={"prompt": "b", "max_tokens": 2}).status_code == 200
        assert_no_leak(s)


class GatedRunner(Runner):
    """A runner whose model loads only when the test opens the gate."""

    gate = threading.Event()

    def make_engine(self, cfg):
        if not self.gate.wait(60):
            raise RuntimeError("the test never opened the gate")
        return super().make_engine(cfg)


def test_health_is_503_while_loading_and_when_the_model_failed(tiny, tmp_path):
    GatedRunner.gate.clear()
    with BackgroundServer(config(tiny), wait=False, runner=GatedRunner) as s:
        for _ in range(500):
            if s.runner.state == "loading" and s.server.started:
                break
            time.sleep(0.01)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        assert httpx.post(s.url + CHAT, json={"messages": HELLO}).json()["error"]["code"] == "model_loading"
        assert parse(httpx.get(s.url + "/metrics").text)["localkv_up"] == 0
        GatedRunner.gate.set()
        s.wait_ready()
        assert httpx.get(s.url + "/health").status_code == 200
    with BackgroundServer(config(tmp_path / "missing.gguf"), wait=False) as s:
        for _ in range(500):
            if s.runner.state == "failed":
                break
            time.sleep(0.01)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "missing.gguf" in h.json()["error"]["message"]


# ------------------------------------------------------------------ a failed step


def test_a_failed_step_answers_with_an_error_and_the_server_keeps_serving(tiny, monkeypatch):
    with BackgroundServer(config(tiny)) as s:
        logged, armed, real = [], threading.Event(), s.runner.engine.step
        s.runner.log = logged.append

        def step(*args, **kw):
            if armed.is_set():
                armed.clear()
                raise RuntimeError("a broken step")
            return real(*args, **kw)

        monkeypatch.setattr(s.runner.engine, "step", step)
        body = {"prompt": random_prompt(20), "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + COMPLETIONS, json=body, timeout=60) as r:
            lines = (x for x in r.iter_lines() if x)
            for _ in range(3):  # a few tokens are streamed before the step breaks
                assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"] is not None
            armed.set()
            rest = list(lines)  # the stream ends cleanly: no broken connection
        assert rest[-1] == "data: [DONE]", rest[-3:]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_error" and "a broken step" in error["message"]
        assert not any('"finish_reason":"' in x for x in rest)  # an error, not a finished answer
        armed.set()
        whole = httpx.post(s.url + COMPLETIONS, json=body | {"stream": False, "max_tokens": 8}, timeout=60)
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "server_error", whole.text
        assert sum("a step failed" in m for m in logged) == 2
        after = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert after.completions.create(model="tiny", prompt="again", max_tokens=4).usage.completion_tokens >= 1
        assert parse(httpx.get(s.url + "/metrics").text)['localkv_requests_total{outcome="error"}'] == 2
        assert_no_leak(s)


# ------------------------------------------------------------------ a small pool


def test_a_small_pool_preempts_and_every_request_completes(tiny):
    # 24 blocks of 16 tokens; six requests of 64 + 48 tokens need 7 blocks each
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers, block, kv heads, head dim, fp32; K and V
    cfg = config(tiny, kv_mem=24 * per_block, prefix_cache=False, kv_dtype="f32")
    prompts = [random_prompt(64) for _ in range(6)]
    body = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with BackgroundServer(cfg) as s:
        assert s.runner.engine.pool.num_blocks == 24
        alone = [httpx.post(s.url + COMPLETIONS, json=body | {"prompt": p}, timeout=60).json() for p in prompts]
        got: dict[int, dict] = {}

        def ask(i):
            got[i] = httpx.post(s.url + COMPLETIONS, json=body | {"prompt": prompts[i]}, timeout=120).json()

        gate = threading.Event()
        s.runner.call(gate.wait)  # hold the engine until all six are in: they then compete for the pool
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for _ in range(6000):  # a loaded machine tokenizes slowly
            if s.runner.in_flight == 6:
                break
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(120)
        assert parse(httpx.get(s.url + "/metrics").text)["localkv_preemptions_total"] > 0
        for i in range(6):
            assert got[i]["choices"][0]["finish_reason"] == "length" and got[i]["usage"]["completion_tokens"] == 48
            assert got[i]["choices"][0]["text"] == alone[i]["choices"][0]["text"]  # recomputed, not changed
        assert_no_leak(s)


# ------------------------------------------------------------------ the command


def test_localkv_serve_command(tiny, tmp_path):
    env = os.environ | {"LOCALKV_API_KEY": ""}
    cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(tiny), "--port", "0", "--kv-mem", "8MiB"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ")[1].split()[0]
        for _ in range(600):
            if httpx.get(url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        r = httpx.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.stderr.close()
    bad = subprocess.run(
        [*cmd[:5], str(tmp_path / "nope.gguf"), "--port", "0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = subprocess.run([*cmd[:6], "--port", port], capture_output=True, text=True, timeout=60, env=env)
    assert busy.returncode == 1 and "cannot listen on 127.0.0.1:" + port in busy.stderr
    for flag, value in (("--batch-tokens", "0"), ("--max-seqs", "0"), ("--max-queue", "-1")):
        r = subprocess.run([*cmd, flag, value], capture_output=True, text=True, timeout=60, env=env)
        least = int(flag != "--max-queue")
        assert r.returncode == 1 and r.stderr.strip() == f"error: invalid {flag} {value}: must be >= {least}"


# ------------------------------------------------------------------ the real model


@pytest.mark.model
def test_real_model_answers_a_chat(real_model_path):
    with BackgroundServer(EngineConfig(model=str(real_model_path), disk_cache=False, kv_mem="256MiB")) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in r.choices[0].message.content
        assert r.usage.prompt_tokens > 10
