"""`localkv bench [SUITE]`: the one place for measurements.

Suites (bench_suites.py): speed (default), memory, fork, cache, evict, and all of them in turn.
This module holds the speed suite's core and the command. pp N times a prefill of N random
tokens into an empty sequence; tg N times N single-token decode steps after a 1-token prompt.
Rows use llama-bench's JSON field names so results can sit next to llama-bench's. With
--vs llama.cpp the same tests run on llama-cpp-python with the same GGUF and threads, reps
interleaved (A B A B ...) so machine noise hits both alike.
"""

import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from time import perf_counter

import numpy as np
import typer

from localkv.bench.report import OUTPUTS, check_output, cpu_info  # noqa: F401  (OUTPUTS, cpu_info: kept importable here)
from localkv.engine import DEFAULT_KV_MEM, Engine
from localkv.errors import LocalkvError
from localkv.sequence import Sequence

PEERS = ("llama.cpp",)
SUITE_NAMES = ("speed", "memory", "fork", "cache", "evict", "all")


@dataclass(slots=True, frozen=True)
class Test:
    name: str  # "pp512" / "tg128", as llama-bench names them
    n_prompt: int
    n_gen: int

    @classmethod
    def parse(cls, name: str) -> "Test":
        m = re.fullmatch(r"(pp|tg)(\d+)", name)
        if not m or int(m.group(2)) < 1:
            raise LocalkvError(f"invalid bench test {name!r}: use ppN (prompt processing) or tgN (generation), N >= 1")
        n = int(m.group(2))
        return cls(name, n, 0) if m.group(1) == "pp" else cls(name, 0, n)

    @property
    def n_ctx(self) -> int:
        return self.n_prompt + self.n_gen + 1


class LocalRunner:
    """localkv's side of a test: timers over an Engine."""

    name = "localkv"

    def __init__(self, engine: Engine):
        self.engine = engine

    def pp(self, tokens: list[int]) -> float:
        eng, seq = self.engine, Sequence(list(tokens))
        try:
            t0 = perf_counter()
            eng.prefill(seq)
            return perf_counter() - t0
        finally:
            eng.kv.free(seq)

    def tg(self, first: int, n: int) -> float:
        eng, seq = self.engine, Sequence([first])
        try:
            logits = eng.prefill(seq)
            t0 = perf_counter()
            for _ in range(n):
                seq.tokens.append(int(np.argmax(logits)))  # greedy: cheap and deterministic
                logits = eng.decode([seq])[0]
            return perf_counter() - t0
        finally:
            eng.kv.free(seq)


def _measure(runner, test: Test, tokens: list[int]) -> float:
    return runner.pp(tokens) if test.n_prompt else runner.tg(tokens[0], test.n_gen)


def _tokens(test: Test, vocab: int, rep: int, seed: int, warm: bool = False) -> list[int]:
    # the same ids for every engine at a given rep, different ids across reps
    rng = np.random.default_rng([seed, warm, rep, test.n_prompt, test.n_gen])
    return rng.integers(0, vocab, max(test.n_prompt, 1)).tolist()


