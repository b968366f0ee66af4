"""`localkv bench spec`: speculative decoding by prompt lookup on issue 31's tasks (data/
spec_tasks.toml): four whose replies copy their context (a rename, a spelling fix, a quote, a
list of an earlier answer) and a free-chat control. Each task runs greedy with --spec off and
--spec ngram (and, with --vs, llama-cpp-python with LlamaPromptLookupDecoding), reps
interleaved; decode t/s are medians of the reps, and the texts with and without speculation
must be identical; each run drafts from its own context only (the engine's shared n-grams are
cleared before it: the rep before wrote the same reply). With --draft-model, --spec draft runs
beside them (its own columns; the targets stay prompt lookup's)."""

from dataclasses import replace
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from localkv.bench.options import Options
from localkv.bench.peer import PeerRunner
from localkv.bench.report import Column, LoadMeter, Report, Target, median, ratio
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.hub.catalog import DEFAULT_MODEL, entry_for
from localkv.result import Result
from localkv.sampling import SamplingParams
from localkv.spec.control import forget_texts, k_max

TASKS = Path(__file__).parent / "data" / "spec_tasks.toml"
FULL_TOKENS, QUICK_TOKENS = 256, 24
GROUNDED, CONTROL = ("a", "b", "c", "d"), "e"
# the targets: speculation's issue (per task vs --spec off, each task vs llama.cpp's lookup, the
# control never slower), and the accepted tokens per pass from the issue that began the suite
SPEEDUP = {"a": 3.0, "b": 3.0, "c": 1.5, "d": 1.5}
VS_PEER, CONTROL_FLOOR, PER_VERIFY = 3.0, 0.97, 3.0

COLUMNS = [
    Column("task", "task", left=True),
    Column("what", "what", left=True),
    Column("off_tps", "decode t/s off", ".1f"),
    Column("ngram_tps", "decode t/s ngram", ".1f"),
    Column("speedup", "speedup", "x"),
    Column("accepted_per_verify", "accepted / verify pass", ".2f"),
    Column("tokens_per_pass", "tokens / pass", ".2f"),
    Column("draft_tps", "decode t/s draft", ".1f"),
    Column("draft_speedup", "draft speedup", "x"),
    Column("draft_accepted_per_verify", "draft accepted / verify", ".2f"),
    Column("identical", "same text", left=True),
    Column("peer_tps", "llama.cpp lookup t/s", ".1f"),
    Column("vs_llama_cpp", "vs llama.cpp", "x"),
]


def load_tasks() -> list[dict]:
    return tomllib.loads(TASKS.read_text(encoding="utf-8"))["task"]


def prompt_ids(eng: Engine, task: dict) -> list[int]:
    tok = eng.tokenizer
    messages = [{"role": t["role"], "content": t["content"]} for t in task["turn"]]
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True))


def run(o: Options) -> Report:
    meter = LoadMeter()
    n = QUICK_TOKENS if o.quick else FULL_TOKENS
    reps = o.reps or (1 if o.quick else 3)
    engines = {
        "off": o.new_engine(prefix_cache=False, spec="off"),
        "ngram": o.new_engine(prefix_cache=False, spec="ngram"),
    }
    if o.engine.draft_model:  # --draft-model: the draft model's speculation beside prompt lookup's
        engines["draft"] = o.new_engine(prefix_cache=False, spec="draft")
    tasks = load_tasks()
    prompts = [prompt_ids(engines["off"], t) for t in tasks]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for p in prompts:
        engines["off"].check_fits(len(p), n)
    runs = measure(o, engines, prompts, params, reps)
    rows = [_row(t, runs[t["name"]]) for t in tasks]
    eng, k = engines["off"], k_max(engines["ngram"].config.spec_max, "ngram")
    rep = Report(
        "spec",
        f"speculative decoding by prompt lookup: {len(tasks)} chat tasks, greedy, {n} tokens (EOS ignored), "
        f"--spec off vs ngram (k {k}), {reps} interleaved rep(s), medians"
        + (f", and --spec draft with {o.engine.draft_model}" if "draft" in engines else "")
        + (", beside llama-cpp-python's LlamaPromptLookupDecoding" if o.vs else ""),
        command=o.command("spec", eng.threads),
        rows=rows,
        columns=[c for c in COLUMNS if "draft" in engines or not c.key.startswith("draft")],
    )
    e = entry_for(eng.path)
    judged = not o.quick and e is not None and e.name == DEFAULT_MODEL
    rep.targets = _targets(rows, judged)
    grounded = [r for r in rows if r["task"] in GROUNDED]
    rep.summary = {
        "reps": reps,
        "mean_accepted_per_verify_a_d": round(sum(r["accepted_per_verify"] for r in grounded) / len(grounded), 3),
        "identical": all(r["identical"] == "yes" for r in rows),
    }
    rep.notes = [
        "decode t/s: tokens after the first / the time from the prompt's logits to the last token",
        "accepted / verify pass: drafted tokens accepted per pass that verified a draft; tokens / pass: "
        "generated tokens per forward pass (the prompt's included)",
    ] + ([] if o.vs else ["add --vs llama.cpp for llama-cpp-python with prompt-lookup decoding"])
    return meter.finish(rep, eng.threads)


