"""`localkv bench [SUITE]`: the one place for measurements (the suites live in localkv/bench/)."""

import sys

import typer

from localkv.cli.options import engine_options
from localkv.config import EngineConfig
from localkv.errors import LocalkvError

REPS = typer.Option(
    None,
    "-r",
    "--repetitions",
    help="Timed reps, interleaved with --vs: speed 5 (mean ± sd, as llama-bench), fork and cache 3 (medians), "
    "grammar 5 (medians), --quick 1.",
)
VS = typer.Option(
    None,
    "--vs",
    help="Also run llama.cpp (llama-cpp-python) on the same work, interleaved, with a ratio column "
    "(speed, fork, cache, spec).",
)
URL = typer.Option(
    None,
    "--url",
    help="serve: run the same load against this OpenAI-compatible server (llama-server, vLLM, SGLang, Ollama, "
    "localkv) instead of starting localkv's own; -m is the local model whose tokenizer cuts the workload.",
)
DEPTH = typer.Option(
    None,
    "-d",
    "--n-depth",
    help="speed: tokens already in the K/V before each test, comma-separated as llama-bench's -d "
    "(default 0; `all`: 0,4096).",
)
LONG = typer.Option(
    False, "--long", help="evict: also a 10,000-token generation under a 1,024-token budget per policy."
)
SUITE = typer.Argument(
    "speed",
    help="speed (pp/tg t/s), memory (paged vs contiguous KV use), fork (best-of-8 sharing), cache (TTFT cold/warm, "
    "chat hit rate), evict (perplexity under KV budgets), kv (perplexity, KLD and top-1 of q8_0/q4_0 K/V vs f16), "
    "grammar (decode t/s under a JSON schema's mask), "
    "serve (the OpenAI server under 8 concurrent clients), spec (speculative decoding by prompt lookup), or all.",
)


@engine_options(
    "model",
    "threads",
    "block_size",
    "kv_mem",
    "kv_dtype",
    "device",
    "spec",
    "spec_max",
    "draft_model",
    flags={"threads": ("-t", "--threads")},
    defaults={"spec": "off"},  # llama-bench's plain decode, unless a suite is asked to speculate
)
def bench_command(
    n_prompt: int = typer.Option(512, "-p", "--n-prompt", help="speed: prompt tokens of the pp test (0: skip it)."),
    n_gen: int = typer.Option(128, "-n", "--n-gen", help="speed: generated tokens of the tg test (0: skip it)."),
    n_depth: str | None = DEPTH,
    repetitions: int | None = REPS,
    vs: str | None = VS,
    output: str = typer.Option("md", "-o", "--output", help="md, json or csv."),
    quick: bool = typer.Option(False, "--quick", help="Smoke run of the suite at tiny sizes (seconds; CI)."),
    plot: str | None = typer.Option(None, "--plot", help="Write PNG charts into this folder (needs matplotlib)."),
    long: bool = LONG,
    url: str | None = URL,
    seed: int = typer.Option(0, "--seed", help="Seed of the workloads, random tokens and sampling."),
    suite: str = SUITE,
    *,
    engine: EngineConfig,
):
    """Measure localkv: speed (default; pp512/tg128 like llama-bench), memory, fork, cache, evict, grammar, serve
    or all.

    Each suite prints what it measured, the hardware and load, the command that reproduces it, and
    the targets it checks. --vs llama.cpp runs llama-cpp-python on the same work in the same run."""
    from localkv import bench  # the lab loads only when a bench runs, not with every command
    from localkv.bench import report
    from localkv.bench.options import Options

    _check(suite, vs=vs, output=output, plot=plot, quick=quick, n_prompt=n_prompt, n_gen=n_gen, reps=repetitions)
    url = _check_url(url, suite, vs)
    depths = _depths(n_depth, suite, quick)

    opts = Options(
        engine=engine,
        vs=vs,
        quick=quick,
        long=long,
        seed=seed,
        reps=repetitions,
        n_prompt=n_prompt,
        n_gen=n_gen,
        depths=depths,
        progress=_say,
        url=url,
    )
    reports = []
    for i, name in enumerate(bench.SUITES if suite == "all" else (suite,)):
        rep = bench.runner(name)(opts)
        reports.append(rep)
        _write(rep, output, plot, first=not i)
    if output == "json":
        sys.stdout.write(report.format_json(reports, single=len(reports) == 1))


def _check(suite: str, *, vs, output: str, plot, quick: bool, n_prompt: int, n_gen: int, reps: int | None):
    """Every bad argument, before the engine loads, so the error comes at once."""
    from localkv.bench import peer, report

    check_suite(suite)
    peer.check_vs(vs)
    report.check_output(output)
    if plot is not None:
        from localkv.bench.plot import require_matplotlib

        require_matplotlib()
    if suite in ("speed", "all") and not quick and (n_prompt < 0 or n_gen < 0 or not (n_prompt or n_gen)):
        raise LocalkvError("nothing to bench: give -p and/or -n a token count >= 1")
    if reps is not None and reps < 1:
        raise LocalkvError(f"invalid repetitions {reps}: must be >= 1")
    why = peer.peer_problem() if vs else None
    if why:
        raise LocalkvError(f"--vs llama.cpp: {why}")


def _check_url(url: str | None, suite: str, vs: str | None) -> str | None:
    """--url as the base the OpenAI paths hang from (a trailing /v1 dropped), or None."""
    if url is None:
        return None
    if suite != "serve":
        raise LocalkvError(f"--url is for `localkv bench serve` only, not {suite!r}")
    if vs:
        raise LocalkvError("--url and --vs: give one (--url measures one server, whichever it is)")
    if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1].strip("/")) == 0:
        raise LocalkvError(f"invalid --url {url!r}: expected http://HOST:PORT (optionally ending in /v1)")
    return url.rstrip("/").removesuffix("/v1")


def _depths(text: str | None, suite: str, quick: bool) -> tuple[int, ...]:
    """-d as depths; unset: 0, and for `all` (not --quick) 0 and 4096 as issue 32 asks."""
    if text is None:
        return (0, 4096) if suite == "all" and not quick else (0,)
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise LocalkvError(f"invalid -d {text!r}: give token counts >= 0, comma-separated (e.g. -d 0,4096)") from None
    if any(d < 0 for d in depths):
        raise LocalkvError(f"invalid -d {text!r}: give token counts >= 0, comma-separated (e.g. -d 0,4096)")
    return depths


def check_suite(suite: str):
    from localkv import bench

    names = (*bench.SUITES, "all")
    if suite not in names:
        raise LocalkvError(f"unknown bench suite {suite!r}: use one of {', '.join(names)}")


def _say(msg: str):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _write(rep, output: str, plot: str | None, first: bool):
    """One suite's report (a bench.report.Report) as it finishes (json: all of them at the end),
    and its charts."""
    from localkv.bench import report

    if output == "md":
        sys.stdout.write(("" if first else "\n") + report.format_md(rep))
    elif output == "csv":
        sys.stdout.write(("" if first else "\n") + report.format_csv(rep))
        hw = rep.hardware
        _say(f"{rep.suite}: {report.hardware_line(hw)}; {report.load_line(hw)}; command: {rep.command}")
    sys.stdout.flush()
    if plot is not None:
        from localkv.bench.plot import plot as draw

        for path in draw(rep, plot):
            _say(f"wrote {path}")
