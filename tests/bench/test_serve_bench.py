"""`localkv bench serve`: the report's shape on the tiny model (two real servers in child
processes, real streaming clients), and how decode throughput is measured."""

import json
import socket

import pytest

from localkv.bench.serve_load import Outcome, decode_tps, llama_cpp_server
from localkv.cli import main
from localkv.config import EngineConfig
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf


def test_decode_tps_counts_overlapping_spans_once():
    one_at_a_time = [
        Outcome(start=0, ttft=1, total=3, chunks=11, usage={"completion_tokens": 11}),
        Outcome(start=3, ttft=1, total=3, chunks=11, usage={"completion_tokens": 11}),
    ]
    assert decode_tps(one_at_a_time) == 20 / 4  # spans 1-3 and 4-6
    at_once = [
        Outcome(start=0, ttft=1, total=3, chunks=11, usage={"completion_tokens": 11}),
        Outcome(start=0, ttft=2, total=4, chunks=11, usage={"completion_tokens": 11}),
    ]
    assert decode_tps(at_once) == 20 / 3  # spans 1-3 and 2-4 overlap: busy 1-4
    assert decode_tps([Outcome()]) is None


def test_bench_serve_quick_on_the_tiny_model(tmp_path, capsys):
    tiny = write_gguf(tmp_path / "tiny.gguf", ctx=512)
    assert main(["bench", "serve", "--quick", "-m", str(tiny), "-t", "1", "-o", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["suite"] == "serve" and [r["load"] for r in rep["rows"]] == ["4 at once", "one at a time"]
    burst, serial = rep["rows"]
    assert burst["tokens"] == serial["tokens"] == 4 * 8  # every request streamed its 8 tokens
    assert burst["hit_rate"] > 0.9 and serial["hit_rate"] > 0.9  # requests 2..N found the system prompt
    assert [t["result"] for t in rep["targets"]] == [None] * 4  # --quick judges nothing
    assert "localkv bench serve" in rep["command"]


def _report(capsys, *argv) -> dict:
    assert main(["bench", "serve", "--quick", *argv, "-t", "1", "-o", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _shape(rep: dict) -> tuple:
    return (
        [(r["load"], sorted(r)) for r in rep["rows"]],
        sorted(rep["summary"]),
        [t["name"] for t in rep["targets"]],
        sorted(rep["tables"]),
    )


def test_bench_serve_url_gives_the_same_report_for_another_server(tmp_path, capsys):
    tiny = write_gguf(tmp_path / "tiny.gguf", ctx=512)
    own = _report(capsys, "-m", str(tiny))
    config = EngineConfig(model=str(tiny), disk_cache=False, kv_mem="16MiB")
    with BackgroundServer(config) as s:
        rep = _report(capsys, "-m", str(tiny), "--url", s.url + "/v1")
    replayed = rep["rows"].pop()  # the multi-turn replay: a fleet's hit rate when --url is a router
    assert _shape(rep) == _shape(own)
    assert replayed["load"] == "3 conversations x 3 turns" and replayed["hit_rate"] > 0.5
    burst, serial = rep["rows"]
    assert burst["engine"] == f"tiny at {s.url}" and burst["tokens"] == serial["tokens"] == 4 * 8
    assert burst["hit_rate"] > 0.9 and burst["peak_blocks"] is None  # usage says; /metrics is not asked
    assert f"--url {s.url}" in rep["command"]


@pytest.mark.peer
def test_bench_serve_url_against_llama_cpp_pythons_server(tmp_path, capsys):
    tiny = write_gguf(tmp_path / "tiny.gguf", ctx=512)
    server = llama_cpp_server(tiny, 1, n_ctx=512).wait_ready()
    try:
        rep = _report(capsys, "-m", str(tiny), "--url", server.url)
    finally:
        server.stop()
    burst, serial, replayed = rep["rows"]
    assert [r["load"] for r in rep["rows"]] == ["4 at once", "one at a time", "3 conversations x 3 turns"]
    assert replayed["hit_rate"] == 0  # llama-cpp-python's usage reports no cached tokens
    assert burst["tokens"] == serial["tokens"] == 4 * 8 and burst["hit_rate"] is None  # its usage has no cache
    assert burst["engine"].endswith(f"at {server.url}") and burst["ttft_p50"] > 0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "speed", "--url", "http://127.0.0.1:1"], "serve"),
        (["bench", "serve", "--url", "http://127.0.0.1:1", "--vs", "llama.cpp"], "--vs"),
        (["bench", "serve", "--url", "127.0.0.1:8080"], "invalid --url"),
    ],
)
def test_bench_serve_url_refuses_bad_arguments_in_one_line(argv, says, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1


def test_bench_serve_url_with_nothing_listening_is_one_line(tmp_path, capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tiny = write_gguf(tmp_path / "tiny.gguf", ctx=512)
    assert main(["bench", "serve", "--quick", "-m", str(tiny), "--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}/v1/models" in err and len(err.splitlines()) == 1


def test_bench_serve_with_a_quantized_pool_measures_f16_beside_it(tmp_path, capsys):
    """--kv-dtype q8_0: the runs on q8_0 pools, and the clients at once again on an f16 pool of
    the same --kv-mem; each row says its format, tokens per GiB, requests at once, preemptions."""
    tiny = write_gguf(tmp_path / "tiny64.gguf", ctx=512, dim=256, ffn=512, n_heads=4, n_kv_heads=2)
    rep = _report(capsys, "-m", str(tiny), "--kv-dtype", "q8_0")
    assert [(r["load"], r["kv_dtype"]) for r in rep["rows"]] == [
        ("4 at once", "q8_0"),
        ("one at a time", "q8_0"),
        ("4 at once", "f16"),
    ]
    q8, _, f16 = rep["rows"]
    assert q8["tokens"] == f16["tokens"] == 4 * 8 and 1 <= q8["peak_running"] <= 4
    assert q8["tokens_per_gib"] / f16["tokens_per_gib"] == pytest.approx(64 * 2 / 68, rel=1e-3)  # 34 bytes a 32
    assert q8["preemptions"] == f16["preemptions"] == 0  # the default 1GiB holds the quick load either way
    names = [t["name"] for t in rep["targets"][-2:]]
    assert names == [f"{m}, q8_0 vs f16 K/V at this --kv-mem" for m in ("preemptions at once", "aggregate t/s at once")]
    assert [t["result"] for t in rep["targets"]] == [None] * 6 and "--kv-dtype q8_0" in rep["command"]
    assert rep["targets"][1]["value"] == "n/a" and "all_tps_vs_llama_cpp_server" not in rep["summary"]  # no --vs
