"""`localkv bench serve`: the OpenAI server under load. N clients (8) each send a shared system
prompt (1,000 tokens of the GPL text) plus a distinct question (100 tokens) and stream 128
sampled tokens. Measured three ways, each on a fresh server (an empty prefix cache):

- localkv, all N at once (continuous batching, the system prompt computed once);
- localkv, the same requests one at a time (the first one's TTFT is "one request alone");
- with --vs llama.cpp, llama-cpp-python's own server (`python -m llama_cpp.server`), all N at once
  (it answers them one after another, reusing the previous prompt's KV for the shared prefix).

With --url, the first two runs go to that server instead (any OpenAI-compatible one: llama-server,
vLLM, SGLang, Ollama), the same bodies (EOS held off both ways: ignore_eos and min_tokens) with
the `model` it lists; the report has the same shape. The workload is cut by the local model's
tokenizer (-m), so the same text goes to every server. A third run replays conversations of
several turns, each opening with a document of its own (bench/fleet.py): its hit rate over turns
2..T is what a router in front of several nodes keeps of the prefix cache.

Reported per run: aggregate tokens/s (generated tokens over the wall time of the whole load),
TTFT and inter-token latency p50/p99 as the clients saw them, the prefix cache's hit rate over
requests 2..N, and from localkv's /metrics: the pool's K/V format, tokens per GiB in it, the peak
blocks and requests running at once (polled), preemptions. With a quantized --kv-dtype, the
clients-at-once run is also measured on an f16 pool of the same --kv-mem (a row of its own):
where f16 preempts, the quantized pool should not, and be faster. Runs are interleaved by rep.
"""

import asyncio
import os
import tempfile
from pathlib import Path

import httpx

from localkv.bench.fleet import conversations_row
from localkv.bench.options import Options, size_flag
from localkv.bench.report import Column, LoadMeter, Report, Target, median, ratio
from localkv.bench.serve_load import (
    Outcome,
    decode_tps,
    llama_cpp_server,
    localkv_server,
    percentile,
    run_load,
)
from localkv.bench.text import TEXT
from localkv.errors import LocalkvError, ModelError
from localkv.hub.resolve import resolve_model
from localkv.model.tokenizer import Tokenizer

FULL = dict(clients=8, system=1000, question=100, gen=128)
QUICK = dict(clients=4, system=64, question=16, gen=8)
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95)
TARGETS = dict(batching=3.0, vs_peer=2.0, hit_rate=0.95, ttft=4.0)

COLUMNS = [
    Column("engine", "engine", left=True),
    Column("load", "load", left=True),
    Column("kv_dtype", "K/V", left=True),
    Column("tokens_per_gib", "tokens/GiB", ","),
    Column("peak_running", "at once (peak)"),
    Column("preemptions", "preempted"),
    Column("decode_tps", "decode t/s", ".1f"),
    Column("tps", "all t/s", ".1f"),
    Column("ttft_p50", "TTFT p50 s", ".3f"),
    Column("ttft_p99", "TTFT p99 s", ".3f"),
    Column("itl_p50_ms", "ITL p50 ms", ".1f"),
    Column("itl_p99_ms", "ITL p99 ms", ".1f"),
    Column("hit_rate", "prefix hits 2..N", "%"),
    Column("peak_blocks", "peak blocks", ","),
    Column("wall_s", "wall s", ".2f"),
]


