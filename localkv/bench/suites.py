"""The named suites of `localkv bench`: speed, memory, fork, cache, evict (and all of them).

Each run_* function takes the bench options and returns one Report (bench_report.py): what was
measured, the rows, a summary, and the targets of the issues that asked for these numbers.
--quick shrinks every suite to a smoke run (seconds on the real model or the tests' tiny one);
the rows and fields stay the same, the targets at the issues' sizes then read "not measured".
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localkv.bench.report import Column, LoadMeter, Report, Target
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.units import parse_size

SUITES = ("speed", "memory", "fork", "cache", "evict")  # what `all` runs, in this order


@dataclass
class Options:
    model: str | None = None
    threads: int | None = None
    vs: str | None = None
    block_size: int = 16
    kv_mem: str = "1GiB"
    quick: bool = False
    long: bool = False
    seed: int = 0
    reps: int | None = None  # None: the suite's default
    n_prompt: int = 512  # speed only
    n_gen: int = 128  # speed only
    device: str = "auto"
    progress: object = None  # progress(msg) -> None

    def say(self, msg: str):
        if self.progress:
            self.progress(msg)

    def engine_config(self, **kw) -> EngineConfig:
        """The bench's engine settings; never with the disk cache, so a bench does not write into
        the user's LOCALKV_HOME (the cache suite's child processes get their own)."""
        args = dict(
            model=self.model,
            block_size=self.block_size,
            kv_mem=self.kv_mem,
            threads=self.threads,
            disk_cache=False,
            device=self.device,
        )
        return EngineConfig(**(args | kw))

    def new_engine(self, **kw) -> Engine:
        return Engine(self.engine_config(**kw), progress=bool(self.progress) and sys.stderr.isatty())

    def command(self, suite: str, threads: int | None) -> str:
        """The command line that reproduces this suite, thread count pinned."""
        args = ["localkv", "bench", suite] + (["-m", str(self.model)] if self.model else [])
        if suite == "speed" and not self.quick:
            args += ["-p", str(self.n_prompt), "-n", str(self.n_gen), "-r", str(self.reps or 5)]
        elif suite in ("fork", "cache") and self.reps:
            args += ["-r", str(self.reps)]
        if threads and suite != "memory":
            args += ["-t", str(threads)]
        if self.vs and suite in ("speed", "fork", "cache"):
            args += ["--vs", self.vs]
        args += ["--quick"] * self.quick + ["--long"] * (self.long and suite == "evict")
        args += ["--seed", str(self.seed)] if self.seed else []
        args += ["--block-size", str(self.block_size)] if self.block_size != 16 else []
        args += ["--kv-mem", self.kv_mem] if parse_size(self.kv_mem) != EngineConfig().kv_mem else []
        args += ["--device", self.device] if self.device != "auto" and suite != "memory" else []
        return shlex.join(args)


def _median(xs):
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if a and b else None


def _text_ids(engine: Engine, n: int) -> list[int]:
    """The first n tokens of the GPL-3.0 text (shipped in localkv/data), repeated if short."""
    from localkv.bench.ppl import text_tokens

    ids = text_tokens(engine, 1 << 30)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


# ------------------------------------------------------------------ speed


def run_speed(o: Options) -> Report:
    from localkv.bench.speed import format_speed_table, ratios, speed_rows

    meter = LoadMeter()
    n_prompt, n_gen, reps = (64, 16, 1) if o.quick else (o.n_prompt, o.n_gen, o.reps or 5)
    tests = [f"pp{n_prompt}"] * bool(n_prompt) + [f"tg{n_gen}"] * bool(n_gen)
    eng = o.new_engine(prefix_cache=False)  # as llama-bench: no prefix cache, the pool's blocks reused
    rows = speed_rows(eng, tests, reps=reps, vs=o.vs, seed=o.seed, progress=o.say)
    r = ratios(rows)
    rep = Report(
        "speed",
        f"prompt processing ({', '.join(tests)}) and generation speed, llama-bench style, "
        f"{reps} rep(s)" + (", interleaved with llama.cpp" if o.vs else ""),
        command=o.command("speed", eng.threads),
        rows=rows,
        table_md=format_speed_table(rows, r),
    )
    rep.summary = {f"{t} localkv / llama.cpp": f"{x:.2f}x" for t, x in r.items()}
    rep.notes = [
        "prefix caching off, as llama-bench has none: each rep reuses the blocks the last one freed "
        "(pages already mapped, as llama.cpp reuses its KV buffer)"
    ]
    return meter.finish(rep, eng.threads)


# ------------------------------------------------------------------ memory


def run_memory(o: Options) -> Report:
    from localkv.bench import memory as bm

    meter = LoadMeter()
    if o.quick:
        cfg = bm.MemoryConfig(
            n_requests=64,
            seed=o.seed,
            max_len=512,
            prompt_range=(8, 256),
            output_range=(8, 256),
            arena_slots=4096,
            block_size=o.block_size,
        )
    else:
        cfg = bm.MemoryConfig(
            seed=o.seed, arena_slots=bm.arena_slots(parse_size(o.kv_mem), o.block_size), block_size=o.block_size
        )
    o.say(f"memory: {cfg.n_requests} requests through {cfg.arena_slots} token slots, paged and contiguous")
    reqs, results = bm.run(cfg)
    w = bm.workload_stats(reqs)
    rows = [r.row() for r in results]
    paged, contig = results[0], results[1]
    rep = Report(
        "memory",
        "share of reserved KV holding real tokens, fragmentation and requests that fit at "
        "once: paged pool vs contiguous reservation, same memory, same seeded workload "
        "(allocator-level simulation, no model)",
        command=o.command("memory", None),
        rows=rows,
    )
    rep.columns = [
        Column("allocator", "allocator", left=True),
        Column("utilization", "holds tokens", "%"),
        Column("internal_frag", "internal frag", "%"),
        Column("reserved_for_later", "for later", "%"),
        Column("never_used", "never used", "%"),
        Column("external_frag", "external frag", "%"),
        Column("mean_batch", "batch (mean)", ".1f"),
        Column("peak_batch", "batch (peak)"),
        Column("steps", "steps"),
        Column("preemptions", "preemptions"),
    ]
    fit = _ratio(paged.mean_batch, contig.mean_batch)
    rep.summary = {
        "workload": f"{cfg.n_requests} requests, seed {cfg.seed}, prompt and output lengths log-uniform in "
        f"{cfg.prompt_range[0]}-{cfg.prompt_range[1]} tokens each, max length {cfg.max_len}",
        "prompt tokens mean / median / max": f"{w['prompt_mean']:.0f} / {w['prompt_median']:.0f} / {w['prompt_max']}",
        "output tokens mean / median / max": f"{w['output_mean']:.0f} / {w['output_median']:.0f} / {w['output_max']}",
        "arena_slots": cfg.arena_slots,
        "memory": f"{cfg.arena_slots:,} token slots ({cfg.arena_slots // cfg.block_size:,} blocks of {cfg.block_size})"
        + (
            ""
            if o.quick
            else f" = --kv-mem {o.kv_mem} of SmolLM2-135M fp32 K/V ({bm.SMOLLM2_KV_BYTES_PER_TOKEN:,} bytes/token)"
        ),
        "paged vs contiguous requests at once (mean while queued)": f"{fit:.2f}x" if fit else "n/a",
    }
    rep.notes = [
        "contiguous reserves max length per request (pre-vLLM engines); contiguous-pow2 and "
        "contiguous-exact know each request's final length, which no real engine does: they show where "
        "the waste comes from",
        "internal frag = for later (a future token of the same request lands there) + never used; "
        "external frag = free slots the next waiting request cannot use, share of the memory",
        "paged preemptions free the newest request and recompute its tokens on re-admission (vLLM)",
    ]
    judge = (lambda ok: None) if o.quick else bool  # --quick: a smaller workload than the targets are for
    rep.targets = [
        Target(
            "paged: reserved KV holding real tokens",
            f"{paged.utilization * 100:.1f}%",
            ">= 96%",
            judge(paged.utilization >= 0.96),
        ),
        Target(
            "contiguous (max length): reserved KV holding real tokens",
            f"{contig.utilization * 100:.1f}%",
            "20-40%, as the vLLM paper reports",
            judge(0.20 <= contig.utilization <= 0.40),
        ),
        Target(
            "requests at once, paged vs contiguous",
            f"{fit:.2f}x" if fit else "n/a",
            ">= 2x",
            judge(bool(fit and fit >= 2)),
        ),
    ]
    rep.notes.append("a deterministic simulation: machine load does not change these numbers")
    if o.quick:
        rep.notes.append("--quick: 64 short requests in 4,096 slots; the targets are for the full workload")
    rep.series = {"allocators": {r.allocator: r.series for r in results}}
    return meter.finish(rep, None)


# ------------------------------------------------------------------ fork

FORK_FULL = dict(n=8, prompt=2000, gen=100)
FORK_QUICK = dict(n=8, prompt=64, gen=8)


def run_fork(o: Options) -> Report:
    meter = LoadMeter()
    size = FORK_QUICK if o.quick else FORK_FULL
    n, gen = size["n"], size["gen"]
    eng = o.new_engine(prefix_cache=False)  # every rep prefills its prompt: no hit from the rep before
    bs = eng.block_size
    n_prompt = min(size["prompt"], eng.cfg.ctx_len - gen - 1)
    prompt = _text_ids(eng, n_prompt)
    reps = o.reps or (1 if o.quick else 3)  # medians of 3: one rep moves 5-10% on a shared VM
    params = SamplingParams(0.8, 40, 0.95, o.seed, max_tokens=gen, ignore_eos=True)
    peer = None
    if o.vs:
        from localkv.bench.peer import PeerRunner

        peer = PeerRunner(eng.path, eng.threads, -(-(n_prompt + gen + 1) // 256) * 256)
    ours, theirs = [], []
    try:
        for i in range(reps):  # interleaved: ours, llama.cpp, ours, ...
            o.say(f"fork localkv rep {i + 1}/{reps}: best-of-{n}, {n_prompt}-token prompt, {gen} tokens each")
            ours.append(Generation(eng, prompt, params, n=n).run())
            if peer:
                o.say(f"fork llama.cpp rep {i + 1}/{reps}: prompt once, save_state, {n} x (load_state + {gen} tokens)")
                theirs.append(peer.branches(prompt, n, gen, 0.8, 40, 0.95, o.seed))
    finally:
        if peer:
            peer.close()
    last = ours[-1]
    tokens = last.completion_tokens
    our_tps = _median([r.completion_tokens / r.eval_s for r in ours if r.eval_s])
    their_tps = _median([n * gen / t["decode_s"] for t in theirs if t["decode_s"]])
    ratio = _ratio(our_tps, their_tps)
    shared, unshared = last.peak_blocks * bs, last.unshared_blocks * bs
    ideal = (-(-n_prompt // bs) + n * (-(-(n_prompt + gen) // bs) - n_prompt // bs)) * bs
    rows = [
        {
            "engine": "localkv",
            "method": f"{n} forks, one batched decode",
            "branches": n,
            "prompt_tokens": n_prompt,
            "tokens_per_branch": gen,
            "kv_slots": shared,
            "kv_slots_unshared": unshared,
            "prompt_s": _median([r.prompt_s for r in ours]),
            "decode_s": _median([r.eval_s for r in ours]),
            "decode_tokens": tokens,
            "decode_tps": our_tps,
            "vs_llama_cpp": ratio,
            "cow_copies": last.cow_copies,
        }
    ]
    if theirs:
        t = theirs[-1]
        rows.append(
            {
                "engine": "llama.cpp",
                "method": f"save_state, {n} x load_state + sample",
                "branches": n,
                "prompt_tokens": n_prompt,
                "tokens_per_branch": gen,
                "prompt_s": _median([x["prompt_s"] for x in theirs]),
                "decode_s": _median([x["decode_s"] for x in theirs]),
                "decode_tokens": n * gen,
                "decode_tps": their_tps,
                "restore_s": _median([x["restore_s"] for x in theirs]),
                "state_bytes": t["state_bytes"],
            }
        )
    rep = Report(
        "fork",
        f"best-of-{n} on a {n_prompt}-token prompt (GPL-3.0 text), {gen} sampled tokens per branch "
        f"(temperature 0.8, top-k 40, top-p 0.95, EOS ignored), block {bs}: KV slots held and "
        "aggregate decode throughput" + (", side by side with llama.cpp" if o.vs else ""),
        command=o.command("fork", eng.threads),
        rows=rows,
    )
    rep.columns = [
        Column("engine", "engine", left=True),
        Column("method", "method", left=True),
        Column("kv_slots", "KV slots (shared)", ","),
        Column("kv_slots_unshared", "KV slots (unshared)", ","),
        Column("prompt_s", "prompt s", ".2f"),
        Column("decode_s", "decode s", ".2f"),
        Column("decode_tps", "decode t/s", ".1f"),
        Column("vs_llama_cpp", "vs llama.cpp", "x"),
        Column("restore_s", "load_state s", ".2f"),
        Column("state_bytes", "saved state bytes", ","),
    ]
    rep.summary = {
        "kv_slots_shared": shared,
        "kv_slots_unshared": unshared,
        "kv_saving": f"{unshared / shared:.2f}x",
        "reps": reps,
        "decode_tps_localkv": our_tps,
    }
    if their_tps:
        rep.summary |= {"decode_tps_llama_cpp": their_tps, "llama.cpp restore (load_state) s": rows[1]["restore_s"]}
    full = size is FORK_FULL and n_prompt == FORK_FULL["prompt"] and bs == 16
    rep.targets = [
        Target(
            "KV token slots with sharing",
            f"{shared:,} (without: {unshared:,})",
            "<= 2,900" if full else f"<= {ideal:,} (prompt + {n} x {gen}, whole blocks)",
            shared <= (2900 if full else ideal),
        ),
        Target(
            f"aggregate decode, {n} batched branches vs llama.cpp one after another",
            f"{ratio:.2f}x" if ratio else "n/a",
            ">= 1.3x",
            None if ratio is None or not full else ratio >= 1.3,
        ),
    ]
    if o.quick:
        rep.notes.append(
            "--quick: a 64-token prompt and 8 tokens per branch; the throughput target is for the "
            "issue's sizes (the KV bound holds at any size)"
        )
    if not o.vs:
        rep.notes.append("add --vs llama.cpp for the llama-cpp-python side (same prompt, same branch count)")
    rep.notes.append(
        "decode time only on both sides: our prefill and llama.cpp's prompt eval, save_state and "
        "load_state are timed apart"
    )
    return meter.finish(rep, eng.threads)


# ------------------------------------------------------------------ cache

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
CACHE_FULL = dict(system=2000, turns=10, reply=24)
CHILD_TIMEOUT = 900
CACHE_QUICK = dict(system=64, turns=3, reply=4)


def _system_text(engine: Engine, n_tokens: int) -> str:
    """A system prompt of about n_tokens: an instruction and the start of the GPL-3.0 text."""
    head = len(engine.tokenizer.encode(SYSTEM_HEAD))
    return SYSTEM_HEAD + engine.tokenizer.decode(_text_ids(engine, max(1, n_tokens - head)))


def _chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _child(argv: list[str], request: dict, env: dict | None = None, what: str = "") -> dict:
    try:
        p = subprocess.run(
            [sys.executable, *argv],
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


def run_cache(o: Options) -> Report:
    meter = LoadMeter()
    size = CACHE_QUICK if o.quick else CACHE_FULL
    eng = o.new_engine(prefix_cache=True)  # the chat below; its pool starts empty
    threads = eng.threads
    system = _system_text(eng, size["system"])
    ids_fill = _chat_ids(eng, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}])
    ids_warm = _chat_ids(eng, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[1]}])
    for ids in (ids_fill, ids_warm):
        eng.check_fits(len(ids), 1)
    local_req = {"config": o.engine_config(model=str(eng.path), threads=threads, disk_cache=True).to_dict()}
    n_ctx = -(-(max(len(ids_fill), len(ids_warm)) + 16) // 256) * 256
    peer_req = {"model": str(eng.path), "n_ctx": n_ctx, "threads": threads, "capacity": 2 << 30}
    reps = o.reps or (1 if o.quick else 3)  # medians of 3: one rep moves 5-10% on a shared VM
    res: dict[tuple[str, str], list[dict]] = {}
    sizes: dict[str, list[int]] = {"localkv": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory(prefix="localkv-bench-cache-") as tmp:
        for i in range(reps):  # interleaved: ours cold, theirs cold, ours warm, theirs warm
            home = Path(tmp) / f"home-{i}"
            env = {**os.environ, "LOCALKV_HOME": str(home)}
            pdir = Path(tmp) / f"llama-cache-{i}"
            steps = [
                ("localkv", "cold", ids_fill),
                ("llama.cpp", "cold", ids_fill),
                ("localkv", "warm disk", ids_warm),
                ("llama.cpp", "warm disk", ids_warm),
            ]
            for engine, cond, ids in steps:
                if engine == "llama.cpp" and not o.vs:
                    continue
                o.say(f"cache {engine} {cond} rep {i + 1}/{reps}: new process, {len(ids)}-token prompt")
                if engine == "localkv":
                    out = _child(["-m", "localkv.bench.child_ttft"], local_req | {"ids": ids}, env, f"localkv {cond}")
                else:
                    from localkv.bench.peer import TTFT_CHILD

                    out = _child(
                        ["-c", TTFT_CHILD], peer_req | {"ids": ids, "cache_dir": str(pdir)}, None, f"llama.cpp {cond}"
                    )
                res.setdefault((engine, cond), []).append(out)
                if cond == "cold":  # what the warm run will read
                    sizes[engine].append(_dir_bytes(home / "kvcache" if engine == "localkv" else pdir))
        chat_rows = _chat(eng, system, size["turns"], size["reply"], o)
    rows = []
    for (engine, cond), outs in res.items():
        rows.append(
            {
                "engine": engine,
                "condition": cond,
                "prompt_tokens": outs[-1]["prompt_tokens"],
                "cached_tokens": outs[-1].get("cached_tokens"),
                "ttft_s": _median([x["ttft_s"] for x in outs]),
                "load_s": _median([x["load_s"] for x in outs]),
                "disk_bytes": _median(sizes[engine]) if sizes[engine] else None,
            }
        )
    ttft = {(r["engine"], r["condition"]): r["ttft_s"] for r in rows}
    warm_vs_cold = _ratio(ttft.get(("localkv", "cold")), ttft.get(("localkv", "warm disk")))
    warm_vs_peer = _ratio(ttft.get(("llama.cpp", "warm disk")), ttft.get(("localkv", "warm disk")))
    for r in rows:
        r["speedup_vs_our_cold"] = _ratio(ttft.get(("localkv", "cold")), r["ttft_s"])
    hits = sum(r["hit_tokens"] for r in chat_rows)
    queries = sum(r["prompt_tokens"] for r in chat_rows)
    reusable = sum(r["reusable_tokens"] for r in chat_rows)
    rep = Report(
        "cache",
        f"time to first token for a {size['system']}-token system prompt + a short user turn, "
        "each in a new process: cold, then warm from the disk cache (another user turn, same "
        "system prompt)"
        + (", localkv and llama.cpp (LlamaDiskCache)" if o.vs else "")
        + f"; prefix hit rate over a scripted {size['turns']}-turn chat",
        command=o.command("cache", threads),
        rows=rows,
    )
    rep.columns = [
        Column("engine", "engine", left=True),
        Column("condition", "condition", left=True),
        Column("prompt_tokens", "prompt"),
        Column("cached_tokens", "from cache"),
        Column("ttft_s", "TTFT s", ".3f"),
        Column("speedup_vs_our_cold", "vs our cold", "x"),
        Column("load_s", "model load s", ".2f"),
        Column("disk_bytes", "bytes on disk", ","),
    ]
    chat_cols = [
        Column("turn", "turn"),
        Column("prompt_tokens", "prompt"),
        Column("hit_tokens", "hits"),
        Column("reusable_tokens", "reusable"),
        Column("hit_rate", "hit rate", "%"),
        Column("ttft_s", "TTFT s", ".3f"),
    ]
    rep.more = [("chat", chat_cols, chat_rows)]
    rep.summary = {
        "prompt_tokens": len(ids_warm),
        "chat prefix hits / queries": f"{hits:,} / {queries:,} tokens = {hits / queries * 100:.1f}% "
        f"(reusable: {reusable:,} = {reusable / queries * 100:.1f}%)",
    }
    full = size is CACHE_FULL
    rep.targets = [
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
    rep.notes = [
        "TTFT: from the generate call (ours: the prefix lookup in memory and on disk; llama.cpp: "
        "create_completion's cache lookup and load_state) to the first sampled token, greedy; the model "
        "load before it is the 'model load' column; the prompt is written to the cache after the timing",
        "chat: each turn's prompt = system + all previous turns + the new question, replies generated "
        f"greedily ({size['reply']} tokens at most), one engine, prefix cache in memory; reusable = the "
        "previous prompt + reply's tokens this prompt starts with, in whole blocks (what a perfect "
        "cache could hit), never the last token",
    ]
    if not o.vs:
        rep.notes.append("add --vs llama.cpp for llama-cpp-python's cold and LlamaDiskCache warm TTFT")
    if o.quick:
        rep.notes.append("--quick: a short system prompt; the targets are for the full size")
    return meter.finish(rep, threads)


def _chat(eng: Engine, system: str, turns: int, reply: int, o: Options) -> list[dict]:
    bs = eng.block_size
    messages = [{"role": "system", "content": system}]
    prev: list[int] = []
    rows = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        ids = _chat_ids(eng, messages)
        eng.check_fits(len(ids), reply)
        o.say(f"cache chat turn {i + 1}/{turns}: {len(ids)}-token prompt")
        common = 0
        for a, b in zip(prev, ids):
            if a != b:
                break
            common += 1
        reusable = min(common, len(ids) - 1) // bs * bs
        r = Generation(eng, ids, SamplingParams(temperature=0.0, max_tokens=reply)).run()
        messages.append({"role": "assistant", "content": r.text})
        prev = ids + r.tokens
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": len(ids),
                "hit_tokens": r.cached_tokens,
                "reusable_tokens": reusable,
                "hit_rate": r.cached_tokens / len(ids),
                "ttft_s": r.ttft_s,
            }
        )
    return rows


# ------------------------------------------------------------------ evict

EVICT_FULL = dict(n_tokens=4096, budgets=(10, 20, 30, 50))
EVICT_QUICK = dict(n_tokens=128, budgets=(50,))
LONG_FULL = dict(tokens=10_000, budget=1024)
LONG_QUICK = dict(tokens=200, budget=64)
POLICIES = ("sliding", "h2o", "offload")


def run_evict(o: Options) -> Report:
    from localkv.bench import ppl as be

    meter = LoadMeter()
    size = EVICT_QUICK if o.quick else EVICT_FULL
    threads = []

    def make_engine(cfg):
        eng = o.new_engine(prefix_cache=False, evict=cfg)
        threads.append(eng.threads)
        return eng

    rows_ppl = be.run(
        make_engine,
        n_tokens=size["n_tokens"],
        budgets_pct=size["budgets"],
        policies=POLICIES,
        log=lambda m: o.say(f"evict {m.strip()}"),
    )
    full = next(r.ppl for r in rows_ppl if r.budget is None)
    rows = [
        {
            "policy": r.policy,
            "budget": r.budget,
            "budget_pct": r.budget_pct,
            "ppl": r.ppl,
            "ppl_vs_full": r.ppl / full,
            "peak_active": r.peak_active,
            "evictions": r.evictions,
            "offloads": r.offloads,
            "recalls": r.recalls,
            "seconds": r.seconds,
        }
        for r in rows_ppl
    ]
    rep = Report(
        "evict",
        f"teacher-forced perplexity of the first {size['n_tokens']} tokens of the GPL-3.0 text "
        f"under KV budgets of {', '.join(f'{b}%' for b in size['budgets'])} for "
        f"{', '.join(POLICIES)}, and the full cache",
        command=o.command("evict", threads[0] if threads else o.threads),
        rows=rows,
    )
    rep.columns = [
        Column("policy", "policy", left=True),
        Column("budget", "budget"),
        Column("budget_pct", "%"),
        Column("ppl", "perplexity", ".3f"),
        Column("ppl_vs_full", "vs full", "x"),
        Column("peak_active", "peak active"),
        Column("evictions", "evictions"),
        Column("offloads", "offloads"),
        Column("recalls", "recalls"),
        Column("seconds", "s", ".1f"),
    ]
    for line in be.verdict(rows_ppl):
        head, _, verdict = line.rpartition(" -> ")
        name, _, value = head.partition(": ")
        ok = verdict.startswith("PASS")
        if o.quick and not name.startswith("active KV"):
            ok = None  # quality at smoke-run sizes says nothing; the budget invariant holds at any size
        detail = verdict.removeprefix("PASS").removeprefix("FAIL").strip(" ()")
        rep.targets.append(Target(name, value or detail or ("holds" if ok else "fails"), "", ok))
    rep.summary = {"full-cache perplexity": full}
    if o.long:
        ln = LONG_QUICK if o.quick else LONG_FULL
        long_rows = _long(o, ln["tokens"], ln["budget"], threads)
        rep.more = [
            (
                "long",
                [
                    Column("policy", "policy", left=True),
                    Column("budget", "budget"),
                    Column("generated", "generated"),
                    Column("finish_reason", "finish", left=True),
                    Column("peak_active", "peak active"),
                    Column("evictions", "evictions"),
                    Column("offloads", "offloads"),
                    Column("recalls", "recalls"),
                    Column("eval_tps", "t/s", ".1f"),
                ],
                long_rows,
            )
        ]
        for r in long_rows:
            rep.targets.append(
                Target(
                    f"{r['policy']}: {ln['tokens']:,}-token generation under a {ln['budget']}-token budget",
                    f"{r['generated']:,} tokens ({r['finish_reason']}), peak active {r['peak_active']}",
                    "runs to the end, peak <= budget",
                    r["generated"] == ln["tokens"] and r["peak_active"] <= ln["budget"],
                )
            )
    else:
        rep.notes.append(
            f"add --long for a {LONG_FULL['tokens']:,}-token generation under a {LONG_FULL['budget']:,}-token "
            "budget per policy"
        )
    if o.vs:
        rep.notes.append("--vs: llama.cpp has no KV eviction policy to compare; localkv rows only")
    return meter.finish(rep, threads[0] if threads else o.threads)


def _long(o: Options, n_tokens: int, budget: int, threads: list) -> list[dict]:
    from localkv.kv.evict import EvictConfig

    rows = []
    for pol in POLICIES:
        eng = o.new_engine(prefix_cache=False, evict=EvictConfig(policy=pol, budget=budget))
        threads.append(eng.threads)
        prompt = _text_ids(eng, 64)
        o.say(f"evict long {pol}: {n_tokens} tokens under a {budget}-token budget")
        r = Generation(eng, prompt, SamplingParams(seed=o.seed, max_tokens=n_tokens, ignore_eos=True)).run()
        s = eng.stats
        rows.append(
            {
                "policy": pol,
                "budget": budget,
                "generated": r.completion_tokens,
                "finish_reason": r.finish_reason,
                "peak_active": r.peak_active_tokens,
                "evictions": s.evictions,
                "offloads": s.offloads,
                "recalls": s.recalls,
                "eval_tps": r.timings()["eval_tps"],
                "seconds": r.prompt_s + r.eval_s,
            }
        )
    return rows


RUNNERS = {"speed": run_speed, "memory": run_memory, "fork": run_fork, "cache": run_cache, "evict": run_evict}
