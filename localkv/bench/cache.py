"""`localkv bench cache`: time to first token of a long system prompt + a short user turn, each in
a new process (child_ttft.py; llama.cpp's: child_ttft_peer.py): cold, then warm from the disk
cache; and the prefix hit rate over a scripted chat in one engine."""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from localkv import next_turn, reasoning
from localkv.bench.options import Options
from localkv.bench.peer import peer_env
from localkv.bench.report import Column, LoadMeter, Report, Target, median, ratio
from localkv.bench.text import text_ids
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.generation import Generation
from localkv.sampling import SamplingParams

SYSTEM_HEAD = "You answer questions about the license below. Quote it when you can.\n\n"
QUESTIONS = [
    "What does this license let me do?",
    "Can I sell copies?",
    "What is a covered work?",
    "Must I share my source code?",
    "What about patents?",
    "Can I add terms?",
    "What happens if I break it?",
    "Does it cover web services?",
    "Is there a warranty?",
    "How do I apply it to my program?",
]
THINK_BUDGET = 32  # thinking tokens per reply of a thinking model in the scripted chat
CACHE_FULL = dict(system=2000, turns=10, reply=24)
CACHE_QUICK = dict(system=64, turns=3, reply=4)
CHILD_TIMEOUT = 900
PEER_CACHE_BYTES = 2 << 30  # LlamaDiskCache's capacity

COLUMNS = [
    Column("engine", "engine", left=True),
    Column("condition", "condition", left=True),
    Column("prompt_tokens", "prompt"),
    Column("cached_tokens", "from cache"),
    Column("ttft_s", "TTFT s", ".3f"),
    Column("speedup_vs_our_cold", "vs our cold", "x"),
    Column("load_s", "model load s", ".2f"),
    Column("disk_bytes", "bytes on disk", ","),
]
CHAT_COLUMNS = [
    Column("turn", "turn"),
    Column("prompt_tokens", "prompt"),
    Column("hit_tokens", "hits"),
    Column("reusable_tokens", "reusable"),
    Column("hit_rate", "hit rate", "%"),
    Column("ttft_s", "TTFT s", ".3f"),
    Column("reasoning_tokens", "thinking"),
    Column("warmed_tokens", "warmed after"),
    Column("warm_s", "warm s", ".3f"),
]


def run(o: Options) -> Report:
    meter = LoadMeter()
    size = CACHE_QUICK if o.quick else CACHE_FULL
    eng = o.new_engine(prefix_cache=True)  # the chat below; its pool starts empty
    system = system_text(eng, size["system"])
    fill = chat_ids(eng, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}])
    warm = chat_ids(eng, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[1]}])
    for ids in (fill, warm):
        eng.check_fits(len(ids), 1)
    reps = o.reps or (1 if o.quick else 3)  # medians of 3: one rep alone moves with the machine's load
    rows = ttft_rows(*measure_ttft(o, eng, fill, warm, reps))
    chat_rows = chat(eng, system, size["turns"], size["reply"], o)
    rep = Report(
        "cache",
        f"time to first token for a {size['system']}-token system prompt + a short user turn, "
        "each in a new process: cold, then warm from the disk cache (another user turn, same "
        "system prompt)"
        + (", localkv and llama.cpp (LlamaDiskCache)" if o.vs else "")
        + f"; prefix hit rate over a scripted {size['turns']}-turn chat",
        command=o.command("cache", eng.threads),
        rows=rows,
        columns=list(COLUMNS),
    )
    rep.more = [("chat", list(CHAT_COLUMNS), chat_rows)]
    rep.summary = _summary(len(warm), chat_rows)
    rep.targets = _targets(rows, full=size is CACHE_FULL)
    rep.notes = _notes(o, size["reply"])
    return meter.finish(rep, eng.threads)


def system_text(engine: Engine, n_tokens: int) -> str:
    """A system prompt of about n_tokens: an instruction and the start of the GPL-3.0 text."""
    head = len(engine.tokenizer.encode(SYSTEM_HEAD))
    return SYSTEM_HEAD + engine.tokenizer.decode(text_ids(engine, max(1, n_tokens - head)))


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True))


