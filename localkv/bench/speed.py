"""`localkv bench speed`, llama-bench style: pp N times a prefill of N random tokens; tg N times
N single-token decode steps after a 1-token prompt. At depth D (llama-bench's -d) both run after
D random tokens already in the K/V: a sequence of D tokens is prefilled once per depth, untimed,
and every rep continues a copy of it (localkv: a fork sharing its blocks; llama.cpp: its K/V
past D removed), so the timed part is what llama-bench times.

Rows use llama-bench's JSON field names and the table its layout, so results can sit next to
llama-bench's. With --vs llama.cpp the same tests run on llama-cpp-python with the same GGUF
and threads, reps interleaved (A B A B ...) so machine noise hits both alike.
"""

import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

import numpy as np

from localkv.bench import bandwidth, rss, start
from localkv.bench.options import Options
from localkv.bench.peer import PeerRunner, check_vs
from localkv.bench.report import LoadMeter, Report, Target, cpu_info
from localkv.bench.speed_table import format_speed_table
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.sequence import Sequence

NOTE = (
    "prefix caching off, as llama-bench has none: each rep reuses the blocks the last one freed "
    "(pages already mapped, as llama.cpp reuses its KV buffer)"
)


RSS_NOTE = (
    "peak RSS: ru_maxrss of a fresh `localkv run -n 16 --json` child (and of a llama-cpp-python child doing the "
    "same chat turn), as /usr/bin/time reports it; mapped model pages count once touched. Peak private: the "
    "most anonymous memory (smaps_rollup's Pss_Anon) seen in samples every 20 ms, what the process costs the "
    "machine beyond page cache; USS also counts the clean model pages only it maps (bench/rss.py)"
)


TRAFFIC_NOTE = (
    "GB/s: bytes moved per test / its mean time; each pass (a tg token, a pp chunk) reads every matmul weight "
    "and the output head once (the file's bytes) and the K/V of its context once (the engine's row format); "
    "of read probe: that rate over the probe's median during the test's reps (bench/bandwidth.py)"
)

PEER_NOTE = (
    f"llama.cpp: f16 K/V, n_batch {PeerRunner.chunk}, flash attention {'on' if PeerRunner.flash_attn else 'off'}"
)

QUICK_PROBE_BYTES = 64 << 20  # --quick: the probe's path, not a figure

# issue 32: tg128's share of the read probe at depth 0, by the weights' type (llama-3.2-1b shapes;
# a Q4_K_M file's type is Q4_K, ModelConfig.quant's name for it)
PROBE_SHARE_GOALS = {"Q4_K": 0.85, "Q8_0": 0.80, "Q4_0": 0.80}


START_NOTE = (
    "engine start: a fresh process's imports of localkv and Engine(config), page cache warm, "
    "the interpreter's own start not counted (bench/start.py)"
)


@dataclass(slots=True, frozen=True)
class Test:
    base: str  # "pp512" / "tg128", as llama-bench names them
    n_prompt: int
    n_gen: int
    n_depth: int = 0  # tokens already in the K/V when the test starts

    @classmethod
    def parse(cls, name: str) -> "Test":
        m = re.fullmatch(r"(pp|tg)(\d+)", name)
        if not m or int(m.group(2)) < 1:
            raise LocalkvError(f"invalid bench test {name!r}: use ppN (prompt processing) or tgN (generation), N >= 1")
        n = int(m.group(2))
        return cls(name, n, 0) if m.group(1) == "pp" else cls(name, 0, n)

    def at(self, depth: int) -> "Test":
        return Test(self.base, self.n_prompt, self.n_gen, depth)

    @property
    def name(self) -> str:
        """llama-bench's test column: "tg128", "tg128 @ d4096"."""
        return self.base + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def n_ctx(self) -> int:
        return self.n_depth + self.n_prompt + self.n_gen + 1


class LocalRunner:
    """localkv's side of a test: timers over the engine's public steps (prefill, decode, free)."""

    name = "localkv"

    def __init__(self, engine: Engine):
        self.engine = engine
        self.base: Sequence | None = None  # the depth's tokens, computed; every rep forks it
        self.chunk = engine.config.prefill_chunk  # prompt tokens per pass

    def set_depth(self, tokens: list[int]):
        """Tests from now on start after these tokens (none: from an empty K/V)."""
        if self.base is not None:
            self.engine.free(self.base)
            self.base = None
        if tokens:
            self.base = Sequence(list(tokens))
            self.engine.prefill(self.base)

    def _fresh(self, tokens: list[int]) -> Sequence:
        if self.base is None:
            return Sequence(list(tokens))
        seq = self.engine.fork(self.base)
        seq.tokens += tokens
        return seq

    def pp(self, tokens: list[int]) -> float:
        eng, seq = self.engine, self._fresh(tokens)
        try:
            t0 = perf_counter()
            eng.prefill(seq)
            return perf_counter() - t0
        finally:
            eng.free(seq)

    def tg(self, first: int, n: int) -> float:
        eng, seq = self.engine, self._fresh([first])
        try:
            logits = eng.prefill(seq)
            t0 = perf_counter()
            for _ in range(n):
                seq.tokens.append(int(np.argmax(logits)))  # greedy: cheap and deterministic
                logits = eng.decode([seq])[0]
            return perf_counter() - t0
        finally:
            eng.free(seq)


