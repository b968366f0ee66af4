"""How `run` and `fork` show a generation's Result: text or one JSON object (--json) on stdout,
timings and KV use on stderr (-v). Builds strings and dicts only; the commands print them."""

import json
from dataclasses import dataclass

from localkv.conversations.turn import Turn
from localkv.units import format_size


@dataclass(frozen=True, slots=True)
class Saved:
    """Where the exchange went in the conversation log, as short ids; None and () when it was not
    saved (--no-save)."""

    conversation: str | None = None
    replies: tuple[str, ...] = ()

    @classmethod
    def of(cls, turn: Turn, reply_ids: list[str]) -> "Saved":
        st = turn.store
        if st is None:
            return cls()
        return cls(st.short_id(turn.conversation_id), tuple(st.short_id(i) for i in reply_ids))


def dumps(out: dict) -> str:
    return json.dumps(out, ensure_ascii=False)


def reply_json(engine, r, saved: Saved, logprobs: bool) -> dict:
    """`run --json`: the reply, its counts and timings, and the KV use."""
    bs, s = engine.block_size, engine.stats
    out = {
        "model": engine.model_config.name,
        "text": r.text,
        "reasoning": r.reasoning,  # a thinking model's thinking ("" for others)
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "reasoning_tokens": r.branches[0].reasoning_tokens if r.branches else 0,
        "cached_tokens": r.cached_tokens,
        "finish_reason": r.finish_reason,
        "timings": r.timings(),
        "speculation": r.speculation(),
        "ctx": engine.ctx,
        "kv": {
            "dtype": engine.kv_dtype,
            "bytes_per_token": engine.kv_bytes_per_token,
            "block_size": bs,
            "blocks_used": r.peak_blocks,
            "token_slots": r.peak_blocks * bs,
            "pool_blocks": engine.pool.num_blocks,
            "cow_copies": s.cow_copies,
            "evictions": s.evictions,
            "offloads": s.offloads,
            "recalls": s.recalls,
            "peak_active_tokens": r.peak_active_tokens,
        },
    }
    if logprobs:
        out["logprobs"] = logprobs_json(engine, r.branches[0])
    if saved.conversation is not None:
        out["conversation_id"] = saved.conversation
        out["message_id"] = saved.replies[0]
    return out


def reply_verbose(engine, r, saved: Saved) -> str:
    """`run -v`: timings and KV use, in ollama's layout."""
    t = r.timings()
    bs = engine.block_size
    b = r.branches[0] if r.branches else None
    thinking = f", {b.reasoning_tokens} of them thinking" if b is not None and b.gate is not None else ""
    lines = [
        f"total duration:       {r.load_s + r.prompt_s + r.eval_s:.3f}s",
        f"load duration:        {r.load_s:.3f}s"
        + ("" if engine.loaded.cache_hit else " (first start: weights dequantized)"),
        f"prompt eval count:    {r.prompt_tokens} token(s)",
        f"prompt eval duration: {r.prompt_s:.3f}s",
        f"prompt eval rate:     {t['prompt_tps']:.2f} tokens/s",
        f"eval count:           {r.completion_tokens} token(s){thinking}",
        f"eval duration:        {r.eval_s:.3f}s",
        f"eval rate:            {t['eval_tps']:.2f} tokens/s",
        f"time to first token:  {r.ttft_s:.3f}s",
        f"kv cache:             {r.peak_blocks} blocks x {bs} tokens "
        f"({r.peak_blocks * bs} slots for {r.prompt_tokens + r.completion_tokens} tokens) "
        f"of {engine.pool.num_blocks} blocks; {engine.kv_dtype}, {format_size(engine.kv_bytes_per_token)} per token",
        f"context:              {engine.ctx} tokens per sequence (--ctx)",
        f"finish reason:        {r.finish_reason}",
    ]
    if engine.prefix_caching:
        lines.insert(3, f"prefix cache:         {r.cached_tokens}/{r.prompt_tokens} prompt tokens reused")
    lines += _policy_lines(engine, r) + _spec_lines(r)
    if saved.conversation is not None:
        lines.append(f"conversation:         {saved.conversation} (message {saved.replies[0]})")
    return "\n".join(lines)