def run(o: Options) -> Report:
    meter = LoadMeter()
    size = QUICK if o.quick else FULL
    path = _tokenizer_model(o)
    threads = o.engine.threads or os.cpu_count() or 1
    tok = Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path)
    system, questions = workload(tok, size)
    n_sys = len(tok.encode(system))
    reps = o.reps or (1 if o.quick else 2)
    runs: dict[str, list[dict]] = {"burst": [], "serial": [], "peer": [], "f16": []}
    f16_too = not o.url and o.engine.kv_dtype not in ("auto", "f16")  # a quantized pool: f16's beside it
    served = served_model(o.url, o.engine.model) if o.url else None
    shown = Path(served).stem if served and served.lower().endswith(".gguf") else served  # a file's path: its name
    engine = f"{shown} at {o.url}" if o.url else "localkv"

    def measure(concurrent: bool, kv_dtype: str = o.engine.kv_dtype) -> dict:
        bodies = _bodies(system, questions, size, o.seed, model=served)
        if o.url:
            return _remote(o.url, bodies, concurrent) | {"system_tokens": n_sys}
        return _localkv(o, path, threads, bodies, concurrent, kv_dtype) | {"system_tokens": n_sys}

    for rep in range(reps):
        o.say(f"serve rep {rep + 1}/{reps}: {engine}, {size['clients']} clients at once")
        runs["burst"].append(measure(True))
        o.say(f"serve rep {rep + 1}/{reps}: {engine}, the same {size['clients']} requests one at a time")
        runs["serial"].append(measure(False))
        if f16_too:
            o.say(f"serve rep {rep + 1}/{reps}: {engine}, {size['clients']} clients at once, f16 K/V")
            runs["f16"].append(measure(True, "f16"))
        if o.vs:
            o.say(f"serve rep {rep + 1}/{reps}: llama-cpp-python's server, {size['clients']} clients at once")
            runs["peer"].append(_peer(path, threads, _bodies(system, questions, size, o.seed, peer=True)))
    rows = [_row(engine, f"{size['clients']} at once", runs["burst"])]
    rows.append(_row(engine, "one at a time", runs["serial"]))
    if runs["peer"]:
        rows.append(_row("llama-cpp-python server", f"{size['clients']} at once", runs["peer"]))
    if runs["f16"]:
        rows.append(_row(engine, f"{size['clients']} at once", runs["f16"]))
    if o.url:  # the multi-turn replay: behind a router, the fleet's hit rate
        o.say(f"serve: {engine}, conversations of several turns, each opening with its own document")
        rows.append({"engine": engine} | conversations_row(o.url, served, o.quick))
    rep = Report(
        "serve",
        f"OpenAI server under load: {size['clients']} streaming clients, a shared {n_sys}-token system prompt + a "
        f"distinct {size['question']}-token question each, {size['gen']} sampled tokens (temperature 0.8, top-k 40, "
        f"top-p 0.95, EOS ignored) per request; "
        + (f"every run on the one server at {o.url}" if o.url else "each run on a fresh server"),
        command=_command(o, threads),
        rows=rows,
        columns=list(COLUMNS),
    )
    rep.summary = _summary(rows, runs, reps)
    rep.targets = _targets(rows, runs, not o.quick)
    if runs["f16"]:
        rep.targets += _dtype_targets(rows[0], rows[-1], not o.quick)
    rep.notes = [
        "decode t/s: tokens after each request's first, over the time any request was decoding (the union of "
        "the spans first token -> end); all t/s: every generated token over the wall time of the whole load",
        "TTFT of one request alone: the first request of the one-at-a-time run (cold cache, as the burst's first)",
    ]
    if o.url:
        rep.notes.append(
            f"{o.url} is not restarted between runs: its prefix cache may hold the system prompt from the "
            "run before (the one-at-a-time TTFT is then warm); hit rates only where its usage reports cached tokens"
        )
    return meter.finish(rep, threads)


def _tokenizer_model(o: Options) -> Path:
    """The local model whose tokenizer cuts the workload: -m; with --url, -m may name a model only
    that server has, and the default model's tokenizer cuts it then."""
    try:
        return resolve_model(o.engine.model, progress=False)
    except ModelError:
        if not o.url:
            raise
        return resolve_model(None, progress=False)


