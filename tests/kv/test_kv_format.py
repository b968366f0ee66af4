"""K/V row formats (kv_format): GGUF's q8_0 and q4_0 bytes, the pool and disk tier holding
them as they are, and the paths that refuse them in one line. That every path reads them to
the same bits is tests/test_one_answer.py's (its @q8_0 / @q4_0 models)."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from localkv import kv_format
from localkv.backends.base import Capabilities
from localkv.config import EngineConfig
from localkv.engine import Engine, _kv_formats
from localkv.errors import LocalkvError
from localkv.kv.disk_store import DiskStore
from localkv.sequence import Sequence
from tiny_model import write_gguf

RNG = np.random.default_rng(33)
PROMPT = RNG.integers(3, 200, 70).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama at head size 64 (two q8_0 blocks a row)."""
    path = tmp_path_factory.mktemp("kvq") / "tiny64.gguf"
    return write_gguf(path, quant="Q8_0", ctx=512, dim=256, ffn=512, n_heads=4, n_kv_heads=2)


def engine(path, **kw) -> Engine:
    kw = {"threads": 2, "disk_cache": False, "block_size": 16, "kv_mem": "8MiB"} | kw
    return Engine(EngineConfig(model=path, **kw))


@pytest.mark.parametrize("fmt", [kv_format.Q8_0, kv_format.Q4_0], ids=lambda f: f.name)
def test_quantized_rows_are_gguf_blocks_fitted_never_worse_than_llama_cpps_rule(fmt, monkeypatch):
    x = (RNG.standard_normal((40, 3, 64)) * RNG.uniform(0.01, 40, (40, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # a block of zeros: scale 0
    x[0, 1, :32] = np.r_[127, np.arange(31) - 15.5]  # q8_0 scale 1: halves round away from zero (C's roundf)
    qtype = gguf.GGMLQuantizationType[fmt.name.upper()]
    rows = kv_format.encode(x, fmt)
    assert rows.dtype == fmt.dtype and rows.shape == (40, 3, fmt.row_len(64))
    ours = kv_format.decode(rows).reshape(-1, 64)
    assert np.array_equal(ours, dequantize(rows.view(np.uint8).reshape(-1, fmt.row_bytes(64)), qtype)), "GGUF blocks"
    ref = quantize(x.reshape(-1, 64), qtype)
    theirs = dequantize(ref, qtype)
    err = lambda y: ((y - x.reshape(-1, 64)).reshape(-1, 32).astype(np.float64) ** 2).sum(axis=1)  # noqa: E731
    assert (err(ours) <= err(theirs) * (1 + 1e-5)).all() and err(ours).sum() < 0.95 * err(theirs).sum()
    monkeypatch.setitem(kv_format.DIVISORS, fmt.name, kv_format.DIVISORS[fmt.name][:1])  # llama.cpp's scale alone
    mine = kv_format.encode(x, fmt).view(np.uint8).reshape(-1, fmt.block_bytes)
    assert np.array_equal(mine[:, :2], ref.reshape(-1, fmt.block_bytes)[:, :2]), "its scale, its bytes"


def test_kv_dtype_takes_each_format_and_k_v_pairs():
    assert kv_format.parse("q8_0") == (kv_format.Q8_0, kv_format.Q8_0)
    assert kv_format.parse("q8_0:q4_0") == (kv_format.Q8_0, kv_format.Q4_0)
    assert kv_format.pair_name(kv_format.F16, kv_format.F16) == "f16"
    EngineConfig(kv_dtype="f16:q8_0").validate()
    for bad in ("q4", "q8_0:", "q8_0:q4_0:f16", "int8"):
        with pytest.raises(LocalkvError, match="unknown --kv-dtype"):
            EngineConfig(kv_dtype=bad).validate()


def test_bytes_per_token_are_exactly_the_layouts(model):
    f16 = engine(model, kv_dtype="f16")
    for dtype, ratio in (("q8_0", 34 / 64), ("q4_0", 18 / 64), ("q8_0:q4_0", 26 / 64), ("f32", 2.0)):
        eng = engine(model, kv_dtype=dtype)
        assert eng.kv_dtype == dtype
        assert eng.kv_bytes_per_token == f16.kv_bytes_per_token * ratio
        assert eng.pool.bytes_per_block == eng.kv_bytes_per_token * eng.block_size
        assert eng.pool.num_blocks == (8 << 20) // eng.pool.bytes_per_block  # the same memory holds more
    assert engine(model, kv_dtype="q8_0").pool.num_blocks >= 1.85 * f16.pool.num_blocks


def test_quantized_kv_stays_close_to_f16(model):
    """q8_0 K/V moves the logits by little; q4_0 by more (it is the coarse one)."""
    ref = engine(model, kv_dtype="f32", prefix_cache=False).prefill(Sequence(PROMPT))
    err = {}
    for dtype in ("f16", "q8_0", "q4_0"):
        got = engine(model, kv_dtype=dtype, prefix_cache=False).prefill(Sequence(PROMPT))
        err[dtype] = float(np.abs(got - ref).max())
    assert 0 < err["q8_0"] < err["q4_0"] and err["q8_0"] < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("dtype", ["q8_0", "q8_0:q4_0"])
def test_the_disk_tier_stores_the_pools_bytes_and_other_formats_miss(model, dtype):
    prompt = PROMPT * 2

    def run(dtype: str):
        eng = engine(model, kv_dtype=dtype, disk_cache=True)
        seq, hit = eng.open_sequence(prompt)
        eng.prefill(seq)
        eng.persist_prompt(seq, len(prompt), hit)
        return eng, seq, hit

    cold, seq, hit = run(dtype)
    assert hit == 0
    stored = "q8_0" if dtype == "q8_0" else "q8_0:q4_0"
    assert {r["dtype"] for r in cold.disk.ls()} == {stored}
    warm, wseq, hit = run(dtype)
    assert hit == len(prompt) // 16 * 16
    for i in range(hit // 16):  # the blocks loaded are the bytes written
        a, b = seq.block_table[i], wseq.block_table[i]
        assert np.array_equal(warm.pool.k[:, b], cold.pool.k[:, a])
        assert np.array_equal(warm.pool.v[:, b], cold.pool.v[:, a])
    for other in {"f16", "q4_0", "q8_0", "q8_0:q4_0", "q4_0:q8_0"} - {dtype}:
        assert run(other)[2] == 0, other  # entries of one format are never read into another's pool


def test_a_k_v_pair_entry_is_k_then_v_each_in_its_format(tmp_path):
    store = DiskStore(tmp_path, dtype="q8_0:q4_0")
    x = RNG.standard_normal((2, 2, 1, 64)).astype(np.float32)
    k, v = kv_format.encode(x, kv_format.Q8_0), kv_format.encode(-x, kv_format.Q4_0)
    assert store.put("fp", "m", 3, (5, 6), k, v)
    got = store.read("fp", 3, (5, 6))
    assert got is not None and np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert got[0].dtype == np.int8 and got[1].dtype == np.uint8
    k_out, v_out = np.zeros_like(k), np.zeros_like(v)
    assert store.load_into("fp", 3, (5, 6), k_out, v_out) and np.array_equal(v_out, v)
    assert not store.load_into("fp", 3, (5, 6), np.zeros_like(k), np.zeros_like(k)), "V of another format"
    with pytest.raises(ValueError, match="q8_0:q4_0 disk cache stores q8_0:q4_0 blocks"):
        store.put("fp", "m", 4, (5, 6), k, k)
    bad = v.copy()
    bad.view(np.uint8)[1, 0, 0, 18:20] = np.array([np.inf], np.float16).view(np.uint8)  # V's second block
    assert not store.put("fp", "m", 4, (5, 6), k, bad), "a NaN or Inf scale in V is never stored"


def test_a_block_with_a_nan_scale_is_not_stored(tmp_path):
    store = DiskStore(tmp_path, dtype="q8_0")
    k = kv_format.encode(np.ones((1, 2, 1, 32), np.float32), kv_format.Q8_0)
    bad = k.copy()
    bad.view(np.uint8)[0, 0, 0, :2] = np.array([np.nan], np.float16).view(np.uint8)
    assert not store.put("fp", "m", 1, (5, 6), bad, k)
    assert store.put("fp", "m", 2, (5, 6), k, k)
    got = store.get("fp", 2, (5, 6))
    assert got is not None and np.array_equal(got[0], kv_format.decode(k))  # 127 * f16(1 / 127)
    assert np.abs(got[0] - 1).max() < 1e-3


def test_a_head_size_the_blocks_do_not_divide_is_refused(tmp_path):
    path = write_gguf(tmp_path / "hd16.gguf", ctx=64)  # head size 16
    with pytest.raises(LocalkvError, match="q8_0 needs a head dimension divisible by 32, not 16"):
        engine(path, kv_dtype="q8_0")


class _FloatOnly:
    name = "Float"
    caps = Capabilities(True, True, ("f16",), frozenset())

    @staticmethod
    def default_kv(head_dim: int) -> str:
        return "f16"


def test_a_backend_without_quantized_kv_refuses_it_in_one_line():
    with pytest.raises(LocalkvError, match=r"--kv-dtype q8_0:q4_0: the Float backend keeps K/V in f16 here"):
        _kv_formats("q8_0:q4_0", _FloatOnly, 64)
    assert _kv_formats("auto", _FloatOnly, 64) == (kv_format.F16, kv_format.F16)


def test_offload_keeps_k_and_v_each_in_its_format(model):
    from localkv.kv.evict import EvictConfig

    cfg = EvictConfig(policy="offload", budget=96, sinks=8, recent=16)
    eng = engine(model, block_size=8, evict=cfg)  # auto
    assert eng.kv_dtype == "q8_0:q4_0"
    tier = eng.policy.tier
    assert [a.dtype for a in tier.kv] == [np.int8, np.uint8]
    assert [a.shape[-1] for a in tier.kv] == [kv_format.Q8_0.row_len(64), kv_format.Q4_0.row_len(64)]
    seq = Sequence(PROMPT * 2)
    eng.prefill(seq)
    assert eng.stats.offloads > 0 and tier.nbytes == len(tier.entries) * 2 * 8 * (68 + 36) * eng.model_config.n_layers


def test_run_json_verbose_and_metrics_report_the_format_and_bytes_per_token(model):
    from localkv.cli.render import Saved, reply_json, reply_verbose
    from localkv.generation import Generation
    from localkv.sampling import SamplingParams
    from localkv.serve.metrics import Counters, Snapshot, parse, render
    from localkv.units import format_size

    eng = engine(model, kv_dtype="q8_0:q4_0")
    r = Generation(eng, PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).run()
    kv = reply_json(eng, r, Saved(), False)["kv"]
    assert kv["dtype"] == "q8_0:q4_0" and kv["bytes_per_token"] == eng.kv_bytes_per_token
    assert f"q8_0:q4_0, {format_size(eng.kv_bytes_per_token)} per token" in reply_verbose(eng, r, Saved())
    snap = Snapshot(eng.pool.usage(), eng.stats, 0, 0, 0)
    got = parse(render(Counters(), snap))
    assert got['localkv_kv_bytes_per_token{dtype="q8_0:q4_0"}'] == eng.kv_bytes_per_token


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localkv", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_takes_a_kv_dtype_and_refuses_a_bad_one_in_one_line(model):
    bad = _cli("run", "hi", "-m", str(model), "--kv-dtype", "q3")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: unknown --kv-dtype 'q3': use auto, f32, f16, q8_0, q4_0, or K:V such as q8_0:q4_0"
    ]
    p = _cli("run", "hi", "-m", str(model), "-n", "2", "-t", "0", "--json", "--kv-dtype", "q4_0")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["kv"]["dtype"] == "q4_0"


@pytest.mark.parametrize("dtype", ["q8_0", "q8_0:q4_0"])
def test_h2o_attends_to_its_compacted_quantized_rows(model, dtype):
    """h2o's compacted heavy hitters are the pool's bytes, read as the pool's rows are: under
    h2o, quantized K/V move the logits from f32's about as much as they do in a full cache (rows
    misread or requantized would move them far more)."""
    from localkv.kv.evict import EvictConfig

    tokens = RNG.integers(3, 200, 90).tolist()
    cfg = EvictConfig(policy="h2o", budget=96, sinks=8, recent=16)

    def score(kv_dtype: str, evict=None):
        eng = engine(model, kv_dtype=kv_dtype, prefix_cache=False, block_size=8, evict=evict)
        return eng.score(tokens), eng.stats.evictions

    (full32, _), (full, _) = score("f32"), score(dtype)
    (h2o32, _), (h2o, evictions) = score("f32", cfg), score(dtype, cfg)
    assert evictions >= 7
    assert np.abs(h2o - h2o32).max() <= 2 * np.abs(full - full32).max()


def test_q8_0_rounding_is_c_roundf_at_and_beside_every_half():
    """The float32 rounding (rint, then exact ties away from zero) against C's roundf computed in
    float64: at each k + 0.5 and one float32 step either side of it, and on random values."""
    halves = np.arange(-128, 128, dtype=np.float32) + np.float32(0.5)
    near = np.concatenate([halves, np.nextafter(halves, np.float32(-200)), np.nextafter(halves, np.float32(200))])
    x = np.concatenate([near, (RNG.standard_normal(4096) * 60).astype(np.float32), np.float32([0.49999997, -0.0])])
    ref = np.copysign(np.floor(np.abs(x.astype(np.float64)) + 0.5), x)
    assert np.array_equal(kv_format._round_away(x), ref)
