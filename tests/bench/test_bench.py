import json
import os
import subprocess
import sys

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from localkv.bench import speed as bench
from localkv.bench import speed_table
from localkv.bench.report import check_output
from localkv.cli.bench import bench_command
from localkv.config import EngineConfig
from localkv.errors import LocalkvError

LLAMA_BENCH_KEYS = {
    "test",
    "n_prompt",
    "n_gen",
    "n_depth",
    "avg_ts",
    "stddev_ts",
    "samples_ts",
    "backend",
    "n_threads",
    "model_type",
    "model_filename",
    "model_size",
    "model_n_params",
}


def _row(engine="localkv", test="pp512", ts=(100.0, 102.0)):
    n_prompt, n_gen = (int(test[2:]), 0) if test.startswith("pp") else (0, int(test[2:]))
    return {
        "engine": engine,
        "model_type": "llama 135M Q4_1",
        "model_filename": "m.gguf",
        "model_size": 98362432,
        "model_n_params": 134515008,
        "backend": "CPU",
        "n_threads": 2,
        "test": test,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "avg_ts": sum(ts) / len(ts),
        "stddev_ts": bench._sd(ts),
        "samples_ts": list(ts),
    }


def test_parse_tests():
    assert bench.Test.parse("pp512") == bench.Test("pp512", 512, 0)
    assert bench.Test.parse("tg128") == bench.Test("tg128", 0, 128)
    for bad in ("pg512", "pp", "tg0", "pp-1"):
        with pytest.raises(LocalkvError):
            bench.Test.parse(bad)


def test_md_table_like_llama_bench():
    md = speed_table.format_speed_table([_row(), _row(test="tg128", ts=(40.0, 40.0))])
    table = md.splitlines()
    assert [c.strip() for c in table[0].strip("|").split("|")] == [
        "model",
        "size",
        "params",
        "backend",
        "threads",
        "test",
        "t/s",
    ]
    assert [c.strip() for c in table[2].strip("|").split("|")] == [
        "llama 135M Q4_1",
        "93.81 MiB",
        "134.52 M",
        "CPU",
        "2",
        "pp512",
        "101.00 ± 1.41",
    ]
    assert table[1].startswith("| ---") and table[1].rstrip("| ").endswith(":")  # t/s right-aligned
    assert "40.00 ± 0.00" in table[3]
    assert len({len(ln) for ln in table}) == 1  # columns line up


def test_md_compared_has_engine_and_ratio_columns():
    rows = [
        _row(ts=(300.0,)),
        _row("llama.cpp", ts=(100.0,)),
        _row(test="tg128", ts=(20.0,)),
        _row("llama.cpp", test="tg128", ts=(50.0,)),
    ]
    r = bench.ratios(rows)
    assert r == pytest.approx({"pp512": 3.0, "tg128": 0.4})
    table = speed_table.format_speed_table(rows, r).splitlines()
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table]
    assert cells[0][0] == "engine" and cells[0][-1] == "vs llama.cpp"
    assert [c[0] for c in cells[2:]] == ["localkv", "llama.cpp"] * 2
    assert [c[-1] for c in cells[2:]] == ["3.00x", "", "0.40x", ""]


def test_ratios_skip_tests_without_peer():
    assert bench.ratios([_row()]) == {}
    assert bench.ratios([_row(), _row("llama.cpp", test="tg128")]) == {}


def test_size_and_params_units():
    assert speed_table._size(3 * 2**30) == "3.00 GiB" and speed_table._size(2**20) == "1.00 MiB"
    assert speed_table._params(6_740_000_000) == "6.74 B" and speed_table._params(135_000_000) == "135.00 M"


def _app():
    app = typer.Typer()
    app.command()(bench_command)
    return app


@pytest.mark.parametrize(
    "args",
    [
        ["--vs", "vllm"],
        ["-o", "xml"],
        ["-p", "0", "-n", "0"],
        ["nope"],
        ["memory", "-o", "html"],
        ["fork", "-r", "0"],
        ["evict", "--vs", "vllm"],
        ["fork", "--block-size", "3"],
        ["-d", "4k"],
        ["-d", "0,-1"],
    ],
)
def test_bad_options_raise_before_loading(args, monkeypatch):
    from localkv.bench import options

    def no_engine(*a, **k):
        raise AssertionError("engine loaded before the options were checked")

    monkeypatch.setattr(options, "Engine", no_engine)
    res = CliRunner().invoke(_app(), args)
    assert isinstance(res.exception, LocalkvError), res.output


def test_unknown_suite_names_the_suites():
    res = CliRunner().invoke(_app(), ["speeed"])
    assert isinstance(res.exception, LocalkvError)
    assert "speed, memory, fork, cache, evict, kv, grammar, serve, spec, all" in str(res.exception)


def test_bad_output_names_the_formats():
    with pytest.raises(LocalkvError, match="md, json or csv"):
        check_output("xml")


