"""The soak of `localkv serve` (issue 35): N mixed requests (default 5,000) against a fresh server
on a loopback port: chat and completions, streamed and not, n 1-4, stop strings, JSON schemas,
log-probabilities, clients that drop mid-stream and bad bodies, in a seeded random order. After
a short warm-up that is not counted (the first grammar, the first fork), it measures:

- KV blocks held once the server is idle (the pool's used blocks from /metrics); target 0;
- the server's RSS after the first window of requests against its RSS at the end; target <= 5%;
- p99 time to first token (streamed requests, the client's clock) of the last window against
  the first; target <= 1.2x.

    python scripts/serve_soak.py [-m MODEL] [--requests 5000] [--window 1000] [--max-tokens 4]

Exit status 0 when every request is answered or refused as expected and the targets hold, 1 when
not. Bounded: every request has a timeout, the run a count.
"""

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np
import psutil
from serve_robustness import bad_request, dropped_request, idle_metrics

from localkv.bench.serve_load import localkv_server
from localkv.hub.resolve import resolve_model

TOPICS = ["the sea", "paged memory", "a lighthouse", "bread", "winter", "a red fox", "clocks", "rivers"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@dataclass(slots=True)
class Ask:
    """One planned request: its kind (ok, drop, bad), and for ok its path and body."""

    i: int
    kind: str
    path: str = ""
    body: dict | None = None


def plan(n: int, seed: int, max_tokens: int, drop_share: float, bad_share: float) -> list[Ask]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        if roll < drop_share:
            out.append(Ask(i, "drop"))
        elif roll < drop_share + bad_share:
            out.append(Ask(i, "bad"))
        else:
            out.append(Ask(i, "ok", *ok_body(rng, i, max_tokens)))
    return out


def ok_body(rng: random.Random, i: int, max_tokens: int) -> tuple[str, dict]:
    stop = rng.choice([".", ["\n", ","], [" the"]]) if rng.random() < 0.25 else None
    chat, topic, n, stream = rng.random() < 0.5, rng.choice(TOPICS), rng.randint(1, 4), rng.random() < 0.5
    return body(i, max_tokens, chat, topic, n, stream, stop, rng.random() < 0.15, rng.random() < 0.25)


def body(i: int, max_tokens: int, chat: bool, topic: str, n: int, stream: bool, stop, schema: bool, logprobs: bool):
    """A request's path and body."""
    out: dict = {"max_tokens": max_tokens, "seed": i, "n": n, "stream": stream}
    if chat:
        out["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
    else:
        out["prompt"] = f"A short note on {topic}:"
    if stop is not None:
        out["stop"] = stop
    if schema:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    if logprobs:
        out |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    return ("/v1/chat/completions" if chat else "/v1/completions"), out


def warmup(max_tokens: int) -> list[Ask]:
    """What compiles, builds or fills on first use happens before the count: every mix of chat,
    stream, schema and log-probabilities once (n=4, a stop string), every prompt once (its
    blocks in the prefix cache), a dropped client and a bad body."""
    mixes = [(c, st, "the sea", sc, lp) for c, st, sc, lp in itertools.product((True, False), repeat=4)]
    mixes += [(c, True, topic, False, False) for c in (True, False) for topic in TOPICS]
    seed = 1 << 20  # apart from the counted requests' seeds (0..N-1)
    out = [Ask(-1, "drop"), Ask(-2, "bad")]
    for k, (chat, stream, topic, schema, logprobs) in enumerate(mixes):
        out.append(Ask(-3 - k, "ok", *body(seed + k, max_tokens, chat, topic, 4, stream, ".", schema, logprobs)))
    return out


def check_choices(ask: Ask, choices: list[dict], chat: bool) -> str:
    """'' when the finished choices are what the body asked for, else what is wrong."""
    n = ask.body["n"]
    if sorted(c["index"] for c in choices) != list(range(n)):
        return f"choices {[c['index'] for c in choices]} for n={n}"
    for c in choices:
        if "logprobs" in ask.body and not c.get("logprobs"):
            return "no logprobs"
        text = c["message"]["content"] if chat else c["text"]
        if "response_format" in ask.body and c["finish_reason"] == "stop" and not isinstance(json.loads(text), dict):
            return f"schema answer is not an object: {text[:80]!r}"
    return ""


async def whole(c: httpx.AsyncClient, ask: Ask) -> tuple[str, float | None]:
    r = await c.post(ask.path, json=ask.body)
    if r.status_code != 200:
        return f"whole {r.status_code}: {r.text[:200]}", None
    wrong = check_choices(ask, r.json()["choices"], "messages" in ask.body)
    return (f"whole: {wrong}" if wrong else "ok"), None


async def streamed(c: httpx.AsyncClient, ask: Ask) -> tuple[str, float | None]:
    """A streamed answer: every choice finishes and [DONE] ends it; its time to first text."""
    chat, t0, ttft = "messages" in ask.body, time.perf_counter(), None
    ends: dict[int, dict] = {}
    async with c.stream("POST", ask.path, json=ask.body) as r:
        lines = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"stream error event: {event['error']}", None
            for ch in event.get("choices") or ():
                text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                if ch.get("finish_reason"):
                    ends[ch["index"]] = ch
        if r.status_code != 200 or not lines or lines[-1] != "[DONE]":
            return f"stream {r.status_code}: {lines[-1:]}", None
    n = ask.body["n"]
    return ("ok" if sorted(ends) == list(range(n)) else f"stream: finished {sorted(ends)} of n={n}"), ttft


async def one(c: httpx.AsyncClient, ask: Ask) -> tuple[str, float | None]:
    try:
        if ask.kind == "drop":
            return await dropped_request(c, ask.i), None
        if ask.kind == "bad":
            return await bad_request(c, ask.i), None
        return await (streamed(c, ask) if ask.body["stream"] else whole(c, ask))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return f"{ask.kind}: {type(e).__name__}: {e}", None


async def run(url: str, asks: list[Ask], concurrency: int) -> list[tuple[str, float | None]]:
    sem = asyncio.Semaphore(concurrency)

    async def bounded(c, ask):
        async with sem:
            return await one(c, ask)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as c:
        return list(await asyncio.gather(*(bounded(c, a) for a in asks)))


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--window", type=int, default=1000, help="requests in the first and last window")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--drop-share", type=float, default=0.05)
    ap.add_argument("--bad-share", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-mem", default="64MiB")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--max-ttft-ratio", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 0 < a.window <= a.requests // 2:
        ap.error(f"--window must be between 1 and half of --requests ({a.requests // 2})")
    warm, asks = warmup(a.max_tokens), plan(a.requests, a.seed, a.max_tokens, a.drop_share, a.bad_share)
    path = resolve_model(a.model, progress=False)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localkv-soak-") as home:
        server = localkv_server(path, a.threads, a.kv_mem, home).wait_ready()
        try:
            proc = psutil.Process(server.proc.pid)
            warm_got, got, rss = soak(server.url, proc, warm, asks, a)
            m = idle_metrics(server.url)
            rss["end"] = proc.memory_info().rss
            health = httpx.get(server.url + "/health", timeout=30).status_code
        finally:
            server.stop()
    return report(a, path.name, warm_got, asks, got, rss, m, health, time.perf_counter() - t0)


def soak(url: str, proc: psutil.Process, warm: list[Ask], asks: list[Ask], a) -> tuple[list, list, dict]:
    """The warm-up, then the counted requests in slices (a progress line each): the warm-up's
    outcomes, the counted ones', and the RSS after the first window."""
    warm_got = asyncio.run(run(url, warm, a.concurrency))
    got: list = []
    rss: dict = {}
    cuts = sorted({a.window, *range(0, a.requests, 500), a.requests} - {0})
    lo, t0 = 0, time.perf_counter()
    for hi in cuts:
        got += asyncio.run(run(url, asks[lo:hi], a.concurrency))
        lo = hi
        if hi == a.window:
            rss["warm"] = proc.memory_info().rss
        print(
            f"  {hi:>6} requests, {time.perf_counter() - t0:7.1f}s, RSS {proc.memory_info().rss / 2**20:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )
    return warm_got, got, rss


def report(
    a, model: str, warm_got: list, asks: list[Ask], got: list, rss: dict, m: dict, health: int, wall: float
) -> int:
    outcomes = Counter(g if g in ("ok", "dropped", "refused") else f"FAIL {g}" for g, _ in warm_got + got)
    first = [t for g, t in got[: a.window] if t is not None]
    last = [t for g, t in got[-a.window :] if t is not None]
    used = m.get('localkv_kv_blocks{state="used"}')
    growth = rss["end"] / rss["warm"] - 1
    ratio = p99(last) / p99(first)
    kinds = Counter(x.kind for x in asks)
    print(
        f"model: {model}; {len(asks)} requests ({kinds['drop']} dropped clients, {kinds['bad']} bad bodies) after "
        f"{len(warm_got)} warm-up, {a.concurrency} at a time, {a.max_tokens} tokens, server --threads {a.threads}; "
        f"{wall:.1f}s"
    )
    print(f"outcomes: {dict(outcomes)}")
    done, cancelled = (m.get(f'localkv_requests_total{{outcome="{k}"}}', 0) for k in ("completed", "cancelled"))
    cached = m.get('localkv_kv_blocks{state="cached"}')
    print(
        f"server: requests completed {done:.0f}, cancelled {cancelled:.0f}, "
        f"preemptions {m.get('localkv_preemptions_total', 0):.0f}, cached blocks {cached}"
    )
    print(f"blocks held after: {used}")
    print(
        f"RSS after {a.window} requests {rss['warm'] / 2**20:.1f} MiB, at the end {rss['end'] / 2**20:.1f} MiB "
        f"({growth:+.1%})"
    )
    print(
        f"p99 TTFT: first {a.window} {p99(first) * 1e3:.1f} ms ({len(first)} streamed), last {a.window} "
        f"{p99(last) * 1e3:.1f} ms ({len(last)} streamed): {ratio:.2f}x"
    )
    checks = {
        "every request answered or refused as expected": not any(k.startswith("FAIL") for k in outcomes),
        "0 KV blocks held once idle": used == 0,
        f"RSS growth after warm-up <= {a.max_rss_growth:.0%}": growth <= a.max_rss_growth,
        f"p99 TTFT last vs first window <= {a.max_ttft_ratio}x": ratio <= a.max_ttft_ratio,
        "server healthy after the run (/health 200)": health == 200,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
