"""`localkv bench kv`: what quantized K/V costs in quality and buys in room. The GPL-3.0 text
teacher-forced through one engine per --kv-dtype, chunk by chunk in lockstep with an f16
engine (the reference): perplexity, the KL divergence of each token's distribution from
f16's, and how often the most likely token is f16's; with the bytes per token and the tokens
the pool holds.
"""

import math
import time

import numpy as np

from localkv.bench.options import Options
from localkv.bench.report import Column, LoadMeter, Report, Target
from localkv.bench.text import text_tokens
from localkv.sequence import Sequence

FULL = dict(n_tokens=4096, chunk=256)
QUICK = dict(n_tokens=96, chunk=32)
DTYPES = ("q8_0", "q4_0", "q8_0:q4_0")  # each against f16
PPL_Q8_0 = 0.005  # q8_0's perplexity within +0.5% of f16's (issue 33)
ROOM = 1.85  # tokens in the same pool, q8_0 vs f16

COLUMNS = [
    Column("kv_dtype", "K/V", left=True),
    Column("bytes_per_token", "bytes/token"),
    Column("bytes_vs_f16", "vs f16", ".3f"),
    Column("pool_tokens", "pool tokens"),
    Column("ppl", "perplexity", ".4f"),
    Column("ppl_vs_f16", "ppl vs f16", "%"),
    Column("kld", "mean KLD", ".5f"),
    Column("top1", "top-1 = f16", "%"),
    Column("seconds", "s", ".1f"),
]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


class _Run:
    """One engine's pass over the text, a chunk at a time, and its sums against f16's."""

    def __init__(self, engine, tokens: list[int]):
        self.engine, self.tokens = engine, tokens
        self.seq = Sequence(list(tokens))
        self.nll = self.kld = 0.0
        self.same = self.count = 0
        self.seconds = 0.0

    def step(self, chunk: int) -> np.ndarray:
        """The log-probabilities of the next chunk's rows that predict a token of the text."""
        start, t = self.seq.num_computed, time.perf_counter()
        logits = self.engine.forward([self.seq], chunk, all_logits=True)
        self.seconds += time.perf_counter() - t
        rows = min(len(logits), len(self.tokens) - 1 - start)
        return _log_softmax(logits[:rows])

    def add(self, lp: np.ndarray, ref: np.ndarray, start: int):
        targets = np.asarray(self.tokens[start + 1 : start + 1 + len(lp)])
        self.nll -= float(lp[np.arange(len(lp)), targets].sum())
        self.kld += float((np.exp(ref) * (ref - lp)).sum())
        self.same += int((lp.argmax(axis=1) == ref.argmax(axis=1)).sum())
        self.count += len(lp)

    def row(self, f16_bpt: int, f16_ppl: float | None) -> dict:
        eng = self.engine
        ppl = math.exp(self.nll / self.count)
        return {
            "kv_dtype": eng.kv_dtype,
            "bytes_per_token": eng.kv_bytes_per_token,
            "bytes_vs_f16": eng.kv_bytes_per_token / f16_bpt,
            "pool_tokens": eng.pool.num_blocks * eng.block_size,
            "ppl": ppl,
            "ppl_vs_f16": 0.0 if f16_ppl is None else ppl / f16_ppl - 1,
            "kld": self.kld / self.count,
            "top1": self.same / self.count,
            "seconds": self.seconds,
        }


def run(o: Options) -> Report:
    meter = LoadMeter()
    size = QUICK if o.quick else FULL
    f16 = o.new_engine(prefix_cache=False, kv_dtype="f16")
    tokens = text_tokens(f16, size["n_tokens"])
    ref = _Run(f16, tokens)
    runs = [_Run(o.new_engine(prefix_cache=False, kv_dtype=d), tokens) for d in DTYPES]
    while ref.seq.pending:
        start = ref.seq.num_computed
        base = ref.step(size["chunk"])
        ref.add(base, base, start)
        for r in runs:
            r.add(r.step(size["chunk"]), base, start)
        o.say(f"kv: {ref.seq.num_computed}/{len(tokens)} tokens")
    bpt = ref.engine.kv_bytes_per_token
    rows = [ref.row(bpt, None)]
    rows += [r.row(bpt, rows[0]["ppl"]) for r in runs]
    rep = Report(
        "kv",
        f"teacher-forced perplexity of the first {len(tokens)} tokens of the GPL-3.0 text with K/V in "
        f"f16, {', '.join(DTYPES)}; KL divergence and top-1 agreement against the f16 pool's logits",
        command=o.command("kv", ref.engine.threads),
        rows=rows,
        columns=list(COLUMNS),
    )
    rep.targets = _targets({r["kv_dtype"]: r for r in rows}, o.quick)
    rep.summary = {"f16 perplexity": rows[0]["ppl"]}
    return meter.finish(rep, ref.engine.threads)


def _targets(by: dict, quick: bool) -> list[Target]:
    f16, q8, q4 = by["f16"], by["q8_0"], by["q4_0"]
    exact = {"q8_0": 34 / 64, "q4_0": 18 / 64}  # GGUF's block bytes per 32 f16 values' 64
    out = [
        Target(
            f"bytes per token, {name} vs f16",
            f"{by[name]['bytes_vs_f16']:.4f}x",
            f"{ratio:.4f}x, the layout's",
            abs(by[name]["bytes_vs_f16"] - ratio) < 1e-9,
        )
        for name, ratio in exact.items()
    ]
    room = q8["pool_tokens"] / f16["pool_tokens"]
    out.append(Target("tokens in the pool, q8_0 vs f16", f"{room:.2f}x", f">= {ROOM}x", room >= ROOM))
    ok = None if quick else q8["ppl_vs_f16"] <= PPL_Q8_0
    out.append(
        Target(
            "perplexity, q8_0 vs f16",
            f"{q8['ppl']:.4f} vs {f16['ppl']:.4f} ({q8['ppl_vs_f16'] * 100:+.2f}%), KLD {q8['kld']:.5f}, "
            f"top-1 {q8['top1'] * 100:.1f}%",
            f"within +{PPL_Q8_0 * 100:.1f}%",
            ok,
        )
    )
    out.append(
        Target(
            "perplexity, q4_0 vs f16",
            f"{q4['ppl']:.4f} ({q4['ppl_vs_f16'] * 100:+.2f}%), KLD {q4['kld']:.5f}, top-1 {q4['top1'] * 100:.1f}%",
            "report",
            None,
        )
    )
    return out