def _call(**kw):
    args = dict(
        model=None,
        n_prompt=16,
        n_gen=4,
        n_depth=None,
        repetitions=1,
        threads=None,
        vs=None,
        output="md",
        block_size=16,
        kv_mem="1GiB",
        spec="off",
        spec_max=8,
        draft_model=None,
        kv_dtype="auto",
        cache_type_k=None,
        cache_type_v=None,
        quick=False,
        plot=None,
        long=False,
        seed=0,
        device="auto",
        suite="speed",
    )
    return bench_command(**(args | kw))


def test_vs_without_llama_cpp_says_how_to_install(monkeypatch):
    from localkv.bench import peer

    monkeypatch.setattr(peer, "peer_available", lambda: False)
    with pytest.raises(LocalkvError, match=r"pip install -e '\.\[peer\]'"):
        _call(vs="llama.cpp")


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(LocalkvError, match="pip install matplotlib") as e:
        _call(suite="memory", quick=True, plot=str(tmp_path))
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # failed before measuring anything


def test_speed_rows_rejects_bad_vs():
    with pytest.raises(LocalkvError, match="llama.cpp"):
        bench.speed_rows(object(), ["pp16"], vs="vllm")


@pytest.fixture(scope="module")
def engine(real_model_path):
    from localkv.engine import Engine

    return Engine(EngineConfig(model=real_model_path, threads=1, kv_mem="64MiB"))  # 1: BLAS threads spin on a busy core


def _check(rows, engines, engine):
    assert [(r["engine"], r["test"]) for r in rows] == [(e, t) for t in ("pp16", "tg4") for e in engines]
    ours = "CPU AMX" if engine.backend.prefill_amx else "CPU"  # where the model's prefill ran on AMX
    for r in rows:
        assert r.keys() >= LLAMA_BENCH_KEYS
        assert r["backend"] == (ours if r["engine"] == "localkv" else "CPU")
        assert r["n_threads"] == 1 and r["model_size"] > 0 and r["model_n_params"] > 0
        assert (r["n_prompt"], r["n_gen"]) == ((16, 0) if r["test"] == "pp16" else (0, 4))
        assert len(r["samples_ts"]) == 1 and r["avg_ts"] > 0


@pytest.mark.model
def test_speed_rows_real_model(engine):
    free = engine.pool.num_free
    rows = bench.speed_rows(engine, ("pp16", "tg4"), reps=1)
    _check(rows, ["localkv"], engine)
    assert engine.pool.num_free == free  # every rep freed its sequence


@pytest.mark.model
@pytest.mark.peer
def test_speed_rows_vs_llama_cpp(engine):
    rows = bench.speed_rows(engine, ("pp16", "tg4"), reps=1, vs="llama.cpp")
    _check(rows, ["localkv", "llama.cpp"], engine)
    assert set(bench.ratios(rows)) == {"pp16", "tg4"} and all(x > 0 for x in bench.ratios(rows).values())


# ------------------------------------------------------------------ options and layout


def test_command_reproduces_the_engine_settings():
    from localkv.bench.options import Options

    o = Options(engine=EngineConfig(model="m.gguf", block_size=32, kv_mem="512MiB", device="cpu"), quick=True)
    assert (
        o.command("fork", 2) == "localkv bench fork -m m.gguf -t 2 --quick --block-size 32 --kv-mem 512MiB --device cpu"
    )
    assert o.command("memory", None) == "localkv bench memory -m m.gguf --quick --block-size 32 --kv-mem 512MiB"
    full = Options(vs="llama.cpp", reps=3, seed=7)
    assert full.command("speed", 1) == "localkv bench speed -p 512 -n 128 -r 3 -t 1 --vs llama.cpp --seed 7"
    deep = Options(depths=(0, 4096))
    assert deep.command("speed", 1) == "localkv bench speed -p 512 -n 128 -r 5 -d 0,4096 -t 1"
    assert deep.command("fork", 1) == "localkv bench fork -t 1"
    assert full.command("evict", 1) == "localkv bench evict -t 1 --seed 7"


def test_size_flag_spells_bytes_exactly():
    from localkv.bench.options import size_flag

    assert [size_flag(n) for n in (1 << 30, 3 << 29, 64 << 20, 3072, 1536)] == [
        "1GiB",
        "1536MiB",
        "64MiB",
        "3KiB",
        "1536",
    ]


def test_bench_package_imports_no_engine():
    # the timed children run as `python -m localkv.bench.child_ttft[_peer]`: what the package
    # imports loads before their clocks start
    import subprocess
    import sys

    code = "import sys, localkv.bench; print(sorted(m for m in sys.modules if m.startswith(('localkv.', 'numpy'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['localkv.bench']"


