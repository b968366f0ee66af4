"""`localkv bench [SUITE]`: the one place for measurements (the suites live in localkv/bench/)."""

import sys

import typer

from localkv.bench import report as br
from localkv.bench.speed import check_suite, check_vs
from localkv.errors import LocalkvError


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
        "1GiB", "--kv-mem", help="KV pool size, e.g. 512MiB (memory: the memory both allocators share)."
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
    from localkv.bench.suites import RUNNERS, SUITES, Options

    check_suite(suite)
    check_vs(vs)
    br.check_output(output)
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