def speed_rows(
    engine: Engine,
    tests=("pp512", "tg128"),
    reps: int = 5,
    warmup: int = 1,
    vs: str | None = None,
    seed: int = 0,
    progress=None,
) -> list[dict]:
    """One row per (test, engine); with vs="llama.cpp" a llama.cpp row follows each localkv row.
    progress(msg) is called before each rep (bench_command sends it to stderr)."""
    tests = [t if isinstance(t, Test) else Test.parse(t) for t in tests]
    if reps < 1:
        raise LocalkvError(f"invalid repetitions {reps}: must be >= 1")
    _check_vs(vs)
    for t in tests:
        engine.check_fits(max(t.n_prompt, 1), t.n_gen)
    runners = [LocalRunner(engine)]
    if vs:
        from localkv.bench.peer import PeerRunner

        n_ctx = -(-max(t.n_ctx for t in tests) // 256) * 256
        runners.append(PeerRunner(engine.path, engine.threads, n_ctx))
    say = progress or (lambda msg: None)
    rows = []
    try:
        for t in tests:
            vocab = engine.cfg.vocab_size
            for i in range(warmup):
                for r in runners:
                    say(f"{t.name} {r.name} warmup {i + 1}/{warmup}")
                    _measure(r, t, _tokens(t, vocab, i, seed, warm=True))
            secs = {r.name: [] for r in runners}
            for i in range(reps):
                for r in runners:  # interleaved: A B A B ...
                    say(f"{t.name} {r.name} rep {i + 1}/{reps}")
                    secs[r.name].append(_measure(r, t, _tokens(t, vocab, i, seed)))
            rows += [_row(engine, t, name, s) for name, s in secs.items()]
    finally:
        for r in runners[1:]:
            r.close()
    return rows


def _row(engine: Engine, t: Test, name: str, secs: list[float]) -> dict:
    cfg = engine.cfg
    ts = [(t.n_prompt + t.n_gen) / s for s in secs]
    ns = [int(s * 1e9) for s in secs]
    return {
        "engine": name,
        "cpu_info": cpu_info(),
        "model_filename": str(engine.path),
        "model_type": f"llama {_short_params(cfg.n_params)} {cfg.quant}",
        "model_size": cfg.file_size,
        "model_n_params": cfg.n_params,
        "backend": "CPU",
        "n_threads": engine.threads,
        "test": t.name,
        "n_prompt": t.n_prompt,
        "n_gen": t.n_gen,
        "test_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "avg_ns": int(statistics.fmean(ns)),
        "stddev_ns": int(_sd(ns)),
        "avg_ts": statistics.fmean(ts),
        "stddev_ts": _sd(ts),
        "samples_ns": ns,
        "samples_ts": ts,
    }


def _short_params(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:.1f}B"


def _sd(xs) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0  # sample stddev, as llama-bench


def ratios(rows: list[dict], peer: str = "llama.cpp") -> dict[str, float]:
    """test -> localkv avg_ts / peer avg_ts, for the tests both engines ran."""
    by = {(r["engine"], r["test"]): r["avg_ts"] for r in rows}
    return {t: a / by[(peer, t)] for (e, t), a in by.items() if e == "localkv" and by.get((peer, t))}


# ------------------------------------------------------------------ output


def hardware() -> str:
    return f"{cpu_info()}, {os.cpu_count()} cores"


def _size(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def format_md(rows: list[dict], ratios: dict[str, float] | None = None, command: str | None = None) -> str:
    """llama-bench's markdown table; when llama.cpp rows are present an engine column leads and
    a ratio column (localkv t/s / llama.cpp t/s) ends each localkv row."""
    head = [f"CPU: {hardware()}"] + ([f"command: `{command}`"] if command else [])
    return "\n".join(head + ["", format_speed_table(rows, ratios)])


def format_speed_table(rows: list[dict], ratios: dict[str, float] | None = None) -> str:
    """The table part of format_md."""
    compared = any(r["engine"] != "localkv" for r in rows)
    ratios = ratios or {}
    cols = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    if compared:
        cols = ["engine", *cols, "vs llama.cpp"]
    left = {"engine", "model", "backend"}  # llama-bench left-aligns text, right-aligns numbers
    table = [cols] + [[_cell(r, c, ratios) for c in cols] for r in rows]
    w = [max(len(row[i]) for row in table) for i in range(len(cols))]

    def fmt(row):
        return "| " + " | ".join(v.ljust(n) if c in left else v.rjust(n) for c, v, n in zip(cols, row, w)) + " |"

    rule = "| " + " | ".join("-" * n if c in left else "-" * (n - 1) + ":" for c, n in zip(cols, w)) + " |"
    return "\n".join([fmt(table[0]), rule] + [fmt(r) for r in table[1:]]) + "\n"


def _cell(r: dict, col: str, ratios: dict[str, float]) -> str:
    match col:
        case "engine":
            return r["engine"]
        case "model":
            return r["model_type"]
        case "size":
            return _size(r["model_size"])
        case "params":
            return _params(r["model_n_params"])
        case "backend":
            return r["backend"]
        case "threads":
            return str(r["n_threads"])
        case "test":
            return r["test"]
        case "t/s":
            return f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
        case "vs llama.cpp":
            x = ratios.get(r["test"]) if r["engine"] == "localkv" else None
            return f"{x:.2f}x" if x is not None else ""


def format_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2) + "\n"


# ------------------------------------------------------------------ CLI


def _check_vs(vs: str | None):
    if vs is not None and vs not in PEERS:
        raise LocalkvError(f"unknown --vs {vs!r}: the only engine to compare against is llama.cpp")


def _check_output(output: str):
    check_output(output)


def _check_suite(suite: str):
    if suite not in SUITE_NAMES:
        raise LocalkvError(f"unknown bench suite {suite!r}: use one of {', '.join(SUITE_NAMES)}")


def bench_command(
    model: str | None = typer.Option(None, "-m", "--model", help="Catalog name, .gguf file or model directory."),
    n_prompt: int = typer.Option(512, "-p", "--n-prompt", help="speed: prompt tokens of the pp test (0: skip it)."),
    n_gen: int = typer.Option(128, "-n", "--n-gen", help="speed: generated tokens of the tg test (0: skip it)."),
    repetitions: int | None = typer.Option(
        None,
        "-r",
        "--repetitions",
        help="Timed reps, interleaved with --vs: speed 5 (mean ± sd, as llama-bench), fork and cache 3 (medians), "
        "--quick 1.",
    ),
    threads: int | None = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores)."),
    vs: str | None = typer.Option(
        None,
        "--vs",
        help="Also run llama.cpp (llama-cpp-python) on the same work, "
        "interleaved, with a ratio column (speed, fork, cache).",
    ),
    output: str = typer.Option("md", "-o", "--output", help="md, json or csv."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    kv_mem: str = typer.Option(
        DEFAULT_KV_MEM, "--kv-mem", help="KV pool size, e.g. 512MiB (memory: the memory both allocators share)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Smoke run of the suite at tiny sizes (seconds; CI)."),
    plot: str | None = typer.Option(None, "--plot", help="Write PNG charts into this folder (needs matplotlib)."),
    long: bool = typer.Option(
        False, "--long", help="evict: also a 10,000-token generation under a 1,024-token budget per policy."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the workloads, random tokens and sampling."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    suite: str = typer.Argument(
        "speed",
        help="speed (pp/tg t/s), memory (paged vs contiguous KV use), fork "
        "(best-of-8 sharing), cache (TTFT cold/warm, chat hit rate), evict "
        "(perplexity under KV budgets), or all.",
    ),
):
    """Measure localkv: speed (default; pp512/tg128 like llama-bench), memory, fork, cache, evict or all.

    Each suite prints what it measured, the hardware and load, the command that reproduces it, and
    the targets it checks. --vs llama.cpp runs llama-cpp-python on the same work in the same run."""
    from localkv.bench import report as br
    from localkv.bench.suites import RUNNERS, SUITES, Options

    _check_suite(suite)
    _check_vs(vs)
    _check_output(output)
    if plot is not None:
        br.require_matplotlib()
    if suite in ("speed", "all") and not quick and (n_prompt < 0 or n_gen < 0 or not (n_prompt or n_gen)):
        raise LocalkvError("nothing to bench: give -p and/or -n a token count >= 1")
    if repetitions is not None and repetitions < 1:
        raise LocalkvError(f"invalid repetitions {repetitions}: must be >= 1")
    if vs:
        from localkv.bench.peer import INSTALL_HINT, peer_available

        if not peer_available():  # before the engine loads, so the error comes at once
            raise LocalkvError(f"--vs llama.cpp needs llama-cpp-python, which is not installed ({INSTALL_HINT})")

    def say(msg):
        return print(f"bench: {msg}", file=sys.stderr, flush=True)

    opts = Options(
        model=model,
        threads=threads,
        vs=vs,
        block_size=block_size,
        kv_mem=kv_mem,
        quick=quick,
        long=long,
        seed=seed,
        reps=repetitions,
        n_prompt=n_prompt,
        n_gen=n_gen,
        device=device,
        progress=say,
    )
    names = SUITES if suite == "all" else (suite,)
    reports = []
    for i, name in enumerate(names):
        rep = RUNNERS[name](opts)
        reports.append(rep)
        if output == "md":
            sys.stdout.write(("\n" if i else "") + br.format_md(rep))
        elif output == "csv":
            sys.stdout.write(("\n" if i else "") + br.format_csv(rep))
            say(f"{name}: {br.hardware_line(rep.hardware)}; {br.load_line(rep.hardware)}; command: {rep.command}")
        sys.stdout.flush()
        if plot is not None:
            for path in br.plot(rep, plot):
                say(f"wrote {path}")
    if output == "json":
        sys.stdout.write(br.format_json(reports, single=len(reports) == 1))
