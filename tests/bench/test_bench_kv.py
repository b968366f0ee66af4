"""`bench kv` on a tiny random model: the rows, the layout's byte ratios, and sums that behave."""

import numpy as np
import pytest

import localkv.bench.kv as bench_kv
from localkv.bench.options import Options
from localkv.config import EngineConfig
from tiny_model import write_gguf

TOKENS = np.random.default_rng(5).integers(3, 200, 80).tolist()


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-kv") / "tiny64.gguf"
    return write_gguf(path, quant="Q8_0", ctx=256, dim=256, ffn=512, n_heads=4, n_kv_heads=2)


def test_bench_kv_measures_each_format_against_f16(tiny64, monkeypatch):
    monkeypatch.setattr(bench_kv, "text_tokens", lambda eng, n: TOKENS[:n])
    o = Options(engine=EngineConfig(model=str(tiny64), threads=2, kv_mem="4MiB"), quick=True)
    rep = bench_kv.run(o)
    by = {r["kv_dtype"]: r for r in rep.rows}
    assert list(by) == ["f16", "q8_0", "q4_0", "q8_0:q4_0"]
    f16 = by["f16"]
    assert f16["kld"] == 0 and f16["top1"] == 1 and f16["ppl_vs_f16"] == 0
    assert by["q8_0"]["bytes_vs_f16"] == 34 / 64 and by["q4_0"]["bytes_vs_f16"] == 18 / 64
    # a random tiny model's distributions are near uniform: the KLD is rounding (the real model's: BENCHMARKS.md)
    assert all(np.isfinite(r["ppl"]) and r["kld"] > -1e-9 and 0 <= r["top1"] <= 1 for r in rep.rows)
    assert by["q8_0"]["pool_tokens"] >= 1.85 * f16["pool_tokens"]
    assert f16["tg_vs_f16"] == 1 and all(r["tg_depth_ts"] > 0 for r in rep.rows)
    assert rep.summary["default by measurement"] in by
    targets = {t.name: t.ok for t in rep.targets}
    assert targets["bytes per token, q8_0 vs f16"] and targets["tokens in the pool, q8_0 vs f16"]
    assert targets["perplexity, q8_0 vs f16"] is None  # --quick judges no quality
    assert targets["tg at depth, q8_0 pool vs f16"] is None
    assert targets["--kv-dtype auto vs the format the rule picks"] is None  # judged on the default model only


def test_the_default_is_checked_against_the_rules_pick():
    """The rule: the fewest bytes per token within +0.5% of f16's perplexity and no slower at
    depth; the target compares --kv-dtype auto's formats with it, by name."""
    rows = {
        "f16": {"kv_dtype": "f16", "ppl_vs_f16": 0.0, "tg_vs_f16": 1.0, "bytes_per_token": 64},
        "q8_0": {"kv_dtype": "q8_0", "ppl_vs_f16": -0.001, "tg_vs_f16": 1.5, "bytes_per_token": 34},
        "q8_0:q4_0": {"kv_dtype": "q8_0:q4_0", "ppl_vs_f16": 0.004, "tg_vs_f16": 1.6, "bytes_per_token": 26},
        "q4_0": {"kv_dtype": "q4_0", "ppl_vs_f16": 0.05, "tg_vs_f16": 1.7, "bytes_per_token": 18},
    }
    assert bench_kv._default_target(rows, "q8_0:q4_0", True).ok is True
    assert bench_kv._default_target(rows, "q8_0", True).ok is False
    rows["q8_0:q4_0"]["ppl_vs_f16"] = 0.006  # past +0.5%: q8_0 is the pick
    t = bench_kv._default_target(rows, "q8_0:q8_0", True)
    assert t.ok is True and (t.value, t.goal) == ("q8_0", "q8_0")


@pytest.mark.peer
def test_bench_kv_puts_llama_cpp_formats_beside_ours(tiny64, monkeypatch):
    monkeypatch.setattr(bench_kv, "text_tokens", lambda eng, n: TOKENS[:n])
    o = Options(engine=EngineConfig(model=str(tiny64), threads=2, kv_mem="4MiB"), quick=True, vs="llama.cpp")
    rep = bench_kv.run(o)
    theirs = {r["kv_dtype"]: r for r in rep.rows if r["engine"] == "llama.cpp"}
    assert list(theirs) == ["f16", "q8_0", "q4_0", "q8_0:q4_0"]
    # llama.cpp's f16 against a second f16 run of its own: the same logits
    assert theirs["f16"]["ppl_vs_f16"] == 0 and theirs["f16"]["top1"] == 1
    assert theirs["q4_0"]["bytes_vs_f16"] == 18 / 64 and theirs["q8_0:q4_0"]["bytes_vs_f16"] == (34 + 18) / 128
    assert all(np.isfinite(r["ppl"]) and r["tg_depth_ts"] > 0 for r in theirs.values())
    targets = {t.name: t for t in rep.targets}
    assert targets["tg at depth, q8_0 pool vs llama.cpp's q8_0 K/V"].value.endswith("x")
    assert "--vs llama.cpp" in rep.command
