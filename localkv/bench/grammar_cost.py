"""`localkv bench grammar`: what structured output costs. The same decode loop (one forward pass,
then the sampler) runs unconstrained and under a JSON schema's token mask (llguidance, grammar.py),
reps interleaved (free, json, free, json, ...) so the machine's load hits both alike; the mask's
cost is the constrained run's lost decode speed, medians of the reps."""

import json
from time import perf_counter

from localkv.bench.options import Options
from localkv.bench.report import Column, LoadMeter, Report, Target, median
from localkv.engine import Engine
from localkv.grammar import Grammar
from localkv.hub.catalog import DEFAULT_MODEL, entry_for
from localkv.sampling import Constraint, Sampler, SamplingParams
from localkv.sequence import Sequence

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
QUESTION = "Describe a fictional person as a JSON object with name, age, city and hobbies."
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95)
COST_TARGET = 0.15  # the bound: masks may cost at most 15% of decode speed (on SmolLM2)
FULL_TOKENS, QUICK_TOKENS = 128, 16

COLUMNS = [
    Column("variant", "sampling", left=True),
    Column("tokens", "tokens", ","),
    Column("decode_tps", "decode t/s", ".1f"),
    Column("forward_ms", "forward ms/token", ".2f"),
    Column("sample_ms", "sampler ms/token", ".3f"),
]


def decode(eng: Engine, prompt: list[int], n: int, seed: int, grammar: Grammar | None) -> tuple[list, list]:
    """n decode steps after the prompt's prefill (not timed): each step's forward-pass seconds
    and sampler seconds (the mask, when there is a grammar, included). A grammar that completes
    starts over, so every step is masked."""
    seq = Sequence(list(prompt))
    stops = eng.tokenizer.stop_ids
    fwd, smp = [], []
    try:
        logits = eng.prefill(seq)
        s = Sampler(SamplingParams(**SAMPLING, seed=seed), grammar.matcher() if grammar else None)
        for _ in range(n):
            t0 = perf_counter()
            tok = s(logits, seq.tokens)
            t1 = perf_counter()
            if grammar is not None and tok in stops:
                s.matcher = grammar.matcher()
            seq.tokens.append(tok)
            logits = eng.decode([seq])[0]
            fwd.append(perf_counter() - t1)
            smp.append(t1 - t0)
        return fwd, smp
    finally:
        eng.free(seq)


def run(o: Options) -> Report:
    meter = LoadMeter()
    n = QUICK_TOKENS if o.quick else FULL_TOKENS
    reps = o.reps or (1 if o.quick else 5)
    eng = o.new_engine(prefix_cache=False)
    tok = eng.tokenizer
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": QUESTION}]))
    eng.check_fits(len(prompt), n + 1)
    grammar = Grammar.compile(Constraint("json_schema", json.dumps(SCHEMA)), tok)
    runs: dict[str, list[tuple[list, list]]] = {"unconstrained": [], "JSON schema": []}
    o.say("grammar warmup: kernels compiled, caches filled")
    for g in (None, grammar):
        decode(eng, prompt, 4, o.seed, g)
    for i in range(reps):
        for name, g in (("unconstrained", None), ("JSON schema", grammar)):
            o.say(f"grammar {name} rep {i + 1}/{reps}: {n} decode steps")
            runs[name].append(decode(eng, prompt, n, o.seed + i, g))
    free, masked = (_row(name, n, r) for name, r in runs.items())
    # the mask's cost: the sampler's extra time per token over an unconstrained step, medians of
    # every step (robust to the bursts of load that move whole-rep totals on a shared machine)
    cost = (masked["sample_ms"] - free["sample_ms"]) / (free["forward_ms"] + free["sample_ms"])
    rep = Report(
        "grammar",
        f"decode with and without a JSON schema's token mask (llguidance): {n} tokens after a "
        f"{len(prompt)}-token chat prompt, temperature 0.8 / top-k 40 / top-p 0.95, {reps} interleaved rep(s); "
        "t/s are medians of the reps, ms/token medians of every step",
        command=o.command("grammar", eng.threads),
        rows=[free, masked],
        columns=list(COLUMNS),
    )
    rep.summary = {
        "mask_ms_per_token": round(masked["sample_ms"] - free["sample_ms"], 4),
        "mask_cost": f"{cost:.1%}",
        "decode_tps_ratio": f"{masked['decode_tps'] / free['decode_tps']:.2f}x",
        "reps": reps,
        "vocab": tok.vocab_size,
    }
    e = entry_for(eng.path)
    judged = not o.quick and e is not None and e.name == DEFAULT_MODEL
    goal = f"<= {COST_TARGET:.0%} of a decode step" + ("" if judged else " on SmolLM2, full size")
    rep.targets = [Target("JSON schema mask cost", f"{cost:.1%}", goal, cost <= COST_TARGET if judged else None)]
    rep.notes = [
        "mask cost = (sampler ms/token with the mask - without) / unconstrained ms per decode step",
        "a grammar that completes starts over, so every timed step is masked; prefix cache off",
    ]
    return meter.finish(rep, eng.threads)


def _row(name: str, n: int, runs: list[tuple[list, list]]) -> dict:
    fwd = [x for f, _ in runs for x in f]
    smp = [x for _, s in runs for x in s]
    return {
        "variant": name,
        "tokens": n,
        "decode_tps": median([n / (sum(f) + sum(s)) for f, s in runs]),
        "forward_ms": 1000 * median(fwd),
        "sample_ms": 1000 * median(smp),
    }
