"""`localkv run` and `localkv fork`: one reply, or N replies sharing the prompt's KV blocks."""

import json
import sys

import typer

from localkv.cli.app import err, read_prompt, warn_disk
from localkv.cli.options import Sampling, engine_options, sampling_options
from localkv.cli.prefill_bar import PrefillBar
from localkv.config import EngineConfig
from localkv.conversations.turn import Turn, plan_turn
from localkv.errors import LocalkvError

SystemOpt = typer.Option(None, "-s", "--system", help="System prompt (new conversations).")
SaveOpt = typer.Option(False, "--no-save", help="Do not save this exchange in the conversation log.")
ContinueOpt = typer.Option(False, "-c", "--continue", help="Continue the latest conversation.")
CidOpt = typer.Option(None, "--cid", help="Continue the conversation with this id (see `localkv log`).")


def _prompt_ids(engine, turn: Turn, text: str | None, raw: bool) -> list[int]:
    tok = engine.tokenizer
    if raw:
        return tok.encode("\n".join([m["content"] for m in turn.messages(None)] + ([text] if text else [])))
    return tok.encode(tok.render_chat(turn.messages(text), add_generation_prompt=True))


def _start(engine_cfg: EngineConfig):
    from localkv.engine import Engine

    return Engine(engine_cfg, progress=sys.stderr.isatty())


@engine_options()
@sampling_options(output=True)
def run(
    prompt: str | None = typer.Argument(None, help="The prompt. Text piped on stdin is put before it."),
    system: str | None = SystemOpt,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    no_stream: bool = typer.Option(False, "--no-stream", help="Print the reply only when it is complete."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, counts, timings, KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings and KV use on stderr."),
    cont: bool = ContinueOpt,
    cid: str | None = CidOpt,
    no_save: bool = SaveOpt,
    *,
    engine: EngineConfig,
    sampling: Sampling,
):
    """Generate a reply to PROMPT and stream it to stdout; the exchange is saved in the conversation log."""
    from localkv.generation import Generation

    text = read_prompt(prompt)
    turn = plan_turn(not no_save, cont, cid, None, system, text)
    eng = _start(engine)
    params = sampling.resolve(eng.path)
    bar = PrefillBar()
    gen = Generation(eng, _prompt_ids(eng, turn, text, raw), params, on_progress=bar)
    stream = not (no_stream or as_json)
    try:
        for piece in gen:
            if stream:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass  # keep what was generated; the result says "interrupted"
    finally:
        bar.close()
    r = gen.result
    _, reply_ids = turn.save(eng.model_config.name, text, [(r.text, r.completion_tokens)], r.prompt_tokens, params)
    if as_json:
        out = _result_json(eng, r)
        if params.logprobs is not None:
            out["logprobs"] = _logprobs_json(eng, r.branches[0])
        if turn.store is not None:
            out["conversation_id"] = turn.store.short_id(turn.conversation_id)
            out["message_id"] = turn.store.short_id(reply_ids[0])
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write(("" if stream else r.text) + "\n")
        sys.stdout.flush()
    warn_disk(eng)
    if r.finish_reason == "kv_budget" and not as_json:
        err(f"stopped: {r.stop_detail}")
    if verbose:
        _print_verbose(eng, r)
        if turn.store is not None:
            err(
                f"conversation:         {turn.store.short_id(turn.conversation_id)} "
                f"(message {turn.store.short_id(reply_ids[0])})"
            )
    if r.finish_reason == "interrupted":
        raise typer.Exit(130)


@engine_options()
@sampling_options(defaults={"max_tokens": 256}, output=True)
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
    as_json: bool = typer.Option(False, "--json", help="One JSON object: branches and KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings on stderr."),
    no_save: bool = SaveOpt,
    *,
    engine: EngineConfig,
    sampling: Sampling,
):
    """Sample N alternative replies that share the prompt's KV blocks (best-of-N), decoded as one batch,
    and save them as sibling branches. All branches must fit the KV pool at once; the command says so
    before any work when they do not."""
    from localkv.generation import Generation

    if branches < 1:
        raise LocalkvError(f"invalid --branches {branches}: must be >= 1")
    text = read_prompt(prompt, required=not from_msg)
    turn = plan_turn(not no_save, cont, cid, from_msg, system, text)
    eng = _start(engine)
    params = sampling.resolve(eng.path)
    bar = PrefillBar()
    try:
        res = Generation(eng, _prompt_ids(eng, turn, text, raw=False), params, n=branches, on_progress=bar).run()
    finally:
        bar.close()
    _, reply_ids = turn.save(
        eng.model_config.name, text, [(b.text, len(b.tokens)) for b in res.branches], res.prompt_tokens, params
    )
    short = turn.store.short_id if turn.store is not None else (lambda i: None)
    bs = eng.block_size
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
                | ({"logprobs": _logprobs_json(eng, b)} if params.logprobs is not None else {})
                for i, b in enumerate(res.branches)
            ],
            "ctx": eng.ctx,
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
    warn_disk(eng)
    if verbose:
        t = res.timings()
        err(
            f"prompt eval:          {res.prompt_tokens} tokens ({res.cached_tokens} from the prefix cache) "
            f"in {res.prompt_s:.3f}s\n"
            f"eval:                 {res.completion_tokens} tokens in {res.eval_s:.3f}s, {t['eval_tps']:.2f} "
            f"tokens/s across {len(res.branches)} branches\n"
            f"context:              {eng.ctx} tokens per sequence (--ctx)"
        )
        if turn.store is not None:
            err(f"conversation:         {short(turn.conversation_id)}")


def _result_json(engine, r) -> dict:
    return {
        "model": engine.model_config.name,
        "text": r.text,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "finish_reason": r.finish_reason,
        "timings": r.timings(),
        "ctx": engine.ctx,
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


def _logprobs_json(engine, branch) -> list[dict]:
    """Per token: its text, id, log-probability and the top alternatives (sampling.py says
    which distribution they are read from)."""
    tok = engine.tokenizer

    def text(i: int) -> str:
        return tok.token_bytes(i).decode("utf-8", "replace")

    return [
        {
            "token": text(lp.token),
            "id": lp.token,
            "logprob": round(lp.logprob, 6),
            "top": [{"token": text(i), "id": i, "logprob": round(v, 6)} for i, v in lp.top],
        }
        for lp in branch.logprobs
    ]


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
        f"context:              {engine.ctx} tokens per sequence (--ctx)",
        f"finish reason:        {r.finish_reason}",
    ]
    if engine.prefix_caching:
        lines.insert(3, f"prefix cache:         {r.cached_tokens}/{r.prompt_tokens} prompt tokens reused")
    s = engine.stats
    ev = engine.policy.config
    if ev.policy != "none":
        lines.append(
            f"kv policy:            {ev.policy}, budget {ev.budget} tokens; peak "
            f"{r.peak_active_tokens} active; {s.evictions} evictions, {s.offloads} offloads, "
            f"{s.recalls} recalls"
        )
        for e in list(s.events)[-5:]:
            lines.append(
                f"  {e.kind:<8} block {e.block:<5} positions {e.positions[0]}-{e.positions[1]} "
                f"score {e.score:.3f}  {e.reason}"
            )
    err("\n".join(lines))