def workload(tok: Tokenizer, size: dict) -> tuple[str, list[str]]:
    """The shared system prompt and one question per client, cut from the bench text by tokens."""
    ids = tok.encode(TEXT.read_text(), add_bos=False)
    system = tok.decode(ids[: size["system"]]).rstrip() + "\n\n"
    questions, at = [], size["system"]
    for i in range(size["clients"]):
        chunk = ids[at : at + size["question"] - 8]
        at += size["question"]
        questions.append(f"Question {i + 1}: what does this mean: {tok.decode(chunk).strip()}?\nAnswer:")
    return system, questions


def _bodies(
    system: str, questions: list[str], size: dict, seed: int, peer: bool = False, model: str | None = None
) -> list[dict]:
    out = []
    for i, q in enumerate(questions):
        body = {"prompt": system + q, "max_tokens": size["gen"], "seed": seed + i, **SAMPLING}
        # both sides generate exactly gen tokens: localkv ignores EOS, llama.cpp holds it off to min_tokens
        if peer:
            body["min_tokens"] = size["gen"]
        else:
            body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
        if model is not None:  # another server: its model's name, and both ways of holding EOS off
            body |= {"model": model, "min_tokens": size["gen"]}
        out.append(body)
    return out


def served_model(url: str, wanted: str | None) -> str:
    """The model name a server lists at /v1/models: -m's name (or its file's stem) when listed,
    else the only (or first) one; a LocalkvError when the server cannot be asked."""
    try:
        r = httpx.get(url + "/v1/models", timeout=30)
        ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise LocalkvError(f"--url {url}: no model list at {url}/v1/models ({type(e).__name__}: {e})") from None
    if not ids:
        raise LocalkvError(f"--url {url}: {url}/v1/models lists no model (status {r.status_code})")
    names = {wanted, Path(wanted).stem} if wanted else set()
    return next((i for i in ids if i in names), ids[0])


def _remote(url: str, bodies: list[dict], concurrent: bool) -> dict:
    try:
        outs, wall = asyncio.run(run_load(url, bodies, concurrent))
    except httpx.HTTPError as e:
        raise LocalkvError(f"--url {url}: {type(e).__name__}: {e}") from None
    _check(outs, url)
    _length_usage(outs, bodies)
    return {"outs": outs, "wall": wall, "peak": None, "metrics": {}}


def _localkv(o: Options, path: Path, threads: int, bodies: list[dict], concurrent: bool, kv_dtype: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="localkv-bench-serve-") as home:
        e = o.engine
        spec = ("--spec", e.spec, "--spec-max", str(e.spec_max)) if e.spec != "off" else ()
        spec += ("--draft-model", e.draft_model) if e.draft_model else ()
        extra = ("--kv-dtype", kv_dtype, *spec)
        server = localkv_server(path, threads, size_flag(e.kv_mem), home, extra).wait_ready()
        try:
            peak = {"used": 0, "shared": 0, "running": 0}
            outs, wall = asyncio.run(run_load(server.url, bodies, concurrent, watch=_watcher(server.url, peak)))
            final = _metrics(server.url)
        finally:
            server.stop()
    _check(outs, " ".join(server.cmd[1:4]))
    return {"outs": outs, "wall": wall, "peak": peak, "metrics": final}


def _peer(path: Path, threads: int, bodies: list[dict]) -> dict:
    server = llama_cpp_server(path, threads, n_ctx=2048).wait_ready()
    try:
        outs, wall = asyncio.run(run_load(server.url, bodies, True))
    finally:
        server.stop()
    _check(outs, " ".join(server.cmd[1:4]))
    _length_usage(outs, bodies)
    return {"outs": outs, "wall": wall, "peak": None, "metrics": {}}


def _length_usage(outs: list[Outcome], bodies: list[dict]):
    """A stream without usage (llama-cpp-python's): a reply cut by length has max_tokens tokens
    (counting its chunks would not do: a chunk may carry two tokens of one character)."""
    for o, b in zip(outs, bodies):
        if not o.usage and o.finish == "length":
            o.usage = {"completion_tokens": b["max_tokens"]}


