"""`localkv bench SUITE --quick` on the tests' tiny model: each suite runs and reports its fields.
Speed is never asserted beyond "> 0"."""

import csv
import io
import json

import pytest
from test_bench import LLAMA_BENCH_KEYS

import localkv.bench
from localkv.backends.cpu import quant
from localkv.bench import cache, evict, fork, memory_suite, speed
from localkv.bench import plot as bp
from localkv.bench import report as br
from localkv.bench.options import Options
from localkv.cli import main
from localkv.config import EngineConfig
from tiny_model import write_gguf

HW_KEYS = {"cpu", "cores", "threads", "loadavg_start", "loadavg_end", "other_cpu_share", "loaded"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", ctx=512)


def _opts(tiny, **kw):
    return Options(engine=EngineConfig(model=str(tiny), threads=1), quick=True, **kw)


def _check_report(rep, suite):
    assert rep.suite == suite and rep.what and rep.rows and rep.seconds > 0
    assert rep.hardware.keys() >= HW_KEYS and rep.hardware["cores"] >= 1
    assert rep.command.startswith(f"localkv bench {suite}") and "--quick" in rep.command
    md = br.format_md(rep)
    assert "hardware:" in md and f"`{rep.command}`" in md and "load:" in md
    assert json.loads(br.format_json([rep], single=True))["suite"] == suite
    parsed = list(csv.reader(io.StringIO(br.format_csv(rep))))
    assert parsed[0][0] == "suite" and all(r[0] in (suite, "suite") for r in parsed[1:] if r)


def test_memory_quick():
    rep = memory_suite.run(Options(quick=True))
    _check_report(rep, "memory")
    assert [r["allocator"] for r in rep.rows] == ["paged", "contiguous", "contiguous-pow2", "contiguous-exact"]
    assert all(t.ok is None for t in rep.targets)  # smoke sizes: not the targets' workload
    assert rep.hardware["threads"] is None and "-t" not in rep.command


def test_memory_full_workload_meets_targets():
    rep = memory_suite.run(Options())  # the documented 1,000-request workload: a couple of seconds
    paged, contig = rep.rows[0], rep.rows[1]
    assert paged["utilization"] >= 0.96 and 0.2 <= contig["utilization"] <= 0.4
    assert [t.ok for t in rep.targets] == [True, True, True, True]  # the last: tokens per GiB, q8_0 vs f16
    assert rep.command == "localkv bench memory"


def test_fork_quick(tiny):
    rep = fork.run(_opts(tiny))
    _check_report(rep, "fork")
    (row,) = rep.rows
    assert row["engine"] == "localkv" and row["branches"] == 8 and row["decode_tps"] > 0
    assert row["kv_slots"] < row["kv_slots_unshared"]
    assert rep.targets[0].ok is True and rep.targets[1].ok is None  # no --vs: throughput ratio not measured
    assert "-t 1" in rep.command


def test_cache_quick(tiny):
    rep = cache.run(_opts(tiny))
    _check_report(rep, "cache")
    by = {(r["engine"], r["condition"]): r for r in rep.rows}
    assert set(by) == {("localkv", "cold"), ("localkv", "warm disk")}
    assert by["localkv", "cold"]["cached_tokens"] == 0 and by["localkv", "warm disk"]["cached_tokens"] > 0
    assert by["localkv", "cold"]["disk_bytes"] > 0 and all(r["ttft_s"] > 0 for r in rep.rows)
    ((name, _, chat),) = rep.more
    assert name == "chat" and [r["turn"] for r in chat] == [1, 2, 3]
    assert chat[0]["hit_tokens"] == 0 and all(r["hit_tokens"] > 0 for r in chat[1:])
    assert all(r["hit_tokens"] <= r["reusable_tokens"] < r["prompt_tokens"] for r in chat[1:])
    assert all(t.ok is None for t in rep.targets)


def test_evict_quick_with_long(tiny):
    rep = evict.run(_opts(tiny, long=True))
    _check_report(rep, "evict")
    assert [(r["policy"], r["budget_pct"]) for r in rep.rows] == [
        ("full", 100),
        ("sliding", 50),
        ("h2o", 50),
        ("offload", 50),
    ]
    assert all(r["peak_active"] <= r["budget"] for r in rep.rows if r["budget"])
    ((name, _, long_rows),) = rep.more
    assert name == "long" and [r["policy"] for r in long_rows] == ["sliding", "h2o", "offload"]
    assert all(r["generated"] == 200 and r["peak_active"] <= 64 for r in long_rows)
    assert any(t.name.startswith("active KV") and t.ok for t in rep.targets)
    assert sum(t.ok is True for t in rep.targets) == 4  # the budget invariant + three long runs
    assert "--long" in rep.command


def test_speed_quick(tiny):
    rep = speed.run(_opts(tiny))
    _check_report(rep, "speed")
    assert {r["backend"] for r in rep.rows} == {"CPU"}  # float32 weights: prefill on BLAS everywhere
    assert [r["test"] for r in rep.rows] == ["pp64", "tg16"] and all(r["avg_ts"] > 0 for r in rep.rows)
    assert all(r.keys() >= LLAMA_BENCH_KEYS for r in json.loads(br.format_json([rep], single=True))["rows"])
    assert "| pp64 |" in br.format_md(rep).replace("  ", "")
    assert all(r["gbps"] > 0 and r["probe_share"] > 0 and r["bytes_moved"] > 0 for r in rep.rows)
    assert "| GB/s | of read probe |" in br.format_md(rep).replace("  ", "") and "read probe" in rep.summary


def test_speed_names_amx_where_prefill_ran_on_it(tmp_path):
    kw = dict(dim=256, ffn=768, n_heads=4, n_kv_heads=2)  # whole super-blocks of 256
    rep = speed.run(_opts(write_gguf(tmp_path / "q.gguf", quant="Q4_K", ctx=512, **kw)))
    amx = quant.on_amx("Q4_K")  # prefill's blocks of 16 rows on AMX-INT8 tiles, where the CPU has them
    assert {r["backend"] for r in rep.rows} == {"CPU AMX" if amx else "CPU"}
    assert ("| CPU AMX |" in br.format_md(rep).replace("  ", "")) == amx


def test_cli_all_quick_json(tiny, capsys, monkeypatch):
    # `all` runs every suite in turn; cache (subprocesses) and evict are covered above
    monkeypatch.setattr(localkv.bench, "SUITES", ("speed", "memory", "fork"))
    assert main(["bench", "all", "--quick", "-m", str(tiny), "-t", "1", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["suite"] for r in out] == ["speed", "memory", "fork"]
    for r in out:
        assert {"what", "hardware", "command", "rows", "summary", "targets"} <= r.keys()


def test_cli_speed_at_depths(tiny, capsys):
    assert main(["bench", "speed", "--quick", "-m", str(tiny), "-t", "1", "-d", "0,32", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_depth"]) for r in out["rows"]] == [
        ("pp64", 0),
        ("tg16", 0),
        ("pp64 @ d32", 32),
        ("tg16 @ d32", 32),
    ]
    assert "-d 0,32" in out["command"] and "depth 0, 32" in out["what"]


def test_all_measures_speed_at_depth_4096_unless_told():
    from localkv.cli.bench import _depths

    assert [_depths(None, "all", False), _depths(None, "speed", False), _depths(None, "all", True)] == [
        (0, 4096),
        (0,),
        (0,),
    ]
    assert _depths("0,512", "all", False) == (0, 512)


def test_cli_suite_csv(tiny, capsys):
    assert main(["bench", "fork", "--quick", "-m", str(tiny), "-t", "1", "-o", "csv"]) == 0
    out = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(out.out)))
    assert rows[0]["suite"] == "fork" and float(rows[0]["decode_tps"]) > 0
    assert "localkv bench fork" in out.err  # hardware and command go to stderr in csv mode


def test_cli_engine_options_reach_the_suite(capsys):
    assert main(["bench", "memory", "--quick", "--block-size", "32", "--kv-mem", "512MiB", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["command"] == "localkv bench memory --quick --block-size 32 --kv-mem 512MiB"
    assert "blocks of 32" in out["summary"]["memory"]


def test_cli_unknown_suite_is_one_line_error(capsys):
    assert main(["bench", "sped"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: unknown bench suite 'sped'") and err.count("\n") == 1


def test_plot_writes_pngs(tmp_path, tiny):
    pytest.importorskip("matplotlib")
    rep = memory_suite.run(Options(quick=True))
    (png,) = bp.plot(rep, tmp_path)
    assert png.name == "bench-memory.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = br.Report(
        "evict",
        "x",
        rows=[{"policy": "full", "budget_pct": 100, "ppl": 5.0}, {"policy": "h2o", "budget_pct": 20, "ppl": 6.0}],
    )
    assert bp.plot(ev, tmp_path)[0].stat().st_size > 0


# ------------------------------------------------------------------ llama.cpp side


@pytest.mark.peer
def test_fork_quick_vs_llama_cpp(tiny):
    rep = fork.run(_opts(tiny, vs="llama.cpp"))
    ours, theirs = rep.rows
    assert theirs["engine"] == "llama.cpp" and theirs["decode_tps"] > 0 and theirs["state_bytes"] > 0
    assert ours["vs_llama_cpp"] > 0 and rep.targets[1].ok is None  # ratio shown, judged only at full size
    assert rep.targets[1].value.endswith("x")
    assert "--vs llama.cpp" in rep.command


@pytest.mark.peer
def test_cache_quick_vs_llama_cpp(tiny):
    rep = cache.run(_opts(tiny, vs="llama.cpp"))
    by = {(r["engine"], r["condition"]): r for r in rep.rows}
    assert set(by) == {(e, c) for e in ("localkv", "llama.cpp") for c in ("cold", "warm disk")}
    assert by["llama.cpp", "warm disk"]["cached_tokens"] > 0 and by["llama.cpp", "cold"]["disk_bytes"] > 0
    assert all(r["ttft_s"] > 0 for r in rep.rows)


# ------------------------------------------------------------------ the real model


@pytest.mark.model
@pytest.mark.peer
def test_fork_quick_real_model_vs_llama_cpp(real_model_path):
    rep = fork.run(Options(engine=EngineConfig(model=str(real_model_path), threads=1), quick=True, vs="llama.cpp"))
    assert [r["engine"] for r in rep.rows] == ["localkv", "llama.cpp"]
    assert all(r["decode_tps"] > 0 for r in rep.rows) and rep.targets[0].ok