PEER_DRAFT_ROOM = 16


def measure(o: Options, engines: dict, prompts: list[list[int]], params: SamplingParams, reps: int) -> dict:
    """Every task on every side, reps interleaved (off, ngram, llama.cpp, next task, ...), after
    one short warm-up run per engine (kernels compiled)."""
    n = params.max_tokens
    # llama-cpp-python evaluates a prompt-lookup draft (10 tokens at its defaults) past the last
    # token it hands back: its context needs that room too
    ctx = -(-(max(map(len, prompts)) + n + 1 + PEER_DRAFT_ROOM) // 256) * 256
    peer = PeerRunner(engines["off"].path, engines["off"].threads, ctx, prompt_lookup=True) if o.vs else None
    names = [t["name"] for t in load_tasks()]
    runs = {name: {side: [] for side in [*engines, "peer"]} for name in names}
    try:
        for eng in engines.values():
            Generation(eng, prompts[0], replace(params, max_tokens=4)).run()
        for i in range(reps):
            for name, prompt in zip(names, prompts):
                for side, eng in engines.items():
                    o.say(f"spec task {name} --spec {side} rep {i + 1}/{reps}: {n} tokens")
                    # each run drafts from its own text only: the engine's shared n-grams would
                    # otherwise hold the same greedy reply from the rep before (a copy to draft)
                    forget_texts(eng)
                    runs[name][side].append(Generation(eng, prompt, params).run())
                if peer:
                    o.say(f"spec task {name} llama.cpp prompt lookup rep {i + 1}/{reps}")
                    runs[name]["peer"].append(peer.greedy(prompt, n))
    finally:
        if peer:
            peer.close()
    return runs


def _tps(r: Result) -> float:
    return r.timings()["eval_tps"]


def _row(task: dict, runs: dict) -> dict:
    off, on, peer = runs["off"], runs["ngram"], runs["peer"]
    s = on[-1].speculation()  # greedy: every rep drafts and accepts the same
    row = {
        "task": task["name"],
        "what": task["what"],
        "off_tps": median([_tps(r) for r in off]),
        "ngram_tps": median([_tps(r) for r in on]),
        "accepted_per_verify": s["accepted_per_verify"],
        "tokens_per_pass": s["tokens_per_pass"],
        "drafted": s["drafted"],
        "accepted": s["accepted"],
        "identical": "yes" if all(r.tokens == off[0].tokens for r in _ours(runs)) else "no",
        "peer_tps": median([(len(x["tokens"]) - 1) / x["decode_s"] for x in peer if x["decode_s"]]),
    }
    row["speedup"] = ratio(row["ngram_tps"], row["off_tps"])
    if draft := runs.get("draft"):
        d = draft[-1].speculation()
        row |= {"draft_tps": median([_tps(r) for r in draft]), "draft_accepted_per_verify": d["accepted_per_verify"]}
        row |= {"draft_drafted": d["drafted"], "draft_accepted": d["accepted"]}
        row["draft_speedup"] = ratio(row["draft_tps"], row["off_tps"])
    row["vs_llama_cpp"] = ratio(row["ngram_tps"], row["peer_tps"])
    return row


def _ours(runs: dict) -> list[Result]:
    return [r for side, rs in runs.items() if side != "peer" for r in rs]


def _targets(rows: list[dict], judged: bool) -> list[Target]:
    """The issue's rows; speed is judged on SmolLM2 at full size only, identical text always."""
    by = {r["task"]: r for r in rows}
    out = []
    for name in GROUNDED:
        x, goal = by[name]["speedup"], SPEEDUP[name]
        out.append(Target(f"task {name} decode vs --spec off", _x(x), f">= {goal}x", _ok(judged, x, goal)))
    for name in GROUNDED:
        x = by[name]["vs_llama_cpp"]
        goal = f">= {VS_PEER}x"
        out.append(Target(f"task {name} decode vs llama.cpp prompt lookup", _x(x), goal, _ok(judged, x, VS_PEER)))
    x = by[CONTROL]["speedup"]
    out.append(Target("task e (control) vs --spec off", _x(x), f">= {CONTROL_FLOOR}x", _ok(judged, x, CONTROL_FLOOR)))
    mean = sum(by[name]["accepted_per_verify"] for name in GROUNDED) / len(GROUNDED)
    out.append(
        Target(
            "accepted per verify pass, tasks a-d (mean)",
            f"{mean:.2f}",
            f">= {PER_VERIFY}",
            _ok(judged, mean, PER_VERIFY),
        )
    )
    same = all(r["identical"] == "yes" for r in rows)
    out.append(
        Target("text with vs without speculation, all tasks", "identical" if same else "differs", "identical", same)
    )
    return out


def _x(x: float | None) -> str:
    return f"{x:.2f}x" if x else "n/a"


def _ok(judged: bool, x: float | None, floor: float) -> bool | None:
    return None if not judged or x is None else x >= floor