def _measure(runner, test: Test, tokens: list[int]) -> float:
    return runner.pp(tokens) if test.n_prompt else runner.tg(tokens[0], test.n_gen)


def _tokens(test: Test, vocab: int, rep: int, seed: int, warm: bool = False) -> list[int]:
    # the same ids for every engine at a given rep, different ids across reps
    rng = np.random.default_rng([seed, warm, rep, test.n_prompt, test.n_gen] + [test.n_depth] * bool(test.n_depth))
    return rng.integers(0, vocab, max(test.n_prompt, 1)).tolist()


def _depth_tokens(depth: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng([seed, depth, 1]).integers(0, vocab, depth).tolist()


def check_depths(depths) -> tuple[int, ...]:
    depths = tuple(depths)
    if not depths or any(d < 0 for d in depths):
        raise LocalkvError(f"invalid depth {','.join(map(str, depths))}: give token counts >= 0, e.g. -d 0,4096")
    return depths


def speed_rows(
    engine: Engine,
    tests=("pp512", "tg128"),
    reps: int = 5,
    warmup: int = 1,
    vs: str | None = None,
    seed: int = 0,
    progress=None,
    depths=(0,),
    probe=None,
) -> list[dict]:
    """One row per (depth, test, engine); with vs="llama.cpp" a llama.cpp row follows each
    localkv row. progress(msg) is called before each rep (bench_command sends it to stderr).
    Each row says the bytes its passes move (bandwidth.py) and their GB/s; with a probe
    (bandwidth.ReadProbe) one probe pass follows each round of reps, and each row gets the
    probe's median over its test and its share of it."""
    tests = [t if isinstance(t, Test) else Test.parse(t) for t in tests]
    if reps < 1:
        raise LocalkvError(f"invalid repetitions {reps}: must be >= 1")
    check_vs(vs)
    plan = [[t.at(d) for t in tests] for d in check_depths(depths)]
    for t in (t for ts in plan for t in ts):
        engine.check_fits(t.n_depth + max(t.n_prompt, 1), t.n_gen)
    runners = [LocalRunner(engine)]
    if vs:
        n_ctx = -(-max(t.n_ctx for ts in plan for t in ts) // 256) * 256
        runners.append(PeerRunner(engine.path, engine.threads, n_ctx))
    say = progress or (lambda msg: None)
    vocab = engine.model_config.vocab_size
    rows = []
    try:
        for ts in plan:
            depth = ts[0].n_depth
            for r in runners:
                say(f"depth {depth}: {r.name} prefills {depth} tokens")
                r.set_depth(_depth_tokens(depth, vocab, seed))
            for t in ts:
                rows += _test_rows(engine, runners, t, reps, warmup, seed, say, probe)
    finally:
        runners[0].set_depth([])
        for r in runners[1:]:
            r.close()
    return rows


def _test_rows(engine: Engine, runners: list, t: Test, reps: int, warmup: int, seed: int, say, probe) -> list[dict]:
    vocab = engine.model_config.vocab_size
    for i in range(warmup):
        for r in runners:
            say(f"{t.name} {r.name} warmup {i + 1}/{warmup}")
            _measure(r, t, _tokens(t, vocab, i, seed, warm=True))
    secs, probed = {r.name: [] for r in runners}, []
    for i in range(reps):
        for r in runners:  # interleaved: A B A B ...
            say(f"{t.name} {r.name} rep {i + 1}/{reps}")
            secs[r.name].append(_measure(r, t, _tokens(t, vocab, i, seed)))
        if probe is not None:  # under the load the reps just ran under
            probed.append(probe.gbps())
    weights = bandwidth.weight_bytes(engine.loaded.weights)
    rows = []
    for r in runners:
        moved = bandwidth.bytes_moved(t.n_depth, t.n_prompt, t.n_gen, r.chunk, weights, _kv_per_token(engine, r))
        rows.append(_row(engine, t, r.name, secs[r.name]) | _traffic(moved, secs[r.name], probed))
        if r.name != "localkv":
            rows[-1]["flash_attn"] = r.flash_attn
        share = f", {rows[-1]['probe_share'] * 100:.0f}% of the read probe" if probed else ""
        say(f"{t.name} {r.name}: {rows[-1]['avg_ts']:.2f} t/s, {rows[-1]['gbps']:.2f} GB/s{share}")
    return rows


def _kv_per_token(engine: Engine, runner) -> int:
    """Bytes of one token's K and V over all layers, as this runner stores them."""
    if isinstance(runner, LocalRunner):
        return engine.kv_bytes_per_token
    m = engine.model_config
    return m.n_layers * m.n_kv_heads * sum(f.row_bytes(m.head_dim) for f in (runner.kv_format, runner.kv_format_v))


def _traffic(moved: int, secs: list[float], probed: list[float]) -> dict:
    gbps = moved / statistics.fmean(secs) / 1e9
    out = {"bytes_moved": moved, "gbps": gbps}
    if probed:
        out |= {"read_probe_gbps": statistics.median(probed), "probe_share": gbps / statistics.median(probed)}
    return out


def _backend(engine: Engine) -> str:
    """llama-bench's backend column for our rows: the device, and AMX where prefill ran on it."""
    return engine.backend.name + (" AMX" if engine.backend.prefill_amx else "")


def _row(engine: Engine, t: Test, name: str, secs: list[float]) -> dict:
    cfg = engine.model_config
    ts = [(t.n_prompt + t.n_gen) / s for s in secs]
    ns = [int(s * 1e9) for s in secs]
    return {
        "engine": name,
        "cpu_info": cpu_info(),
        "model_filename": str(engine.path),
        "model_type": f"llama {_short_params(cfg.n_params)} {cfg.quant}",
        "model_size": cfg.file_size,
        "model_n_params": cfg.n_params,
        "backend": _backend(engine) if name == "localkv" else "CPU",
        "n_threads": engine.threads,
        "test": t.name,
        "n_prompt": t.n_prompt,
        "n_gen": t.n_gen,
        "n_depth": t.n_depth,
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


def run(o: Options) -> Report:
    meter = LoadMeter()
    n_prompt, n_gen, reps = (64, 16, 1) if o.quick else (o.n_prompt, o.n_gen, o.reps or 5)
    tests = [f"pp{n_prompt}"] * bool(n_prompt) + [f"tg{n_gen}"] * bool(n_gen)
    eng = o.new_engine(prefix_cache=False)  # as llama-bench: no prefix cache, the pool's blocks reused
    o.say("read probe: compile and fill its buffer")
    probe = bandwidth.ReadProbe(eng.threads, *((QUICK_PROBE_BYTES, 0.0) if o.quick else ()))
    try:
        rows = speed_rows(eng, tests, reps=reps, vs=o.vs, seed=o.seed, progress=o.say, depths=o.depths, probe=probe)
    finally:
        probe.close()
    r = ratios(rows)
    at = f" at depth {', '.join(map(str, o.depths))}" if o.depths != (0,) else ""
    rep = Report(
        "speed",
        f"prompt processing ({', '.join(tests)}) and generation speed{at}, llama-bench style, "
        f"{reps} rep(s)" + (", interleaved with llama.cpp" if o.vs else ""),
        command=o.command("speed", eng.threads),
        rows=rows,
        table_md=format_speed_table(rows, r),
    )
    rep.summary = {f"{t} localkv / llama.cpp": f"{x:.2f}x" for t, x in r.items()}
    rep.summary["read probe"] = (
        f"{statistics.median(row['read_probe_gbps'] for row in rows):.1f} GB/s, median over the run: a sum of "
        f"{probe.nbytes >> 20} MiB of 64-bit words on up to {probe.threads} thread(s) (fewer while other processes "
        "hold cores, as the kernels), passes for a second after each round of reps (--quick: one)"
    )
    rep.targets = _targets(rows, eng.model_config.quant, judged=not o.quick)
    rep.notes = [NOTE, TRAFFIC_NOTE] + ([PEER_NOTE] if o.vs else [])
    if not o.quick and Path(eng.path).is_file():  # peak memory of a whole `localkv run` (and llama.cpp's)
        o.say("peak memory of `localkv run -n 16` in a child process" + (" and of llama.cpp" if o.vs else ""))
        lines, targets = rss.summary(Path(eng.path), eng.kv_bytes_per_token, eng.threads, o.vs)
        rep.summary |= lines
        rep.targets += targets
        o.say("engine start (imports + Engine()) in fresh processes")
        rep.summary |= start.summary(str(eng.path), eng.threads)
        rep.notes += [RSS_NOTE, START_NOTE]
    return meter.finish(rep, eng.threads)


def _targets(rows: list[dict], quant: str, judged: bool) -> list[Target]:
    goal = PROBE_SHARE_GOALS.get(quant)
    tg = [r for r in rows if r["engine"] == "localkv" and r["n_gen"] and not r["n_depth"] and "probe_share" in r]
    if goal is None or not tg:
        return []
    x = tg[0]["probe_share"]
    return [
        Target(
            f"{tg[0]['test']} share of the read probe ({quant})",
            f"{x * 100:.0f}%",
            f">= {goal * 100:.0f}%",
            x >= goal if judged else None,
        )
    ]
