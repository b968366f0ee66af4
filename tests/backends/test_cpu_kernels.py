"""The compiled CPU kernels (numba; the weight matmuls' are in test_quant_kernels.py): same
results as numpy, BLAS kept off the kernels' cores while they run, and a clean fallback when
they are off (LOCALKV_CPU_KERNELS=0: same tokens)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from localkv.backends import cpu as ops_numpy
from localkv.backends.cpu import build, quant
from localkv.backends.cpu import compiled as cpu_kernels
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from tiny_model import write_gguf

PROMPT = list(range(3, 40))


def numba_threads() -> int:
    try:
        import numba
    except ImportError:
        return 0
    return numba.config.NUMBA_NUM_THREADS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("kernels") / "tiny.gguf", ctx=256)


@pytest.fixture(scope="module")
def kernels():
    # numba is a dependency: the kernels must load here, not skip
    assert build.load(), build.why_not()
    return cpu_kernels


def test_off_switch(monkeypatch):
    monkeypatch.setenv("LOCALKV_CPU_KERNELS", "0")
    assert "LOCALKV_CPU_KERNELS=0" in build._numba()


def test_blas_on_one_thread_while_kernels_run(tiny, kernels, monkeypatch):
    """Every pass, decode or prefill, runs its matmuls and attention on the kernels on the
    engine's threads, with BLAS on one."""
    import numba
    from threadpoolctl import threadpool_info

    from localkv.backends.cpu import threads as cpu_threads

    monkeypatch.setattr(cpu_threads, "INTERVAL", 1e9)  # the engine's 2 threads, whatever else runs here

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"}

    backend = Engine(EngineConfig(model=tiny, threads=2)).backend
    for rows in (1, 33, 512):  # a decode step, prefill passes
        backend.begin_forward(rows)
        assert blas_threads() == {1}
        assert numba.get_num_threads() == min(2, numba_threads())


def test_decode_same_with_and_without_kernels(tiny, kernels, monkeypatch):
    """Greedy text and the logits of every step agree whether the matmuls (and the forks'
    batched decode attention) run on the kernels or on numpy/BLAS."""

    def run():
        eng = Engine(EngineConfig(model=tiny, block_size=8, prefix_cache=False))
        logits = []
        forward = eng.model.forward

        def keep(*a, **k):
            out = forward(*a, **k)
            logits.append(np.array(out))
            return out

        eng.model.forward = keep
        solo = Generation(eng, PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).run()
        res = Generation(
            eng, PROMPT * 3, SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True), n=5
        ).run()
        return solo.tokens, [b.tokens for b in res.branches], logits

    with_kernels = run()
    monkeypatch.setattr(build.state, "ok", False)
    monkeypatch.setattr(build.state, "types", dict.fromkeys(build.state.types, "off in this test"))
    assert not ops_numpy.uses_kernels(1) and not quant.active("F32")
    without = run()
    assert with_kernels[0] == without[0]
    assert with_kernels[1] == without[1]
    assert len(with_kernels[2]) == len(without[2])
    for a, b in zip(with_kernels[2], without[2]):  # float rounding of logits about 40 in size:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())  # ~1e-4 apart


