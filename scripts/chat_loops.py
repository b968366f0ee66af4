"""How often a reply runs away: 30 prompts of the chat kind, each answered once under each
sampling setting, counting the replies that run to max_tokens in a loop: the reply hit
max_tokens and an 8-token run recurs 3 times or more in its second half.

    python scripts/chat_loops.py [--command chat|run] [-m MODEL] [--max-tokens 512] [--threads 2]
                                 [--setting 'repeat_penalty=1.1' ...] [--show]

--command chat (the default) answers every prompt in one batch per setting, in this process,
with the sampling `localkv chat` resolves (the model's catalog defaults, then the setting).
With chat, 8 short tasks whose answers repeat the prompt or themselves (copy, fix spelling,
count) are also answered greedily under the setting's penalties: what they cost normal text.
--command run answers each prompt with a `localkv run` process of its own at its defaults, as a
shell script would (settings do not apply there). A setting is comma-separated NAME=VALUE
pairs over the catalog defaults ('' is the defaults themselves; a tuple field takes strings apart
by |). Prompt i is answered with seed i, so a run is reproducible on the same backend. Prints
one line per setting and exits 0.
"""

import argparse
import json
import subprocess
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
# tasks whose right answer repeats the prompt or itself, answered greedily under a setting's
# penalties: what a penalty against loops costs normal text (the text each answer should hold)
TASKS = [
    ("What is the capital of France? Answer in one word.", "Paris"),
    ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.", "jumps over the lazy dog"),
    ("Correct the spelling: Teh cat sat on teh mat.", "cat sat on the mat"),
    ("Write the numbers from 1 to 10, separated by commas.", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"),
    ("List the days of the week, one per line.", "Friday"),
    ("Translate to French: I love you.", "Je t'aime"),
    ("What is 2 + 2?", "4"),
    ("Rewrite in the past tense: I walk to the store and buy milk.", "walked to the store"),
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
        kind = types[name]
        if "tuple" in str(kind):  # strings apart by |, with \\n for a newline: dry_sequence_breakers=:|*
            out[name] = tuple(v.replace("\\n", "\n") for v in value.split("|"))
        else:
            out[name] = (int if kind in (int, "int") else float)(value)
    return out


def answer_all(engine: Engine, params: SamplingParams, prompts=PROMPTS) -> list:
    """Every prompt's Result, in one batch through one scheduler."""
    tok = engine.tokenizer
    sched = Scheduler(engine, max_seqs=len(prompts))
    gens = []
    for i, p in enumerate(prompts):
        ids = tok.encode(tok.render_chat([{"role": "user", "content": p}]))
        gens.append(Generation(engine, ids, replace(params, seed=i), queued=True))
        sched.add(gens[-1])
    while sched.busy:
        sched.step()
    return [g.result for g in gens]


def answer_by_run(engine: Engine, max_tokens: int) -> list[tuple[list[int], str, str]]:
    """Every prompt through `localkv run` at its defaults: (token ids, finish reason, text)."""
    out = []
    for i, p in enumerate(PROMPTS):
        cmd = [sys.executable, "-m", "localkv", "run", "-m", str(engine.path), "-n", str(max_tokens), "--seed", str(i)]
        cmd += ["--threads", str(engine.config.threads), "--no-save", "--json", "--logprobs", "0", p]
        done = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        out.append(([t["id"] for t in done["logprobs"]], done["finish_reason"], done["text"]))
    return out


def answer_in_batch(engine: Engine, text: str, max_tokens: int) -> tuple[list, SamplingParams]:
    params = sampling_for(engine.path, setting(text) | {"max_tokens": max_tokens})
    return [(r.tokens, r.finish_reason, r.text) for r in answer_all(engine, params)], params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--command", choices=("chat", "run"), default="chat")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-mem", default="1GiB")
    ap.add_argument("--setting", action="append", help="NAME=VALUE,... over the catalog defaults (repeatable)")
    ap.add_argument("--show", action="store_true", help="print each looping reply's start")
    a = ap.parse_args(argv)
    settings = a.setting or [""]
    if a.command == "run" and settings != [""]:
        raise SystemExit("--command run measures `localkv run` at its defaults: give no --setting")
    engine = Engine(EngineConfig(model=a.model, threads=a.threads, kv_mem=a.kv_mem, disk_cache=False))
    print(f"model: {engine.path.name}; {len(PROMPTS)} prompts through {a.command}, max_tokens {a.max_tokens}")
    for text in settings:
        t0 = time.perf_counter()
        if a.command == "run":
            replies, params = answer_by_run(engine, a.max_tokens), sampling_for(engine.path)
        else:
            replies, params = answer_in_batch(engine, text, a.max_tokens)
        loops = [i for i, (tokens, finish, _) in enumerate(replies) if looped(tokens, finish)]
        long = sum(finish == "length" for _, finish, _ in replies)
        mean = sum(len(tokens) for tokens, _, _ in replies) / len(replies)
        keys = ("temperature", "top_k", "top_p", "repeat_penalty", "dry_multiplier")
        sampled = ", ".join(f"{k} {getattr(params, k)}" for k in keys)
        print(
            f"{text or 'catalog defaults':<28} ({sampled}): {len(loops)}/{len(replies)} loop to max_tokens, "
            f"{long} reach it, {mean:.0f} tokens a reply on average; {time.perf_counter() - t0:.0f}s"
        )
        if a.command == "chat":
            tasks = answer_all(engine, replace(params, temperature=0, max_tokens=96), [t for t, _ in TASKS])
            kept = [want in r.text for r, (_, want) in zip(tasks, TASKS)]
            print(f"    greedy tasks that repeat text, under the same penalties: {sum(kept)}/{len(kept)} right")
        for i in loops if a.show else ():
            print(f"    loop {i}: {PROMPTS[i]!r} -> {replies[i][2][:120]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
