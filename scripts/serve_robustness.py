"""The robustness run of `localkv serve` (issue 18): 1,000 requests, of which 100 clients drop
mid-stream and 50 send bad bodies, against a fresh server on a loopback port. Passes when every
request is answered (200) or refused with an OpenAI JSON error, no KV block is left held once
the server is idle (the pool's used blocks from /metrics: 0 means every ref count is back to
zero), and the server still answers /health and a last request.

    python scripts/serve_robustness.py [-m MODEL] [--requests 1000] [--dropped 100] [--bad 50]

Exit status 0 when it passes, 1 when not. Bounded: every request has a timeout, the loop a count.
"""

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

import httpx

from localkv.bench.report import LoadMeter, load_line
from localkv.bench.serve_load import localkv_server
from localkv.hub.resolve import resolve_model
from localkv.serve.metrics import parse

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
BAD_BODIES = [  # (body bytes, expected status)
    (b"{not json", 400),
    (b"", 400),
    (json.dumps([1, 2]).encode(), 400),
    (json.dumps({"messages": []}).encode(), 400),
    (json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(), 400),
    (json.dumps({"messages": MESSAGES, "max_tokens": 0}).encode(), 400),
    (json.dumps({"messages": MESSAGES, "n": 1000}).encode(), 400),
    (json.dumps({"messages": MESSAGES, "tools": [{"type": "function"}]}).encode(), 400),
    (json.dumps({"messages": MESSAGES, "model": "gpt-4o"}).encode(), 404),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400),
]


async def ok_request(c: httpx.AsyncClient, i: int, max_tokens: int) -> str:
    chat = i % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": max_tokens, "seed": i} | (
        {"messages": MESSAGES} if chat else {"prompt": f"Item {i}: the sea is"}
    )
    if i % 3 == 0:  # streamed
        async with c.stream("POST", path, json=body | {"stream": True}) as r:
            lines = [x async for x in r.aiter_lines() if x]
            if r.status_code != 200 or lines[-1] != "data: [DONE]":
                return f"stream {r.status_code}: {lines[-1:]}"
            return "ok"
    r = await c.post(path, json=body)
    if r.status_code != 200 or not r.json()["choices"]:
        return f"whole {r.status_code}: {r.text[:200]}"
    return "ok"


async def dropped_request(c: httpx.AsyncClient, i: int) -> str:
    body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"drop {r.status_code}"
        n = 0
        async for line in r.aiter_lines():
            n += bool(line)
            if n >= 1 + i % 3:
                break  # leaving the block closes the connection mid-stream
    return "dropped"


async def bad_request(c: httpx.AsyncClient, i: int) -> str:
    raw, status = BAD_BODIES[i % len(BAD_BODIES)]
    r = await c.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    try:
        err = r.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    return "refused" if r.status_code == status and shaped else f"bad {r.status_code}: {r.text[:200]}"


async def load(url: str, kinds: list[str], concurrency: int, max_tokens: int) -> Counter:
    sem = asyncio.Semaphore(concurrency)
    results: Counter = Counter()

    async def one(c, i, kind):
        async with sem:
            try:
                if kind == "ok":
                    got = await ok_request(c, i, max_tokens)
                elif kind == "drop":
                    got = await dropped_request(c, i)
                else:
                    got = await bad_request(c, i)
            except httpx.HTTPError as e:
                got = f"{kind}: {type(e).__name__}: {e}"
            results[got if got in ("ok", "dropped", "refused") else f"FAIL {got}"] += 1

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as c:
        await asyncio.gather(*(one(c, i, k) for i, k in enumerate(kinds)))
    return results


def idle_metrics(url: str, timeout: float = 120.0) -> dict:
    t_end = time.monotonic() + timeout
    while True:
        m = parse(httpx.get(url + "/metrics", timeout=30).text)
        if m.get("localkv_requests_running", 1) == 0 and m.get("localkv_requests_waiting", 1) == 0:
            return m
        if time.monotonic() > t_end:
            return m
        time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--dropped", type=int, default=100)
    ap.add_argument("--bad", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kv-mem", default="256MiB")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kinds = ["drop"] * a.dropped + ["bad"] * a.bad + ["ok"] * (a.requests - a.dropped - a.bad)
    random.Random(a.seed).shuffle(kinds)
    path = resolve_model(a.model, progress=False)
    t0, meter = time.perf_counter(), LoadMeter()
    with tempfile.TemporaryDirectory(prefix="localkv-robust-") as home:
        server = localkv_server(path, a.threads, a.kv_mem, home).wait_ready()
        try:
            results = asyncio.run(load(server.url, kinds, a.concurrency, a.max_tokens))
            m = idle_metrics(server.url)
            health = httpx.get(server.url + "/health", timeout=30).status_code
            last = httpx.post(server.url + "/v1/completions", json={"prompt": "last", "max_tokens": 4}, timeout=120)
        finally:
            server.stop()
    used = m.get('localkv_kv_blocks{state="used"}')
    cancelled = m.get('localkv_requests_total{outcome="cancelled"}', 0)
    failures = {k: v for k, v in results.items() if k.startswith("FAIL")}
    checks = {
        "every request answered or refused with a JSON error": not failures and sum(results.values()) == len(kinds),
        "0 KV blocks held once idle (every ref count zero)": used == 0,
        "server healthy after the run (/health 200, a last request 200)": health == 200 and last.status_code == 200,
    }
    print(
        f"model: {path.name}; {len(kinds)} requests ({a.dropped} dropped clients, {a.bad} bad bodies), "
        f"{a.concurrency} at a time, {a.max_tokens} tokens each; {time.perf_counter() - t0:.1f}s"
    )
    print(f"outcomes: {dict(results)}")
    cached = m.get('localkv_kv_blocks{state="cached"}')
    completed = m.get('localkv_requests_total{outcome="completed"}', 0)
    print(
        f"server: used blocks {used}, cached {cached}, requests completed {completed:.0f}, cancelled {cancelled:.0f}, "
        f"preemptions {m.get('localkv_preemptions_total', 0):.0f}"
    )
    print(f"load: {load_line(meter.hardware(a.threads))}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