def _check(outs: list[Outcome], where: str):
    bad = [o for o in outs if o.status != 200 or not o.chunks]
    if bad:
        raise LocalkvError(f"{len(bad)} requests failed on {where}: {bad[0].status} {bad[0].error}")


def _watcher(url: str, peak: dict):
    async def watch(client: httpx.AsyncClient):
        from localkv.serve.metrics import parse

        while True:
            m = parse((await client.get(url + "/metrics")).text)
            peak["used"] = max(peak["used"], int(m.get('localkv_kv_blocks{state="used"}', 0)))
            peak["shared"] = max(peak["shared"], int(m.get('localkv_kv_blocks{state="shared"}', 0)))
            peak["running"] = max(peak["running"], int(m.get("localkv_requests_running", 0)))
            await asyncio.sleep(0.1)

    return watch


def _metrics(url: str) -> dict:
    from localkv.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=30).text)


def _row(engine: str, load: str, runs: list[dict]) -> dict:
    """Medians over reps of each run's numbers."""

    def per_run(fn):
        vals = [fn(r) for r in runs]
        return median([v for v in vals if v is not None])

    kv = _kv_format(runs[-1]["metrics"])
    return {
        "engine": engine,
        "load": load,
        "kv_dtype": kv[0] if kv else None,
        "tokens_per_gib": (1 << 30) // kv[1] if kv else None,
        "peak_running": per_run(_peak_running),
        "decode_tps": per_run(lambda r: decode_tps(r["outs"])),
        "tps": per_run(lambda r: sum(o.tokens for o in r["outs"]) / r["wall"]),
        "ttft_p50": per_run(lambda r: percentile([o.ttft for o in r["outs"]], 50)),
        "ttft_p99": per_run(lambda r: percentile([o.ttft for o in r["outs"]], 99)),
        "ttft_first": per_run(lambda r: r["outs"][0].ttft),
        "itl_p50_ms": per_run(lambda r: _ms(percentile([g for o in r["outs"] for g in o.gaps], 50))),
        "itl_p99_ms": per_run(lambda r: _ms(percentile([g for o in r["outs"] for g in o.gaps], 99))),
        "hit_rate": per_run(_hit_rate),
        "peak_blocks": per_run(lambda r: r["peak"]["used"] if r["peak"] else None),
        "peak_shared_blocks": per_run(lambda r: r["peak"]["shared"] if r["peak"] else None),
        "wall_s": per_run(lambda r: r["wall"]),
        "tokens": sum(o.tokens for o in runs[-1]["outs"]),
        "preemptions": per_run(lambda r: r["metrics"].get("localkv_preemptions_total")),
    }


def _peak_running(run: dict) -> int | None:
    """Most requests a localkv server ran at once: its /metrics' peak, or more streaming at once."""
    return max(run["peak"]["running"], _streaming_at_once(run["outs"])) if run["peak"] else None


def _streaming_at_once(outs: list[Outcome]) -> int:
    """Most requests streaming at one time, from their first text to their last, as their
    clients saw them: the server ran at least so many at once (requests shorter than the
    watcher's polls pass between two of them)."""
    edges = sorted([(o.start + o.ttft, 1) for o in outs] + [(o.start + o.total, -1) for o in outs])
    now = most = 0
    for _, step in edges:  # at a tie, an end before a start
        now += step
        most = max(most, now)
    return most


def _kv_format(metrics: dict) -> tuple[str, int] | None:
    """(--kv-dtype, bytes per token) of a localkv server's pool from its /metrics."""
    for key, value in metrics.items():
        if key.startswith('localkv_kv_bytes_per_token{dtype="'):
            return key.split('"')[1], int(value)
    return None