# ------------------------------------------------------------------ TTFT in new processes


def measure_ttft(o: Options, eng: Engine, fill: list[int], warm: list[int], reps: int) -> tuple[dict, dict]:
    """reps rounds of: ours cold (fills a fresh disk cache), theirs cold, ours warm, theirs warm,
    each a new process. Returns {(engine, condition): [child answers]} and {engine: [bytes the
    cold run wrote]}."""
    local = {"config": replace(eng.config, model=str(eng.path), threads=eng.threads, disk_cache=True).to_dict()}
    n_ctx = -(-(max(len(fill), len(warm)) + 16) // 256) * 256
    peer = {"model": str(eng.path), "n_ctx": n_ctx, "threads": eng.threads, "capacity": PEER_CACHE_BYTES}
    steps = [("localkv", "cold", fill), ("llama.cpp", "cold", fill), ("localkv", "warm disk", warm)]
    steps += [("llama.cpp", "warm disk", warm)]
    res: dict[tuple[str, str], list[dict]] = {}
    sizes: dict[str, list[int]] = {"localkv": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory(prefix="localkv-bench-cache-") as tmp:
        for i in range(reps):
            home, pdir = Path(tmp) / f"home-{i}", Path(tmp) / f"llama-cache-{i}"
            env = {**os.environ, "LOCALKV_HOME": str(home)}
            for engine, cond, ids in steps:
                if engine == "llama.cpp" and not o.vs:
                    continue
                o.say(f"cache {engine} {cond} rep {i + 1}/{reps}: new process, {len(ids)}-token prompt")
                if engine == "localkv":
                    out = _child("localkv.bench.child_ttft", local | {"ids": ids}, env, f"localkv {cond}")
                else:
                    req = peer | {"ids": ids, "cache_dir": str(pdir)}
                    out = _child("localkv.bench.child_ttft_peer", req, peer_env(), f"llama.cpp {cond}")
                res.setdefault((engine, cond), []).append(out)
                if cond == "cold":  # what the warm run will read
                    sizes[engine].append(_dir_bytes(home / "kvcache" if engine == "localkv" else pdir))
    return res, sizes


def _child(module: str, request: dict, env: dict | None, what: str) -> dict:
    try:
        p = subprocess.run(
            [sys.executable, "-m", module],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
            timeout=CHILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        raise LocalkvError(f"cache bench: the {what} process took over {CHILD_TIMEOUT}s and was stopped") from None
    if p.returncode != 0:
        tail = "; ".join(p.stderr.strip().splitlines()[-3:])
        raise LocalkvError(f"cache bench: the {what} process failed (exit {p.returncode}): {tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def ttft_rows(res: dict, sizes: dict) -> list[dict]:
    """One row per (engine, condition): medians over the reps."""
    rows = [
        {
            "engine": engine,
            "condition": cond,
            "prompt_tokens": outs[-1]["prompt_tokens"],
            "cached_tokens": outs[-1].get("cached_tokens"),
            "ttft_s": median([x["ttft_s"] for x in outs]),
            "load_s": median([x["load_s"] for x in outs]),
            "disk_bytes": median(sizes[engine]) if sizes[engine] else None,
        }
        for (engine, cond), outs in res.items()
    ]
    cold = _ttft(rows, "localkv", "cold")
    for r in rows:
        r["speedup_vs_our_cold"] = ratio(cold, r["ttft_s"])
    return rows


def _ttft(rows: list[dict], engine: str, cond: str) -> float | None:
    return next((r["ttft_s"] for r in rows if (r["engine"], r["condition"]) == (engine, cond)), None)


# ------------------------------------------------------------------ chat hit rate


def chat(eng: Engine, system: str, turns: int, reply: int, o: Options, warm: bool = True) -> list[dict]:
    """A scripted chat in one engine: each turn's prompt = system + all earlier turns + a new
    question; its prefix hits against what a perfect cache could reuse. A thinking model thinks
    THINK_BUDGET tokens each turn. After each reply the next turn's prefix is warmed as `chat` and
    `serve` do (next_turn.py; `warm` False: not, to compare); its tokens and time are columns of
    their own."""
    bs, tok = eng.block_size, eng.tokenizer
    think = THINK_BUDGET if reasoning.family(tok.chat_template) else -1
    params = SamplingParams(temperature=0.0, max_tokens=reply + max(think, 0), reasoning_budget=think)
    messages = [{"role": "system", "content": system}]
    prev: list[list[int]] = []
    rows = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        text, plan = reasoning.chat(tok, messages, params)
        ids = tok.encode(text)
        eng.check_fits(len(ids), params.max_tokens)
        o.say(f"cache chat turn {i + 1}/{turns}: {len(ids)}-token prompt")
        common = max((next_turn.common_length(p, ids) for p in prev), default=0)
        reusable = min(common, len(ids) - 1) // bs * bs  # whole blocks, never the last token
        r = Generation(eng, ids, params, reasoning=plan).run()
        t0 = time.perf_counter()
        after = next_turn.prefix_ids(tok, messages, r.text, params)
        warmed = next_turn.warm(eng, after) if warm else 0
        warm_s = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": r.text})
        prev = [ids + r.tokens, after]
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": len(ids),
                "hit_tokens": r.cached_tokens,
                "reusable_tokens": reusable,
                "hit_rate": r.cached_tokens / len(ids),
                "ttft_s": r.ttft_s,
                "reasoning_tokens": r.branches[0].reasoning_tokens,
                "warmed_tokens": warmed,
                "warm_s": warm_s,
            }
        )
    return rows


# ------------------------------------------------------------------ report


def _summary(prompt_tokens: int, chat_rows: list[dict]) -> dict:
    hits = sum(r["hit_tokens"] for r in chat_rows)
    queries = sum(r["prompt_tokens"] for r in chat_rows)
    reusable = sum(r["reusable_tokens"] for r in chat_rows)
    return {
        "prompt_tokens": prompt_tokens,
        "chat prefix hits / queries": f"{hits:,} / {queries:,} tokens = {hits / queries * 100:.1f}% "
        f"(reusable: {reusable:,} = {reusable / queries * 100:.1f}%)",
    }


def _targets(rows: list[dict], full: bool) -> list[Target]:
    """Judged at the full size only."""
    ours_warm = _ttft(rows, "localkv", "warm disk")
    warm_vs_cold = ratio(_ttft(rows, "localkv", "cold"), ours_warm)
    warm_vs_peer = ratio(_ttft(rows, "llama.cpp", "warm disk"), ours_warm)
    return [
        Target(
            "our warm disk cache vs our cold TTFT",
            f"{warm_vs_cold:.1f}x" if warm_vs_cold else "n/a",
            ">= 20x",
            (warm_vs_cold >= 20) if full and warm_vs_cold else None,
        ),
        Target(
            "our warm vs llama.cpp's warm LlamaDiskCache TTFT",
            f"{warm_vs_peer:.1f}x" if warm_vs_peer else "n/a",
            ">= 5x",
            (warm_vs_peer >= 5) if full and warm_vs_peer else None,
        ),
    ]


def _notes(o: Options, reply: int) -> list[str]:
    notes = [
        "TTFT: from the generate call (ours: the prefix lookup in memory and on disk; llama.cpp: "
        "create_completion's cache lookup and load_state) to the first sampled token, greedy; the model "
        "load before it is the 'model load' column; the prompt is written to the cache after the timing",
        "chat: each turn's prompt = system + all previous turns + the new question, replies generated "
        f"greedily ({reply} tokens at most; a thinking model thinks {THINK_BUDGET} tokens first), one "
        "engine, prefix cache in memory; reusable = the previous prompt + reply's tokens, or the "
        "prefix warmed after the reply, this prompt starts with, in whole blocks (what a perfect "
        "cache could hit), never the last token; warmed after = tokens prefilled once the reply "
        "ended, the next turn's prefix as the template writes it (as chat and serve do while idle)",
    ]
    if not o.vs:
        notes.append("add --vs llama.cpp for llama-cpp-python's cold and LlamaDiskCache warm TTFT")
    if o.quick:
        notes.append("--quick: a short system prompt; the targets are for the full size")
    return notes
