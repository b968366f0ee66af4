"""`localkv bench memory`: the allocator simulation (memory.py) as a suite report, paged pool vs
contiguous reservation, against the vLLM paper's figures."""

from localkv import kv_format
from localkv.bench import memory as bm
from localkv.bench.options import Options, size_flag
from localkv.bench.report import Column, LoadMeter, Report, Target, ratio

SMOLLM2 = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M's K/V geometry
KV_DTYPES = ("f16", "q8_0", "q4_0", "q8_0:q4_0")
DTYPE_COLUMNS = [
    Column("kv_dtype", "K/V", left=True),
    Column("bytes_per_token", "bytes/token", ","),
    Column("tokens_per_gib", "tokens per GiB", ","),
    Column("arena_slots", "tokens in --kv-mem", ","),
    Column("mean_batch", "batch (mean)", ".1f"),
    Column("peak_batch", "batch (peak)"),
    Column("vs_f16", "at once vs f16", "x"),
    Column("preemptions", "preemptions"),
    Column("steps", "steps"),
]

COLUMNS = [
    Column("allocator", "allocator", left=True),
    Column("utilization", "holds tokens", "%"),
    Column("internal_frag", "internal frag", "%"),
    Column("reserved_for_later", "for later", "%"),
    Column("never_used", "never used", "%"),
    Column("external_frag", "external frag", "%"),
    Column("mean_batch", "batch (mean)", ".1f"),
    Column("peak_batch", "batch (peak)"),
    Column("steps", "steps"),
    Column("preemptions", "preemptions"),
]
NOTES = [
    "contiguous reserves max length per request (pre-vLLM engines); contiguous-pow2 and "
    "contiguous-exact know each request's final length, which no real engine does: they show where "
    "the waste comes from",
    "internal frag = for later (a future token of the same request lands there) + never used; "
    "external frag = free slots the next waiting request cannot use, share of the memory",
    "paged preemptions free the newest request and recompute its tokens on re-admission (vLLM)",
    "a deterministic simulation: machine load does not change these numbers",
]
QUICK_NOTE = "--quick: 64 short requests in 4,096 slots; the targets are for the full workload"


def config(o: Options) -> bm.MemoryConfig:
    """The documented workload in --kv-mem's worth of SmolLM2-135M K/V; --quick: a small one."""
    bs = o.engine.block_size
    if o.quick:
        return bm.MemoryConfig(
            n_requests=64,
            seed=o.seed,
            max_len=512,
            prompt_range=(8, 256),
            output_range=(8, 256),
            arena_slots=4096,
            block_size=bs,
        )
    return bm.MemoryConfig(seed=o.seed, arena_slots=bm.arena_slots(o.engine.kv_mem, bs), block_size=bs)


def run(o: Options) -> Report:
    meter = LoadMeter()
    cfg = config(o)
    o.say(f"memory: {cfg.n_requests} requests through {cfg.arena_slots} token slots, paged and contiguous")
    reqs, results = bm.run(cfg)
    rep = Report(
        "memory",
        "share of reserved KV holding real tokens, fragmentation and requests that fit at "
        "once: paged pool vs contiguous reservation, same memory, same seeded workload "
        "(allocator-level simulation, no model)",
        command=o.command("memory", None),
        rows=[r.row() for r in results],
        columns=list(COLUMNS),
    )
    paged, contig = results[0], results[1]
    fit = ratio(paged.mean_batch, contig.mean_batch)
    rep.summary = _summary(o, cfg, bm.workload_stats(reqs), fit)
    rep.targets = _targets(paged, contig, fit, judged=not o.quick)
    rep.notes = NOTES + [QUICK_NOTE] * o.quick
    rep.series = {"allocators": {r.allocator: r.series for r in results}}
    o.say(f"memory: the paged pool in --kv-mem's worth of SmolLM2-135M K/V per format ({', '.join(KV_DTYPES)})")
    dtypes = by_dtype(o, cfg, reqs)
    rep.more = [("per K/V format (paged)", list(DTYPE_COLUMNS), dtypes)]
    rep.targets.append(_dtype_target(dtypes, judged=not o.quick))
    return meter.finish(rep, None)