def _policy_lines(engine, r) -> list[str]:
    """What the KV policy did, with its last few events; nothing under --evict none."""
    s, ev = engine.stats, engine.policy.config
    if ev.policy == "none":
        return []
    lines = [
        f"kv policy:            {ev.policy}, budget {ev.budget} tokens; peak "
        f"{r.peak_active_tokens} active; {s.evictions} evictions, {s.offloads} offloads, "
        f"{s.recalls} recalls"
    ]
    for e in list(s.events)[-5:]:
        lines.append(
            f"  {e.kind:<8} block {e.block:<5} positions {e.positions[0]}-{e.positions[1]} "
            f"score {e.score:.3f}  {e.reason}"
        )
    return lines


def _spec_lines(r) -> list[str]:
    """What speculation did, or why it was off for the request; nothing under --spec off."""
    if r.spec_note:
        return [f"speculation:          off for this request: {r.spec_note}"]
    if r.spec == "off":
        return []
    s = r.speculation()
    share = f" ({100 * s['accepted'] / s['drafted']:.0f}%)" if s["drafted"] else ""
    return [
        f"speculation:          {s['mode']}: {s['accepted']}/{s['drafted']} drafted tokens accepted{share}, "
        f"{s['accepted_per_verify']:.2f} per verify pass; {s['tokens_per_pass']:.2f} tokens per pass, "
        f"{s['gain']:.2f}x the plain speed by the measured pass costs"
    ]


def _fork_kv(engine, res) -> dict:
    bs = engine.block_size
    return {
        "block_size": bs,
        "blocks_used": res.peak_blocks,
        "blocks_unshared": res.unshared_blocks,
        "token_slots_used": res.peak_blocks * bs,
        "token_slots_unshared": res.unshared_blocks * bs,
        "cow_copies": res.cow_copies,
    }


def fork_json(engine, res, saved: Saved, logprobs: bool) -> dict:
    """`fork --json`: each branch with its saved id, and the KV use with and without sharing."""
    out = {
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": res.cached_tokens,
        "branches": [
            {
                "id": saved.replies[i] if saved.replies else None,
                "text": b.text,
                "reasoning": b.reasoning,
                "completion_tokens": len(b.tokens),
                "finish_reason": b.finish_reason,
            }
            | ({"logprobs": logprobs_json(engine, b)} if logprobs else {})
            for i, b in enumerate(res.branches)
        ],
        "speculation": res.speculation(),
        "ctx": engine.ctx,
        "kv": _fork_kv(engine, res),
    }
    if saved.conversation is not None:
        out["conversation_id"] = saved.conversation
    return out


def fork_text(engine, res, saved: Saved) -> str:
    """`fork`: each branch under a header with its saved id, then the KV use with and without sharing."""
    lines = []
    for i, b in enumerate(res.branches):
        label = f" {saved.replies[i]}" if saved.replies else ""
        lines += [f"--- branch {i + 1}/{len(res.branches)}{label} ---", b.text]
    kv = _fork_kv(engine, res)
    lines.append(
        f"kv: {kv['blocks_used']} blocks ({kv['token_slots_used']} token slots) with sharing vs "
        f"{kv['blocks_unshared']} blocks ({kv['token_slots_unshared']} slots) without; "
        f"{kv['cow_copies']} copy-on-write copies"
    )
    return "\n".join(lines)


def fork_verbose(engine, res, saved: Saved) -> str:
    """`fork -v`: the prompt's and the branches' timings."""
    t = res.timings()
    text = (
        f"prompt eval:          {res.prompt_tokens} tokens ({res.cached_tokens} from the prefix cache) "
        f"in {res.prompt_s:.3f}s\n"
        f"eval:                 {res.completion_tokens} tokens in {res.eval_s:.3f}s, {t['eval_tps']:.2f} "
        f"tokens/s across {len(res.branches)} branches\n"
        f"context:              {engine.ctx} tokens per sequence (--ctx)"
    )
    for line in _spec_lines(res):
        text += "\n" + line
    if saved.conversation is not None:
        text += f"\nconversation:         {saved.conversation}"
    return text


def logprobs_json(engine, branch) -> list[dict]:
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
