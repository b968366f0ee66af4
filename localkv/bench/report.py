"""What every `localkv bench` suite hands back, and its three renderings (md, json, csv).

A Report carries what was measured (one line), on which hardware (CPU model, cores, threads)
and under what load (other processes' share of the CPUs during the suite, from /proc/stat
minus this process and its children), the exact command that reproduces it, the rows, a
summary, and the targets of the issues that asked for the numbers (PASS / FAIL / not measured).
"""

import csv
import io
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from localkv.errors import LocalkvError

OUTPUTS = ("md", "json", "csv")
LOADED_SHARE = 0.10  # other processes using more than this share of the CPUs: the numbers are suspect


@dataclass(slots=True)
class Target:
    name: str
    value: str  # the measured value, formatted
    goal: str
    ok: bool | None  # None: not measured in this run

    def line(self) -> str:
        verdict = "not measured" if self.ok is None else ("PASS" if self.ok else "FAIL")
        goal = f" (target {self.goal})" if self.goal else ""
        return f"{self.name}: {self.value}{goal} -> {verdict}"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "value": self.value,
            "goal": self.goal,
            "result": None if self.ok is None else ("pass" if self.ok else "fail"),
        }


@dataclass(slots=True)
class Column:
    key: str
    header: str
    fmt: str = ""  # format spec for numbers ("" = str()); "%" = percent with one decimal
    left: bool = False

    def cell(self, row: dict) -> str:
        v = row.get(self.key)
        if v is None or v == "":
            return ""
        if self.fmt == "%":
            return f"{v * 100:.1f}%"
        if self.fmt == "x":
            return f"{v:.2f}x"
        return format(v, self.fmt) if self.fmt else str(v)


@dataclass(slots=True)
class Report:
    suite: str
    what: str
    command: str = ""
    rows: list[dict] = field(default_factory=list)
    columns: list[Column] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hardware: dict = field(default_factory=dict)
    started: str = ""
    seconds: float = 0.0
    series: dict = field(default_factory=dict)  # chart data; not in json/csv
    table_md: str | None = None  # a suite's own markdown table (speed: llama-bench's)
    more: list[tuple[str, list[Column], list[dict]]] = field(default_factory=list)  # further tables

    def as_dict(self) -> dict:
        return {
            "suite": self.suite,
            "what": self.what,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "hardware": self.hardware,
            "command": self.command,
            "rows": self.rows,
            "tables": {name: rows for name, _, rows in self.more},
            "summary": self.summary,
            "targets": [t.as_dict() for t in self.targets],
            "notes": self.notes,
        }


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# ------------------------------------------------------------------ hardware and load


def cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _busy_s() -> float | None:
    """CPU seconds all processes spent busy since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in parts[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


class LoadMeter:
    """Other processes' CPU use over a suite: machine busy time minus ours (children included)."""

    def __init__(self):
        self.t0, self.busy0, self.own0, self.load0 = time.perf_counter(), _busy_s(), _own_s(), _loadavg()
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def hardware(self, threads: int | None) -> dict:
        wall = time.perf_counter() - self.t0
        cores = os.cpu_count() or 1
        busy = _busy_s()
        other = None
        if busy is not None and self.busy0 is not None and wall > 0:
            other = max(0.0, (busy - self.busy0) - (_own_s() - self.own0)) / (wall * cores)
        return {
            "cpu": cpu_info(),
            "cores": cores,
            "threads": threads,
            "loadavg_start": self.load0,
            "loadavg_end": _loadavg(),
            "other_cpu_share": None if other is None else round(other, 3),
            "loaded": bool(other is not None and other > LOADED_SHARE),
        }

    def finish(self, report: Report, threads: int | None) -> Report:
        report.hardware = self.hardware(threads)
        report.started = self.started
        report.seconds = time.perf_counter() - self.t0
        return report


def hardware_line(hw: dict) -> str:
    s = f"{hw.get('cpu', '?')}, {hw.get('cores', '?')} cores"
    if hw.get("threads"):
        s += f", {hw['threads']} thread" + "s" * (hw["threads"] != 1)
    return s


def load_line(hw: dict) -> str:
    other = hw.get("other_cpu_share")
    if other is None:
        return f"load average {hw.get('loadavg_start')} at start"
    s = (
        f"other processes used {other * 100:.0f}% of the CPUs during the run (load average "
        f"{hw.get('loadavg_start')} at start, {hw.get('loadavg_end')} at end)"
    )
    return s + (": LOADED, numbers may be low" if hw.get("loaded") else "")


# ------------------------------------------------------------------ renderings


def check_output(output: str):
    if output not in OUTPUTS:
        raise LocalkvError(f"unknown --output {output!r}: use md, json or csv")


def md_table(columns: list[Column], rows: list[dict]) -> str:
    table = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in rows]
    w = [max(len(row[i]) for row in table) for i in range(len(columns))]

    def fmt(row):
        return "| " + " | ".join(v.ljust(n) if c.left else v.rjust(n) for c, v, n in zip(columns, row, w)) + " |"

    rule = "| " + " | ".join("-" * n if c.left else "-" * (n - 1) + ":" for c, n in zip(columns, w)) + " |"
    return "\n".join([fmt(table[0]), rule] + [fmt(r) for r in table[1:]])


def format_md(report: Report) -> str:
    hw = report.hardware
    out = [
        f"## {report.suite}: {report.what}",
        "",
        f"- hardware: {hardware_line(hw)}",
        f"- load: {load_line(hw)}",
        f"- date: {report.started}, {report.seconds:.1f}s",
        f"- command: `{report.command}`",
        "",
    ]
    out.append(report.table_md.rstrip("\n") if report.table_md is not None else md_table(report.columns, report.rows))
    for name, columns, rows in report.more:
        out += ["", f"{name}:", "", md_table(columns, rows)]
    if report.summary:
        out += [""] + [f"- {k}: {_fmt(v)}" for k, v in report.summary.items()]
    if report.targets:
        out += ["", "targets:"] + [f"- {t.line()}" for t in report.targets]
    if report.notes:
        out += [""] + [f"note: {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def format_json(reports: list[Report], single: bool) -> str:
    data = reports[0].as_dict() if single else [r.as_dict() for r in reports]
    return json.dumps(data, indent=2, default=_jsonable) + "\n"


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def format_csv(report: Report) -> str:
    """The rows as a CSV table with a suite column first (lists as JSON text); each further
    table (cache: chat, evict: long) follows after a blank line with a table column too."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for i, (name, rows) in enumerate([(None, report.rows)] + [(n, r) for n, _, r in report.more]):
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        lead = ["suite"] + (["table"] if name else [])
        if i:
            buf.write("\n")
        w.writerow(lead + keys)
        for r in rows:
            w.writerow(
                [report.suite]
                + ([name] if name else [])
                + [
                    json.dumps(v) if isinstance(v, (list, dict)) else ("" if v is None else v)
                    for v in (r.get(k) for k in keys)
                ]
            )
    return buf.getvalue()


def render(report: Report, output: str) -> str:
    if output == "json":
        return format_json([report], single=True)
    return format_csv(report) if output == "csv" else format_md(report)
