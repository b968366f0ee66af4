"""Quality under a KV budget: teacher-forced perplexity of the real model on a long text
(the GPL-3.0 license, localkv/bench/text.py) for each eviction policy and budget.

Tokens go through the engine in chunks (default 16: one block) with all logits kept; the
policy acts before every chunk, so each chunk's queries see exactly the blocks the policy
kept, as token-by-token decoding would up to the chunk's own causal window.
"""

import math
import time
from dataclasses import dataclass

import numpy as np

from localkv.bench.text import text_tokens
from localkv.kv.evict import EvictConfig
from localkv.sequence import Sequence


@dataclass(slots=True)
class PplRow:
    policy: str
    budget: int | None  # tokens; None = full cache
    budget_pct: int
    ppl: float
    peak_active: int
    evictions: int
    offloads: int
    recalls: int
    seconds: float


def perplexity(engine, tokens: list[int], chunk: int = 16) -> tuple[float, int]:
    """exp(mean NLL of tokens[1:]) with the engine's current policy; and the most tokens of
    K/V one layer attended to at once (measured after every step: the pool's share, plus what
    offload read back from its tier)."""
    seq = Sequence(list(tokens))
    nll, count, peak = 0.0, 0, 0
    try:
        while seq.pending:
            start = seq.num_computed
            logits = engine.forward([seq], chunk, all_logits=True)
            peak = max(peak, engine.policy.active_tokens(seq))
            for i, row in enumerate(logits):
                pos = start + i + 1  # row i predicts the token after it
                if pos < len(tokens):
                    row = row.astype(np.float64)
                    m = row.max()
                    nll += m + math.log(np.exp(row - m).sum()) - row[tokens[pos]]
                    count += 1
    finally:
        engine.free(seq)
    return math.exp(nll / count), peak


def run(
    make_engine,
    n_tokens: int = 4096,
    budgets_pct=(10, 20, 30, 50),
    policies=("sliding", "h2o", "offload"),
    chunk: int = 16,
    log=None,
) -> list[PplRow]:
    """make_engine(EvictConfig | None) -> Engine. Returns one row per (policy, budget) plus full cache."""
    rows = []

    def measure(policy, budget, pct):
        eng = make_engine(EvictConfig(policy=policy, budget=budget) if budget else None)
        toks = text_tokens(eng, n_tokens)
        s0 = (eng.stats.evictions, eng.stats.offloads, eng.stats.recalls)
        t = time.perf_counter()
        # a full cache gives the same logits however the text is chunked: big chunks are faster
        ppl, peak = perplexity(eng, toks, chunk if budget else 512)
        s = eng.stats
        row = PplRow(
            policy,
            budget,
            pct,
            ppl,
            peak,
            s.evictions - s0[0],
            s.offloads - s0[1],
            s.recalls - s0[2],
            time.perf_counter() - t,
        )
        rows.append(row)
        if log:
            log(
                f"{policy:<8} budget {budget or 'full':>5}  ppl {ppl:8.3f}  peak active {peak:5d}  ({row.seconds:.1f}s)"
            )

    measure("full", None, 100)
    for pct in budgets_pct:
        for policy in policies:
            measure(policy, n_tokens * pct // 100, pct)
    return rows


def verdict(rows: list[PplRow]) -> list[str]:
    """The issue's targets, checked on measured rows."""
    full = next(r.ppl for r in rows if r.budget is None)
    by = {(r.policy, r.budget_pct): r for r in rows}
    out = []
    for pct in sorted({r.budget_pct for r in rows if r.budget and r.budget_pct <= 30}):
        if ("h2o", pct) in by and ("sliding", pct) in by:
            h, s = by["h2o", pct].ppl, by["sliding", pct].ppl
            out.append(f"h2o < sliding at {pct}%: {h:.3f} vs {s:.3f} -> {'PASS' if h < s else 'FAIL'}")
    if ("offload", 20) in by:
        o = by["offload", 20].ppl
        out.append(
            f"offload at 20% within 2% of full: {o:.3f} vs {full:.3f} ({(o / full - 1) * 100:+.2f}%) -> "
            f"{'PASS' if o <= full * 1.02 else 'FAIL'}"
        )
    over = [r for r in rows if r.budget and r.peak_active > r.budget]
    out.append("active KV never above budget -> " + ("PASS" if not over else f"FAIL ({len(over)} rows)"))
    return out
