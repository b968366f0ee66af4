"""PNG charts of a bench report (`localkv bench --plot DIR`, needs matplotlib): memory -> pool use
over time, evict -> perplexity vs budget, cache -> TTFT cold/warm, fork -> KV slots and decode
throughput, speed -> tokens/s per test."""

from pathlib import Path

from localkv.bench.report import Report, hardware_line
from localkv.errors import LocalkvError

PLOT_HINT = "pip install matplotlib"


def require_matplotlib():
    """The pyplot module (Agg backend), or a LocalkvError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise LocalkvError(f"--plot needs matplotlib, which is not installed ({PLOT_HINT})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(report: Report, directory: str | Path) -> list[Path]:
    """PNG charts of one report in directory: memory -> pool use over time, evict -> perplexity
    vs budget, cache -> TTFT cold/warm, fork -> KV slots and decode throughput. Returns the files."""
    plt = require_matplotlib()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    draw = {
        "memory": _plot_memory,
        "evict": _plot_evict,
        "cache": _plot_cache,
        "fork": _plot_fork,
        "speed": _plot_speed,
    }.get(report.suite)
    if draw is None or not report.rows:
        return []
    fig = draw(plt, report)
    if fig is None:
        return []
    path = d / f"bench-{report.suite}.png"
    fig.suptitle(f"localkv bench {report.suite} ({hardware_line(report.hardware)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _plot_memory(plt, report: Report):
    series = report.series.get("allocators") or {}
    if not series:
        return None
    series = {k: v for k, v in series.items() if k in ("paged", "contiguous")}  # the oracle variants: table only
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for i, (name, s) in enumerate(series.items()):
        color = f"C{i}"
        a.plot(s["step"], s["reserved"], color=color, lw=1, label=f"{name}: reserved")
        a.plot(s["step"], s["stored"], color=color, lw=1, ls="--", label=f"{name}: holding tokens")
        b.plot(s["step"], s["running"], color=color, lw=1, label=name)
    arena = report.summary.get("arena_slots")
    if arena:
        a.axhline(arena, color="gray", lw=0.8, ls=":", label="pool size")
    a.set_ylabel("KV token slots")
    a.set_title("pool use over time (same memory, same workload)", fontsize=9)
    a.legend(fontsize=7, ncol=2)
    b.set_xlabel("step (one token per running request)")
    b.set_ylabel("requests running")
    b.legend(fontsize=7)
    return fig


def _plot_evict(plt, report: Report):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = next((r["ppl"] for r in report.rows if r["policy"] == "full"), None)
    for i, pol in enumerate(p for p in dict.fromkeys(r["policy"] for r in report.rows) if p != "full"):
        pts = sorted((r["budget_pct"], r["ppl"]) for r in report.rows if r["policy"] == pol)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=f"C{i}", label=pol)
    if full is not None:
        ax.axhline(full, color="gray", ls="--", lw=1, label=f"full cache ({full:.2f})")
    ax.set_xlabel("KV budget (% of the text's tokens)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("perplexity vs KV budget", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _plot_cache(plt, report: Report):
    rows = [r for r in report.rows if r.get("ttft_s")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['engine']}\n{r['condition']}" for r in rows]
    vals = [r["ttft_s"] for r in rows]
    bars = ax.bar(labels, vals, color=["C0" if r["engine"] == "localkv" else "C1" for r in rows])
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.3g}s", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("time to first token (s, log)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT, {report.summary.get('prompt_tokens', '?')}-token prompt, new process each", fontsize=9)
    return fig


def _plot_fork(plt, report: Report):
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.8))
    s = report.summary
    a.bar(["with sharing", "without"], [s.get("kv_slots_shared", 0), s.get("kv_slots_unshared", 0)], color=["C0", "C7"])
    a.set_ylabel("KV token slots held")
    a.set_title("best-of-N KV memory", fontsize=9)
    rows = [r for r in report.rows if r.get("decode_tps")]
    b.bar(
        [r["engine"] for r in rows],
        [r["decode_tps"] for r in rows],
        color=["C0" if r["engine"] == "localkv" else "C1" for r in rows],
    )
    b.set_ylabel("decode tokens/s, all branches")
    b.set_title("aggregate decode throughput", fontsize=9)
    return fig


def _plot_speed(plt, report: Report):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    tests = list(dict.fromkeys(r["test"] for r in report.rows))
    engines = list(dict.fromkeys(r["engine"] for r in report.rows))
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        by = {r["test"]: r["avg_ts"] for r in report.rows if r["engine"] == e}
        ax.bar([j + i * width for j in range(len(tests))], [by.get(t, 0) for t in tests], width, label=e)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(tests))], tests)
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    return fig