@pytest.mark.parametrize("t,past", [(1, 40), (5, 0), (64, 0), (100, 37), (130, 300)])
@pytest.mark.parametrize("with_mass", [False, True])
def test_prefill_attention_same_with_and_without_kernels(kernels, monkeypatch, t, past, with_mass):
    """With extra keys or h2o's mass (the numpy attention, one query at a time) the result is
    the same with the kernels on (their element-wise ops) and off."""
    rng = np.random.default_rng(t + past)
    kvh, g, hd, bs = 3, 3, 64, 16
    n_ctx = past + t
    nb = -(-n_ctx // bs) + 2
    kl, vl = (rng.standard_normal((nb, bs, kvh, hd), dtype=np.float32) for _ in range(2))
    table = rng.permutation(nb)[: -(-n_ctx // bs)]
    q = rng.standard_normal((t, kvh * g, hd), dtype=np.float32)
    extra = tuple(rng.standard_normal((kvh, 7, hd), dtype=np.float32) for _ in range(2))

    def run():
        mass = np.zeros((kvh, 7 + n_ctx), np.float32) if with_mass else None
        out = ops_numpy.paged_attention(q, kl, vl, table, n_ctx, 0.125, mass, extra)
        return out, mass

    on = run()
    monkeypatch.setattr(build.state, "ok", False)
    off = run()
    np.testing.assert_allclose(on[0], off[0], rtol=1e-5, atol=1e-5)
    if with_mass:
        np.testing.assert_allclose(on[1], off[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("style", ["neox", "normal"])
@pytest.mark.parametrize("order", ["C", "F"])  # F: a prefill pass's transposed matmul output
def test_rmsnorm_and_rope_match_numpy(kernels, monkeypatch, style, order):
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((37, 576), dtype=np.float32), rng.standard_normal(576, dtype=np.float32)
    qkv = np.asarray(rng.standard_normal((37, 15 * 64), dtype=np.float32), order=order).reshape(37, 15, 64)
    cos, sin = ops_numpy.rope_tables(64, 37, 10000.0)
    got_norm, got_rope = ops_numpy.rmsnorm(x, w, 1e-5), ops_numpy.rope(qkv.copy(order="K")[:, :12], cos, sin, style)
    monkeypatch.setattr(build.state, "ok", False)
    np.testing.assert_allclose(got_norm, ops_numpy.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_rope, ops_numpy.rope(qkv.copy()[:, :12], cos, sin, style), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["C", "F", "strided"])  # decode step, prefill pass, a view
@pytest.mark.parametrize("rows,f", [(1, 1536), (37, 576), (512, 100)])
def test_silu_mul_matches_numpy(kernels, monkeypatch, order, rows, f):
    rng = np.random.default_rng(6)
    gu = rng.standard_normal((rows, 2 * f), dtype=np.float32) * 12  # past exp's clamp at -87 too
    gu[0, :3] = [0.0, -100.0, 100.0]
    if order == "strided":
        gu = np.repeat(gu, 2, axis=1)[:, ::2]
    else:
        gu = np.asarray(gu, order=order)
    got = ops_numpy.silu_mul(gu)
    assert got.shape == (rows, f) and (order != "F" or rows == 1 or got.flags.f_contiguous)
    monkeypatch.setattr(build.state, "ok", False)
    with np.errstate(over="ignore"):  # numpy's exp(100) is inf, and g / inf the right 0
        want = ops_numpy.silu_mul(gu)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("pair", ["q8_0:q4_0", "q4_0", "q8_0:q8_0"])
@pytest.mark.parametrize("rows,style,rotated", [(1, "neox", True), (3, "normal", True), (2, "neox", False)])
def test_rope_store_has_the_bits_of_rope_rotate_and_write_kv(kernels, pair, rows, style, rotated):
    """A decode step's one call (rope, the rotation's heads turned, K and V written) against
    the three calls a prefill pass makes: the same q rows, the same pool bytes."""
    from localkv import kv_format
    from localkv.kv.rotation import Rotation

    kf, vf = kv_format.parse(pair)
    H, K, hd, rng = 6, 2, 64, np.random.default_rng(8)
    rot = Rotation.for_formats(True, True, hd) if rotated else None
    cos, sin = (a[[5, 9, 30][:rows]] for a in ops_numpy.rope_tables(hd, 40, 10000.0))
    qkv = rng.standard_normal((rows, H + 2 * K, hd), dtype=np.float32)
    slots = np.array([7, 2, 12][:rows])
    layers = [np.zeros((4, 4, K, f.row_bytes(hd)), f.dtype) for f in (kf, vf, kf, vf)]
    want = qkv.copy()
    ops_numpy.rope(want[:, : H + K], cos, sin, style)
    if rot is not None:
        want = ops_numpy.rotate(want, rot)
    ops_numpy.write_kv(layers[0], layers[1], slots, want[:, H : H + K], want[:, H + K :])
    assert ops_numpy.rope_store(qkv, cos, sin, style, rot, layers[2], layers[3], slots)
    assert np.array_equal(qkv, want)
    assert np.array_equal(layers[0], layers[2]) and np.array_equal(layers[1], layers[3])


def test_rope_store_declines_a_float_pool_and_a_prefill_pass(kernels):
    qkv = np.zeros((1, 10, 64), np.float32)
    cos = sin = np.zeros((1, 32), np.float32)
    f16, q8 = np.zeros((4, 4, 2, 64), np.float16), np.zeros((4, 4, 2, 68), np.int8)
    assert not ops_numpy.rope_store(qkv, cos, sin, "neox", None, f16, q8, np.array([0]))
    many = np.zeros((40, 10, 64), np.float32)
    cos40 = np.zeros((40, 32), np.float32)
    assert not ops_numpy.rope_store(many, cos40, cos40, "neox", None, q8, q8, np.arange(40))


def test_rope_styles_rotate_their_own_pairs():
    """normal rotates (2i, 2i+1) by frequency i, neox (i, i + hd/2): the same rotation on rows
    in llama.cpp's order and in Hugging Face's."""
    rng = np.random.default_rng(2)
    hd = 8
    x = rng.standard_normal((3, 2, hd), dtype=np.float32)
    cos, sin = ops_numpy.rope_tables(hd, 3, 100.0)
    perm = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)  # pairs order -> value index in halves order
    got_pairs = ops_numpy.rope(x[..., perm].copy(), cos, sin, "normal")
    got_halves = ops_numpy.rope(x.copy(), cos, sin, "neox")
    np.testing.assert_allclose(got_pairs, got_halves[..., perm], rtol=1e-6, atol=1e-6)
    assert not np.allclose(ops_numpy.rope(x.copy(), cos, sin, "normal"), got_halves, atol=1e-3)


def test_kernels_off_gives_the_same_tokens(tiny):
    """LOCALKV_CPU_KERNELS=0 in a fresh process: numpy and BLAS only, the same greedy tokens."""
    code = (
        "import json, sys; from localkv.engine import Engine; from localkv.config import EngineConfig;"
        "from localkv.generation import Generation; from localkv.sampling import SamplingParams;"
        "e = Engine(EngineConfig(model=sys.argv[1], disk_cache=False));"
        f"r = Generation(e, {PROMPT}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).run();"
        "print(json.dumps([e.cpu_kernels, r.tokens]))"
    )

    def run(switch: str):
        env = dict(os.environ, LOCALKV_CPU_KERNELS=switch)
        out = subprocess.run([sys.executable, "-c", code, str(tiny)], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    on, off = run("1"), run("0")
    assert on[0] and not off[0]
    assert on[1] == off[1] and len(on[1]) == 12


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_attention_matches_paged_attention(kernels, dtype):
    """One kernel call for B single-token sequences (tables in any block order, ragged
    lengths, an f16 pool read as its bits) gives paged_attention's result for each."""
    rng = np.random.default_rng(7)
    kvh, g, hd, bs, nb = 3, 3, 64, 16, 40
    kl, vl = (rng.standard_normal((nb, bs, kvh, hd)).astype(dtype) for _ in range(2))
    lens = [1, 17, 300, 64]
    tables = [rng.permutation(nb)[: -(-n // bs)] for n in lens]
    q = rng.standard_normal((len(lens), kvh * g + 2 * kvh, hd), dtype=np.float32)[:, : kvh * g]
    got = ops_numpy.decode(q, kl, vl, ops_numpy.DecodeBatch(tables, lens), 0.125)
    for b, (t, n) in enumerate(zip(tables, lens)):
        want = ops_numpy.paged_attention(q[b : b + 1], kl, vl, t, n, 0.125)[0]
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)


def test_threads_leave_the_cores_other_processes_keep_busy():
    from localkv.backends.cpu.threads import CoreShare

    tick = os.sysconf("SC_CLK_TCK")
    clock, busy, own = [0.0], [0.0], [0.0]
    share = CoreShare(2, machine=lambda: (busy[0], 0.0), own=lambda: own[0], clock=lambda: clock[0], cpus=2)

    def interval(others: float, mine: float) -> int:  # cores' worth of work over one second
        clock[0] += 1.0
        own[0] += mine
        busy[0] += (others + mine) * tick
        return share.threads()

    assert interval(0.1, 2.0) == 2
    assert interval(0.9, 1.0) == 2  # once: a blip
    assert interval(0.9, 1.0) == 1  # twice: another process holds a core
    assert interval(0.3, 1.0) == 1
    assert interval(0.3, 1.0) == 2  # free again
    assert CoreShare(2, machine=lambda: None).threads() == 2  # no /proc/stat: the engine's count
    assert CoreShare(1).threads() == 1


CAUSAL_CASES = [(37, 0, 3, 64), (100, 250, 4, 64), (1, 40, 3, 64), (70, 5, 1, 128), (512, 0, 3, 64)]
CAUSAL_CASES += [(18, 2000, 3, 64), (9, 30, 4, 64), (32, 7, 3, 64)]  # short passes: tiles of 8


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("T,past,g,hd", CAUSAL_CASES)
def test_causal_kernel_matches_numpy(kernels, monkeypatch, dtype, T, past, g, hd):
    """Prefill attention in the tiled kernel (query tiles, key chunks, the diagonal masked)
    against the numpy path, through a shuffled block table."""
    rng = np.random.default_rng(T + past)
    kvh, bs, n = 2, 16, past + T
    blocks = -(-n // bs)
    k, v = (rng.standard_normal((blocks + 4, bs, kvh, hd)).astype(dtype) for _ in range(2))
    table = rng.permutation(blocks + 4)[:blocks]
    q = rng.standard_normal((T, kvh * g, hd), dtype=np.float32)
    got = ops_numpy.paged_attention(q, k, v, table, n, 0.125)
    monkeypatch.setattr(build.state, "ok", False)
    np.testing.assert_allclose(got, ops_numpy.paged_attention(q, k, v, table, n, 0.125), rtol=1e-4, atol=1e-5)


def test_heads_not_a_multiple_of_8_take_numpy(kernels, monkeypatch):
    """The attention kernels load 8 values of a head at a time: a head of 12 runs prefill and
    batched decode in numpy, with the same result as kernels off."""
    rng = np.random.default_rng(3)
    kvh, g, hd, bs, nb = 2, 3, 12, 16, 12
    kl, vl = (rng.standard_normal((nb, bs, kvh, hd)).astype(np.float16) for _ in range(2))
    lens = [70, 75]  # 4 shared blocks, then one block each
    tables = [np.array([0, 1, 2, 3, 4 + b]) for b in range(2)]
    q = rng.standard_normal((2, kvh * g, hd), dtype=np.float32)

    def run():
        return (
            ops_numpy.paged_attention(q[:1].repeat(5, 0), kl, vl, tables[0], 70, 0.125),
            ops_numpy.decode(q, kl, vl, ops_numpy.DecodeBatch(tables, lens), 0.125),
        )

    on = run()
    monkeypatch.setattr(build.state, "ok", False)
    for got, want in zip(on, run()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "quant_type, head_dim, kv_dtype",
    [("F32", 16, "auto"), ("Q4_1", 16, "auto"), ("Q4_1", 32, "auto"), ("Q4_1", 32, "q8_0")],
)
def test_a_run_compiles_nothing_after_the_start(tmp_path, quant_type, head_dim, kv_dtype):
    """Engine() loads every build a run's kernels need (the array kinds the model passes, its
    pool's formats: f16 for heads of 16, q8_0:q4_0 by default for heads of 32): a prompt, its decode
    steps and 4 forked branches compile or load nothing more. In a fresh process: what an
    earlier test compiled would hide a missing build."""
    code = """if True:
        import gc, json, sys
        from numba.core.registry import CPUDispatcher
        from localkv.engine import Engine
        from localkv.config import EngineConfig
        from localkv.generation import Generation
        from localkv.sampling import SamplingParams

        def builds():
            return sorted((d.__qualname__, str(s)) for d in gc.get_objects() if isinstance(d, CPUDispatcher)
                          for s in d.signatures)

        e = Engine(EngineConfig(model=sys.argv[1], disk_cache=False, block_size=8, kv_dtype=sys.argv[2]))
        start = builds()
        p = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
        Generation(e, list(range(3, 40)), p).run()
        Generation(e, list(range(3, 60)), p, n=4).run()
        print(json.dumps([e.cpu_kernels, e.kv_dtype, start, builds()]))
    """
    model = write_gguf(tmp_path / "tiny.gguf", quant=quant_type, ctx=256, dim=4 * head_dim)
    out = subprocess.run([sys.executable, "-c", code, str(model), kv_dtype], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    on, pool, start, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert on and start
    assert pool == (kv_dtype if kv_dtype != "auto" else "q8_0:q4_0" if head_dim % 32 == 0 else "f16")
    assert after == start, sorted(set(map(tuple, after)) - set(map(tuple, start)))


def test_cached_kernels_load_without_numbas_compiler_tables(kernels):
    """A start loads its kernels from numba's cache without importing numba's typing and
    lowering tables (numpy's linalg, random, polynomial...) or sending its LLVM-lock events; a
    kernel that compiles inside the same block still finds the tables, and afterwards numba's
    own cache loader and events are back.
    In a fresh process (this one has compiled); the kernels are cached by the fixture."""
    code = """if True:
        import json, sys
        import numpy as np
        from numba import njit
        from numba.core.caching import Cache
        from localkv.backends.cpu import build
        from localkv.backends.cpu.numba_hooks import tables_deferred

        assert build.load(["Q4_1", "Q8_0"])
        tables = ("numba.np.linalg", "numba.np.random.generator_methods", "numba.np.polynomial.polynomial_functions")
        loaded = [m for m in tables if m in sys.modules]
        from llvmlite.binding import ffi

        with tables_deferred():
            compiled = njit(lambda a: np.cos(a).sum())(np.zeros(3))  # lowering np.cos needs the tables
            events = len(ffi.lib._lock._cblist)  # numba's llvm_lock events are off meanwhile
        events = [events, len(ffi.lib._lock._cblist)]
        print(json.dumps([loaded, float(compiled), Cache.load_overload.__module__, events]))
    """
    build.load(["Q4_1", "Q8_0"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded, compiled, loader, events = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [] and compiled == 3.0 and loader == "numba.core.caching" and events == [0, 1]


def test_idle_workers_spin_briefly_unless_the_user_says_otherwise():
    """localkv shortens OpenBLAS's and libgomp's spin before either library loads; a value in
    the environment is kept."""
    code = "import os, localkv; print(os.environ['GOMP_SPINCOUNT'], os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    for extra, want in (({}, "100000 20"), ({"GOMP_SPINCOUNT": "7", "OPENBLAS_THREAD_TIMEOUT": "9"}, "7 9")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env | extra)
        assert out.stdout.split() == want.split(), out.stderr


def test_auto_is_q8_0_k_q4_0_v_where_the_kernels_run_and_a_head_splits(kernels, monkeypatch):
    """--kv-dtype auto on the CPU: K in q8_0 and V in q4_0 for heads of a multiple of their
    32-value blocks, f16 for others, and f16 whenever the kernels are off (numpy's quantization
    is many passes)."""
    from localkv.backends.cpu.backend import CpuBackend

    sizes = (16, 32, 64, 80, 96, 128)
    pair = "q8_0:q4_0"
    assert [CpuBackend.default_kv(hd) for hd in sizes] == ["f16", pair, pair, "f16", pair, pair]
    monkeypatch.setattr(build.state, "ok", False)
    assert CpuBackend.default_kv(64) == "f16"


def test_a_pool_whose_kernel_check_fails_turns_the_kernels_off():
    """The kv group's checks run for the pool a start asks for ("K:V"), once; one that fails
    turns the kernels off with the reason (the pool then takes numpy's path). In a fresh
    process: the state is the process's."""
    code = """if True:
        from localkv.backends.cpu import build
        from localkv.backends.cpu.kernels import CHECKS, Check

        assert build.load(kv=["f16"]) and build.state.kv == {"f16:f16": None}
        CHECKS["kv"][0] = Check(lambda k, v: k != "q8_0", 0.0)
        assert build.load(kv=["q8_0:q4_0"]) is False
        print(build.state.why)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "q8_0:q4_0 pool" in out.stdout


def test_a_helper_in_a_parallel_loop_compiles_once(kernels):
    """numba types a prange body's calls under the kernel's options, then compiles the body
    again under numpy's error model; a helper whose caller's options differ compiles again,
    with every helper under it. The kernels' options name numpy's error model, so a body that
    takes views (as theirs do: numba then keeps its aliasing as it was) compiles each helper
    once (a first run compiled most of them twice)."""
    from numba import njit, prange
    from numba.core import event
    from numba.extending import register_jitable

    from localkv.backends.cpu.kernels import EXACT_PAR

    @register_jitable
    def inner(x, i):
        x[i] = 2.0

    @register_jitable
    def helper(x, i):
        inner(x, i)

    @njit(**dict(EXACT_PAR, cache=False))
    def kernel(x):
        for i in prange(len(x)):
            helper(x[i:], 0)

    class Seen(event.Listener):
        compiled = []

        def on_start(self, ev):
            self.compiled.append(ev.data["dispatcher"].py_func)

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Seen()):
        x = np.zeros(4)
        kernel(x)
    assert x.tolist() == [2, 2, 2, 2]
    assert (Seen.compiled.count(helper), Seen.compiled.count(inner)) == (1, 1)