def _dtype_targets(quant: dict, f16: dict, full: bool) -> list[Target]:
    """The quantized pool against f16's at the same --kv-mem, judged where f16 preempts (else
    the memory is not the limit and the targets are not measured)."""
    p, p16 = quant["preemptions"], f16["preemptions"]
    x = ratio(quant["tps"], f16["tps"])
    judged = full and p is not None and bool(p16)
    name = quant["kv_dtype"]
    return [
        Target(
            f"preemptions at once, {name} vs f16 K/V at this --kv-mem",
            f"{p:g} vs {p16:g}" if p is not None and p16 is not None else "n/a",
            "fewer, where f16 preempts",
            (p < p16) if judged else None,
        ),
        Target(
            f"aggregate t/s at once, {name} vs f16 K/V at this --kv-mem",
            _x(x),
            ">= 1.2x, where f16 preempts",
            (x is not None and x >= 1.2) if judged else None,
        ),
    ]


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000


def _hit_rate(run: dict) -> float | None:
    """Cached prompt tokens of requests 2..N over their system prompt's tokens (the request that
    computed the prompt is the one with the fewest cached tokens); None from a server whose usage
    does not say."""
    if not any("prompt_tokens_details" in o.usage for o in run["outs"]):
        return None
    outs = sorted(run["outs"], key=lambda o: o.cached)[1:]
    return sum(o.cached for o in outs) / (len(outs) * run["system_tokens"]) if outs else None


def _summary(rows: list[dict], runs: dict, reps: int) -> dict:
    burst, serial = rows[0], rows[1]
    s = {
        "reps": reps,
        "decode_speedup_at_once": ratio(burst["decode_tps"], serial["decode_tps"]),
        "all_tps_speedup_at_once": ratio(burst["tps"], serial["tps"]),
        "ttft_one_alone_s": serial["ttft_first"],
        "ttft_p99_vs_alone": ratio(burst["ttft_p99"], serial["ttft_first"]),
        "peak_shared_blocks": burst["peak_shared_blocks"],
        "preemptions": burst["preemptions"],
    }
    if runs["peer"]:  # rows[2]: llama-cpp-python's server
        s["all_tps_vs_llama_cpp_server"] = ratio(burst["tps"], rows[2]["tps"])
        s["decode_tps_vs_llama_cpp_server"] = ratio(burst["decode_tps"], rows[2]["decode_tps"])
    return s


def _targets(rows: list[dict], runs: dict, full: bool) -> list[Target]:
    burst, serial = rows[0], rows[1]
    x = ratio(burst["decode_tps"], serial["decode_tps"])
    peer = ratio(burst["tps"], rows[2]["tps"]) if runs["peer"] else None
    hit, ttft = burst["hit_rate"], ratio(burst["ttft_p99"], serial["ttft_first"])

    def judged(ok):
        return ok if full else None

    t = TARGETS
    return [
        Target(
            "aggregate decode t/s, clients at once vs one at a time",
            _x(x),
            f">= {t['batching']:g}x",
            judged(x is not None and x >= t["batching"]),
        ),
        Target(
            "aggregate t/s vs llama-cpp-python's server, same load",
            _x(peer),
            f">= {t['vs_peer']:g}x",
            judged(peer >= t["vs_peer"]) if peer is not None else None,
        ),
        Target(
            "prefix hit rate over requests 2..N (share of the system prompt's tokens)",
            "n/a" if hit is None else f"{hit * 100:.1f}%",
            f">= {t['hit_rate'] * 100:.0f}%",
            judged(hit is not None and hit >= t["hit_rate"]),
        ),
        Target(
            "p99 TTFT of the clients at once vs one request alone",
            _x(ttft),
            f"<= {t['ttft']:g}x",
            judged(ttft is not None and ttft <= t["ttft"]),
        ),
    ]


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _command(o: Options, threads: int) -> str:
    cmd = o.command("serve", threads)
    if o.vs and "--vs" not in cmd:
        cmd += f" --vs {o.vs}"
    if o.reps and " -r " not in cmd:
        cmd += f" -r {o.reps}"
    return cmd