def bytes_per_token(kv_dtype: str) -> int:
    """SmolLM2-135M's K and V of one token over all layers in a --kv-dtype's formats."""
    k, v = kv_format.parse(kv_dtype)
    g = SMOLLM2
    return g["layers"] * g["kv_heads"] * (k.row_bytes(g["head_dim"]) + v.row_bytes(g["head_dim"]))


def by_dtype(o: Options, cfg: bm.MemoryConfig, reqs: list[bm.Request]) -> list[dict]:
    """The workload through the paged pool that --kv-mem (quick: 4,096 f16 slots' bytes) holds
    in each K/V format: tokens per GiB and in the pool, requests at once, preemptions."""
    memory = bytes_per_token("f16") * cfg.arena_slots if o.quick else o.engine.kv_mem
    rows = []
    for d in KV_DTYPES:
        per = bytes_per_token(d)
        slots = bm.arena_slots(memory, cfg.block_size, per)
        r = bm.simulate(bm.PagedMemory(slots, cfg.block_size), reqs).row()
        r |= {"kv_dtype": d, "bytes_per_token": per, "tokens_per_gib": bm.arena_slots(1 << 30, cfg.block_size, per)}
        rows.append(r)
    for r in rows:
        r["vs_f16"] = ratio(r["mean_batch"], rows[0]["mean_batch"])
    return rows


def _dtype_target(rows: list[dict], judged: bool) -> Target:
    q8 = next(r for r in rows if r["kv_dtype"] == "q8_0")
    x = ratio(q8["tokens_per_gib"], rows[0]["tokens_per_gib"])
    return Target("tokens in the same pool, q8_0 vs f16 K/V", f"{x:.2f}x", ">= 1.85x", x >= 1.85 if judged else None)


def _summary(o: Options, cfg: bm.MemoryConfig, w: dict, fit: float | None) -> dict:
    memory = f"{cfg.arena_slots:,} token slots ({cfg.arena_slots // cfg.block_size:,} blocks of {cfg.block_size})"
    if not o.quick:
        memory += (
            f" = --kv-mem {size_flag(o.engine.kv_mem)} of SmolLM2-135M fp32 K/V "
            f"({bm.SMOLLM2_KV_BYTES_PER_TOKEN:,} bytes/token)"
        )
    return {
        "workload": f"{cfg.n_requests} requests, seed {cfg.seed}, prompt and output lengths log-uniform in "
        f"{cfg.prompt_range[0]}-{cfg.prompt_range[1]} tokens each, max length {cfg.max_len}",
        "prompt tokens mean / median / max": f"{w['prompt_mean']:.0f} / {w['prompt_median']:.0f} / {w['prompt_max']}",
        "output tokens mean / median / max": f"{w['output_mean']:.0f} / {w['output_median']:.0f} / {w['output_max']}",
        "arena_slots": cfg.arena_slots,
        "memory": memory,
        "paged vs contiguous requests at once (mean while queued)": f"{fit:.2f}x" if fit else "n/a",
    }


def _targets(paged: bm.SimResult, contig: bm.SimResult, fit: float | None, judged: bool) -> list[Target]:
    """The issue's targets; judged=False (--quick: a smaller workload than they are for) leaves
    them not measured."""

    def judge(ok: bool) -> bool | None:
        return ok if judged else None

    return [
        Target(
            "paged: reserved KV holding real tokens",
            f"{paged.utilization * 100:.1f}%",
            ">= 96%",
            judge(paged.utilization >= 0.96),
        ),
        Target(
            "contiguous (max length): reserved KV holding real tokens",
            f"{contig.utilization * 100:.1f}%",
            "20-40%, as the vLLM paper reports",
            judge(0.20 <= contig.utilization <= 0.40),
        ),
        Target(
            "requests at once, paged vs contiguous",
            f"{fit:.2f}x" if fit else "n/a",
            ">= 2x",
            judge(bool(fit and fit >= 2)),
        ),
    ]