def test_depth_names_the_test_as_llama_bench_does():
    t = bench.Test.parse("tg128")
    assert (t.name, t.at(4096).name, t.at(4096).n_ctx) == ("tg128", "tg128 @ d4096", 4096 + 128 + 1)
    with pytest.raises(LocalkvError, match="invalid depth"):
        bench.speed_rows(object(), ["pp16"], depths=(0, -1))


def _logits_of_prefills(eng, monkeypatch) -> list:
    seen = []
    prefill = eng.prefill
    monkeypatch.setattr(eng, "prefill", lambda seq: seen.append((seq.num_computed, prefill(seq))) or seen[-1][1])
    return seen


def test_a_test_at_depth_runs_after_the_depths_tokens(tmp_path, monkeypatch):
    # the timed prefill computes only the test's tokens, and what it computes is what a prefill
    # of depth + test tokens from an empty K/V gives (bitwise: one answer per token)
    from localkv.engine import Engine
    from tiny_model import write_gguf

    eng = Engine(EngineConfig(model=write_gguf(tmp_path / "t.gguf"), threads=1, prefix_cache=False))
    depth, tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 4, [5, 8, 9, 7]
    runner = bench.LocalRunner(eng)
    runner.set_depth(depth)
    seen = _logits_of_prefills(eng, monkeypatch)
    runner.pp(tokens)
    runner.tg(7, 2)
    assert [n for n, _ in seen] == [len(depth), len(depth)]  # both started after the depth
    want = eng.score(depth + tokens)[-1]
    assert np.array_equal(seen[0][1], want)
    assert np.array_equal(seen[1][1], eng.score(depth + [7])[-1])
    held = eng.pool.num_blocks - eng.pool.num_free
    assert held == -(-len(depth) // eng.block_size)  # only the depth's blocks stay between reps
    runner.set_depth([])
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.peer
def test_llama_cpp_at_depth_continues_after_the_depths_tokens(tmp_path):
    from localkv.bench.peer import PeerRunner
    from tiny_model import write_gguf

    path, depth, tokens = write_gguf(tmp_path / "t.gguf"), [3, 1, 4, 1, 5, 9, 2, 6] * 5, [5, 8, 9, 7]
    peer = PeerRunner(path, 1, 256)
    logits = lambda: np.ctypeslib.as_array(peer.llm._ctx.get_logits(), shape=(peer.n_vocab,)).copy()  # noqa: E731
    try:
        peer.pp(depth + tokens)
        fresh = logits()
        peer.set_depth(depth)
        for _ in range(2):  # each rep starts at the depth again
            peer.pp(tokens)
            assert peer.llm.n_tokens == len(depth + tokens)
            np.testing.assert_allclose(logits(), fresh, rtol=1e-4, atol=1e-4)  # llama.cpp's sums follow its batch
    finally:
        peer.close()


def test_timers_free_through_the_engine(tmp_path):
    # freeing through the engine lets the KV policy drop its per-sequence state too
    from localkv.engine import Engine
    from localkv.kv.evict import EvictConfig
    from tiny_model import write_gguf

    eng = Engine(EngineConfig(model=write_gguf(tmp_path / "t.gguf"), evict=EvictConfig(policy="sliding", budget=64)))
    freed = []
    policy_free = eng.policy.free
    eng.policy.free = lambda seq: (freed.append(seq.id), policy_free(seq))
    runner = bench.LocalRunner(eng)
    runner.pp([5] * 20)
    runner.tg(5, 3)
    assert len(freed) == 2 and eng.pool.num_free == eng.pool.num_blocks


def test_vs_with_a_peer_built_with_amx_on_an_amx_cpu_says_how_to_rebuild(monkeypatch):
    from localkv.bench import peer

    llama_cpp = pytest.importorskip("llama_cpp")

    info = b"CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: info)
    monkeypatch.setattr(peer, "_cpu_has", lambda flag: flag == "amx_int8")
    with pytest.raises(LocalkvError, match=r"#20824\): rebuild it without with `bash scripts/install_dev.sh`"):
        _call(vs="llama.cpp")
    monkeypatch.setattr(peer, "_cpu_has", lambda flag: False)  # the same build on a CPU without AMX runs
    assert peer.peer_problem() is None


def test_a_peer_process_runs_without_localkvs_spin_settings():
    """llama.cpp's own processes (serve, cache, peak RSS) get the user's environment: what
    localkv's import set for itself is left out, or unset again in a child that imports
    localkv; a value the user set stays."""
    code = (
        "import json, os; from localkv.bench.peer import drop_own_env, peer_env; env = peer_env(); "
        "drop_own_env(); print(json.dumps([env.get('GOMP_SPINCOUNT'), os.environ.get('GOMP_SPINCOUNT')]))"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    for extra, want in (({}, [None, None]), ({"GOMP_SPINCOUNT": "7"}, ["7", "7"])):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base | extra)
        assert json.loads(out.stdout) == want, out.stderr
