"""`localkv bench evict`: what a KV budget costs in quality. Teacher-forced perplexity of the
GPL-3.0 text under budgets for each eviction policy and with the full cache (ppl.py), and with
--long one long generation per policy under a small budget, which must run to the end."""

from localkv.bench import ppl
from localkv.bench.options import Options
from localkv.bench.report import Column, LoadMeter, Report, Target
from localkv.bench.text import text_ids
from localkv.generation import Generation
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams

EVICT_FULL = dict(n_tokens=4096, budgets=(10, 20, 30, 50))
EVICT_QUICK = dict(n_tokens=128, budgets=(50,))
LONG_FULL = dict(tokens=10_000, budget=1024)
LONG_QUICK = dict(tokens=200, budget=64)
POLICIES = ("sliding", "h2o", "offload")

COLUMNS = [
    Column("policy", "policy", left=True),
    Column("budget", "budget"),
    Column("budget_pct", "%"),
    Column("ppl", "perplexity", ".3f"),
    Column("ppl_vs_full", "vs full", "x"),
    Column("peak_active", "peak active"),
    Column("evictions", "evictions"),
    Column("offloads", "offloads"),
    Column("recalls", "recalls"),
    Column("seconds", "s", ".1f"),
]
LONG_COLUMNS = [
    Column("policy", "policy", left=True),
    Column("budget", "budget"),
    Column("generated", "generated"),
    Column("finish_reason", "finish", left=True),
    Column("peak_active", "peak active"),
    Column("evictions", "evictions"),
    Column("offloads", "offloads"),
    Column("recalls", "recalls"),
    Column("eval_tps", "t/s", ".1f"),
]


def run(o: Options) -> Report:
    meter = LoadMeter()
    size = EVICT_QUICK if o.quick else EVICT_FULL
    threads = []

    def make_engine(evict: EvictConfig | None):
        eng = o.new_engine(prefix_cache=False, evict=evict)
        threads.append(eng.threads)
        return eng

    measured = ppl.run(
        make_engine,
        n_tokens=size["n_tokens"],
        budgets_pct=size["budgets"],
        policies=POLICIES,
        log=lambda m: o.say(f"evict {m.strip()}"),
    )
    full = next(r.ppl for r in measured if r.budget is None)
    rep = Report(
        "evict",
        f"teacher-forced perplexity of the first {size['n_tokens']} tokens of the GPL-3.0 text "
        f"under KV budgets of {', '.join(f'{b}%' for b in size['budgets'])} for "
        f"{', '.join(POLICIES)}, and the full cache",
        command=o.command("evict", threads[0] if threads else o.engine.threads),
        rows=[_ppl_row(r, full) for r in measured],
        columns=list(COLUMNS),
    )
    rep.targets = _ppl_targets(measured, o.quick)
    rep.summary = {"full-cache perplexity": full}
    if o.long:
        ln = LONG_QUICK if o.quick else LONG_FULL
        long_rows = [_long(o, policy, ln["tokens"], ln["budget"], threads) for policy in POLICIES]
        rep.more = [("long", list(LONG_COLUMNS), long_rows)]
        rep.targets += [_long_target(r, ln["tokens"], ln["budget"]) for r in long_rows]
    else:
        rep.notes.append(
            f"add --long for a {LONG_FULL['tokens']:,}-token generation under a {LONG_FULL['budget']:,}-token "
            "budget per policy"
        )
    if o.vs:
        rep.notes.append("--vs: llama.cpp has no KV eviction policy to compare; localkv rows only")
    return meter.finish(rep, threads[0] if threads else o.engine.threads)


def _ppl_row(r: ppl.PplRow, full: float) -> dict:
    return {
        "policy": r.policy,
        "budget": r.budget,
        "budget_pct": r.budget_pct,
        "ppl": r.ppl,
        "ppl_vs_full": r.ppl / full,
        "peak_active": r.peak_active,
        "evictions": r.evictions,
        "offloads": r.offloads,
        "recalls": r.recalls,
        "seconds": r.seconds,
    }


def _ppl_targets(measured: list[ppl.PplRow], quick: bool) -> list[Target]:
    """ppl.verdict's lines as targets. --quick judges only the budget invariant: quality at smoke
    sizes says nothing, the invariant holds at any size."""
    targets = []
    for line in ppl.verdict(measured):
        head, _, verdict = line.rpartition(" -> ")
        name, _, value = head.partition(": ")
        ok = verdict.startswith("PASS")
        if quick and not name.startswith("active KV"):
            ok = None
        detail = verdict.removeprefix("PASS").removeprefix("FAIL").strip(" ()")
        targets.append(Target(name, value or detail or ("holds" if ok else "fails"), "", ok))
    return targets


def _long(o: Options, policy: str, n_tokens: int, budget: int, threads: list) -> dict:
    eng = o.new_engine(prefix_cache=False, evict=EvictConfig(policy=policy, budget=budget))
    threads.append(eng.threads)
    prompt = text_ids(eng, 64)
    o.say(f"evict long {policy}: {n_tokens} tokens under a {budget}-token budget")
    r = Generation(eng, prompt, SamplingParams(seed=o.seed, max_tokens=n_tokens, ignore_eos=True)).run()
    s = eng.stats
    return {
        "policy": policy,
        "budget": budget,
        "generated": r.completion_tokens,
        "finish_reason": r.finish_reason,
        "peak_active": r.peak_active_tokens,
        "evictions": s.evictions,
        "offloads": s.offloads,
        "recalls": s.recalls,
        "eval_tps": r.timings()["eval_tps"],
        "seconds": r.prompt_s + r.eval_s,
    }


def _long_target(r: dict, n_tokens: int, budget: int) -> Target:
    return Target(
        f"{r['policy']}: {n_tokens:,}-token generation under a {budget}-token budget",
        f"{r['generated']:,} tokens ({r['finish_reason']}), peak active {r['peak_active']}",
        "runs to the end, peak <= budget",
        r["generated"] == n_tokens and r["peak_active"] <= budget,
    )
