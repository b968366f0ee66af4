"""`localkv bench serve`: the report's shape on the tiny model (two real servers in child
processes, real streaming clients), and how decode throughput is measured."""

import json

from localkv.bench.serve_load import Outcome, decode_tps
from localkv.cli import main
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
