"""How often a chat reply runs away (issue 35): 30 prompts of the chat kind, each answered once
under each sampling setting (the model's catalog defaults as `localkv chat` uses them, then the
same with a repeat penalty and other changes), counting the replies that run to max_tokens in a
loop: the reply hit max_tokens and an 8-token run recurs 3 times or more in its second half.

    python scripts/chat_loops.py [-m MODEL] [--max-tokens 512] [--threads 2] [--setting 'repeat_penalty=1.1' ...]

A setting is comma-separated NAME=VALUE pairs over the catalog defaults ('' is the defaults
themselves). Every prompt is answered in one batch per setting with seed = its index, so a run
is reproducible on the same backend. Prints one line per setting and exits 0.
"""

import argparse
import sys
import time
from collections import Counter
from dataclasses import fields, replace

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.hub.catalog import sampling_for
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler

PROMPTS = [
    "Write a haiku about memory pages.",
    "Write a short poem about the sea.",
    "Tell me a joke about computers.",
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "What should I cook for dinner tonight?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of tea?",
    "What is a black hole?",
    "Write a haiku about autumn leaves.",
    "Describe your ideal weekend.",
    "What are the benefits of exercise?",
    "Tell me a short story about a dragon.",
    "How does a computer store data?",
    "What is the difference between weather and climate?",
    "Write a four-line poem about coffee.",
    "Give me a motivational quote and explain it.",
    "What is machine learning?",
    "How many legs does a spider have?",
    "Write a thank-you note to a teacher.",
    "What are some good habits for studying?",
    "Explain what a prime number is.",
    "Write a haiku about the moon.",
    "Why do leaves change color in the fall?",
    "Suggest a name for a pet goldfish.",
    "What is the water cycle?",
    "Write a short poem about friendship.",
]
RUN, TIMES = 8, 3  # a loop: an 8-token run that recurs 3 times in the reply's second half


def looped(tokens: list[int], finish_reason: str) -> bool:
    if finish_reason != "length":
        return False
    half = tokens[len(tokens) // 2 :]
    runs = Counter(tuple(half[i : i + RUN]) for i in range(len(half) - RUN + 1))
    return bool(runs) and max(runs.values()) >= TIMES


def setting(text: str) -> dict:
    """'repeat_penalty=1.1,top_k=20' -> {'repeat_penalty': 1.1, 'top_k': 20}."""
    types = {f.name: f.type for f in fields(SamplingParams)}
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = pair.partition("=")
        if name not in types or not value:
            raise SystemExit(f"bad setting {pair!r}: expected NAME=VALUE with NAME a SamplingParams field")
        out[name] = (int if types[name] in (int, "int") else float)(value)
    return out


def answer_all(engine: Engine, params: SamplingParams) -> list:
    """Every prompt's Result, in one batch through one scheduler."""
    tok = engine.tokenizer
    sched = Scheduler(engine, max_seqs=len(PROMPTS))
    gens = []
    for i, p in enumerate(PROMPTS):
        ids = tok.encode(tok.render_chat([{"role": "user", "content": p}]))
        gens.append(Generation(engine, ids, replace(params, seed=i), queued=True))
        sched.add(gens[-1])
    while sched.busy:
        sched.step()
    return [g.result for g in gens]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-mem", default="1GiB")
    ap.add_argument("--setting", action="append", help="NAME=VALUE,... over the catalog defaults (repeatable)")
    ap.add_argument("--show", action="store_true", help="print each looping reply's start")
    a = ap.parse_args(argv)
    settings = a.setting or ["", "repeat_penalty=1", "repeat_penalty=1.1"]
    engine = Engine(EngineConfig(model=a.model, threads=a.threads, kv_mem=a.kv_mem, disk_cache=False))
    print(f"model: {engine.path.name}; {len(PROMPTS)} chat prompts, max_tokens {a.max_tokens}")
    for text in settings:
        params = sampling_for(engine.path, setting(text) | {"max_tokens": a.max_tokens}, chat=True)
        t0 = time.perf_counter()
        results = answer_all(engine, params)
        loops = [i for i, r in enumerate(results) if looped(r.tokens, r.finish_reason)]
        long = sum(r.finish_reason == "length" for r in results)
        mean = sum(len(r.tokens) for r in results) / len(results)
        sampled = ", ".join(f"{k} {getattr(params, k)}" for k in ("temperature", "top_k", "top_p", "repeat_penalty"))
        print(
            f"{text or 'catalog defaults':<28} ({sampled}): {len(loops)}/{len(results)} loop to max_tokens, "
            f"{long} reach it, {mean:.0f} tokens a reply on average; {time.perf_counter() - t0:.0f}s"
        )
        for i in loops if a.show else ():
            print(f"    loop {i}: {PROMPTS[i]!r} -> {results[i].text[:120]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
