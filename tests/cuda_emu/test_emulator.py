"""The CUDA emulator itself (selftest.cu), against CUDA's documented semantics written out here
independently of its implementation: warp shuffles lane by lane, votes, barriers and shared
memory in every thread order, fp16 conversions and arithmetic bit for bit against numpy, atomics
across worker threads, argument checking, and the undefined behaviour it must report instead of
computing something."""

from pathlib import Path

import numpy as np
import pytest

from cuda_emu import KernelError, Module, Settings, build_source, compiler

pytestmark = pytest.mark.skipif(
    compiler() is None, reason="no C++ compiler (g++, c++ or clang++; or set CXX): cannot emulate CUDA kernels"
)

SELFTEST = (Path(__file__).parent / "selftest.cu").read_text(encoding="utf-8")
ORDERS = [Settings(order="forward"), Settings(order="reverse"), Settings(order="random", seed=3)]


@pytest.fixture(scope="module")
def st():
    return Module(SELFTEST, name="selftest")


def _expected_source(op: str, lane: int, arg: int, width: int) -> int:
    """The lane whose value a shuffle returns, from the CUDA programming guide's wording."""
    base = lane // width * width
    if op == "idx":  # srcLane outside [0, width) wraps modulo width, within the lane's segment
        return base + arg % width
    if op == "up":  # lane - delta; lanes below the segment's start keep their own value
        return lane - arg if lane - arg >= base else lane
    if op == "down":  # lane + delta; lanes past the segment's end keep their own value
        return lane + arg if lane + arg < base + width else lane
    src = lane ^ arg  # xor: a lane may read earlier segments, reading a later one returns its own value
    return src if src < base + width else lane


SHUFFLE_CASES = [
    (op, arg, width)
    for width in (32, 16, 8, 4, 2, 1)
    for op, args in (("idx", (0, 5, 31, 17, 40)), ("up", (1, 3, 16)), ("down", (1, 2, 7, 16)), ("xor", (1, 2, 16, 31)))
    for arg in args
]


@pytest.mark.parametrize("settings", ORDERS, ids=lambda s: s.order)
def test_shuffles_move_values_between_the_documented_lanes(st, settings):
    ops = {"idx": 0, "up": 1, "down": 2, "xor": 3}
    cases = SHUFFLE_CASES
    out = np.full((len(cases), 64), -1, np.int32)  # two warps: lane = threadIdx.x % 32
    args = (
        out,
        np.array([ops[c[0]] for c in cases], np.int32),
        np.array([c[1] for c in cases], np.int32),
        np.array([c[2] for c in cases], np.int32),
        np.int32(len(cases)),
    )
    st.get_function("shuffles")((1,), (64,), args, settings=settings)
    for c, (op, arg, width) in enumerate(cases):
        want = [1000 * (t // 32) + _expected_source(op, t % 32, arg, width) for t in range(64)]
        assert out[c].tolist() == want, f"{op} arg {arg} width {width}"


def test_shuffles_of_other_types_and_votes(st):
    pred = (np.arange(32) % 3 == 0).astype(np.int32)
    out = np.zeros((32, 6))
    st.get_function("shuffle_types_and_votes")((1,), (32,), (out, pred))
    lanes = np.arange(32)
    np.testing.assert_array_equal(out[:, 0], 0.5 + (lanes ^ 1))
    np.testing.assert_array_equal(out[:, 1], 1e10 + np.where(lanes + 3 < 32, lanes + 3, lanes))
    np.testing.assert_array_equal(out[:, 2], 7)
    np.testing.assert_array_equal(out[:, 3], (lanes ^ 16) * 0.25 - 5)
    assert (out[:, 4] == int(sum(1 << int(i) for i in np.flatnonzero(pred)))).all()
    assert (out[:, 5] == 2).all()  # any, not all


def test_half_warp_masks_shuffle_separately(st):
    out = np.zeros(32, np.int32)
    st.get_function("half_warps")((1,), (32,), (out,))
    assert out.tolist() == [120] * 16 + [376] * 16


@pytest.mark.parametrize("settings", ORDERS, ids=lambda s: s.order)
@pytest.mark.parametrize("threads", [1024, 256, 64])
def test_barriers_order_shared_memory(st, settings, threads):
    x = np.random.default_rng(threads).standard_normal(3 * threads - 5).astype(np.float32)
    out = np.zeros(3, np.float32)
    st.get_function("block_sum")(
        (3,), (threads,), (out, x, np.int32(len(x))), shared_mem=4 * threads, settings=settings
    )
    want = [x[b * threads : (b + 1) * threads].sum(dtype=np.float64) for b in range(3)]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_exited_threads_count_as_arrived_at_a_barrier(st):
    out = np.full(256, -1, np.int32)
    st.get_function("early_exit")((1,), (256,), (out,))
    assert out[:100].tolist() == list(range(99, -1, -1)) and (out[100:] == -1).all()


def test_fp16_conversions_match_numpy_bit_for_bit(st):
    every_half = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    halves = every_half.view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float64)
    finite.sort()
    midpoints = (finite[:-1] + finite[1:]) / 2  # ties: round to even
    floats = np.concatenate(
        [
            midpoints,
            np.nextafter(midpoints, np.inf),
            np.nextafter(midpoints, -np.inf),
            rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000),
            [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 2.0**-25, 2.0**-24, 3e38],
        ]
    ).astype(np.float32)
    n = max(len(floats), len(every_half))
    f = np.resize(floats, n)
    h = np.resize(every_half, n)
    to_half, to_float = np.zeros(n, np.uint16), np.zeros(n, np.float32)
    st.get_function("half_convert")((64,), (256,), (to_half, to_float, f, h, np.int32(n)))
    with np.errstate(over="ignore"):
        want = f.astype(np.float16)
    nan = np.isnan(want)
    assert np.isnan(to_half.view(np.float16)[nan]).all()
    np.testing.assert_array_equal(to_half[~nan], want.view(np.uint16)[~nan])
    np.testing.assert_array_equal(to_float, h.view(np.float16).astype(np.float32))


def test_fp16_arithmetic_rounds_like_numpy(st):
    rng = np.random.default_rng(1)
    n = 4096
    a, b, c = (rng.standard_normal((n, 2)).astype(np.float16) * 3 for _ in range(3))
    out = np.zeros((n, 8), np.float16)
    st.get_function("half_math")((16,), (256,), (out, a, b, c, np.int32(n)))
    np.testing.assert_array_equal(out[:, 0:2], a + b)  # numpy: float op then one rounding to fp16
    np.testing.assert_array_equal(out[:, 2:4], a * b)
    fma = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(out[:, 4:6], fma)
    np.testing.assert_array_equal(out[:, 6], a[:, 0] - b[:, 1])
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(out[:, 7], np.exp(a[:, 0].astype(np.float32)).astype(np.float16), rtol=2e-3)


def test_atomics_from_parallel_workers(st):
    fsum, isum = np.zeros(1, np.float32), np.zeros(1, np.int32)
    usum, imax = np.zeros(1, np.uint64), np.full(1, -1, np.int32)
    st.get_function("atomics")((64,), (128,), (fsum, isum, usum, imax), settings=Settings(workers=2))
    n = 64 * 128
    assert (fsum[0], isum[0], usum[0], imax[0]) == (n, n * (n - 1) // 2, n, n - 1)


def test_3d_grid_and_block_indices(st):
    grid, block = (3, 2, 2), (4, 4, 4)
    out = np.zeros(12 * 64, np.int32)
    st.get_function("indices")(grid, block, (out,))
    want = [
        (bz << 24) | (by << 18) | (bx << 12) | (tz << 8) | (ty << 4) | tx
        for bz in range(2)
        for by in range(2)
        for bx in range(3)
        for tz in range(4)
        for ty in range(4)
        for tx in range(4)
    ]
    assert out.tolist() == want


def test_launch_configuration_is_checked_as_on_a_gpu(st):
    k = st.get_function("indices")
    out = np.zeros(4096, np.int32)
    with pytest.raises(KernelError, match="__launch_bounds__ 64") as e:
        k((1,), (128,), (out,))  # more threads than the kernel's __launch_bounds__(64)
    assert e.value.code == 2
    with pytest.raises(KernelError, match="invalid configuration"):
        k((1, 70000), (32,), (out,))  # grid.y > 65535
    with pytest.raises(KernelError, match="max_dynamic_shared_size_bytes"):
        st.get_function("block_sum")(
            (1,), (64,), (np.zeros(1, np.float32), out[:0].view(np.float32), np.int32(0)), shared_mem=64 << 10
        )


def test_arguments_are_checked_like_a_kernel_signature(st):
    out = np.zeros(6)
    k = st.get_function("scalars")
    k((1,), (1,), (out, np.int32(-3), 1 << 40, np.float32(1.5), 2.25, np.uint32(7), np.float16(0.5)))
    assert out.tolist() == [-3, 1 << 40, 1.5, 2.25, 7, 0.5]  # a Python int is int64, a Python float double
    with pytest.raises(TypeError, match=r"argument 1 \(i\) takes int, got long long"):
        k((1,), (1,), (out, 3, 1, np.float32(1), 2.0, np.uint32(7), np.float16(0)))
    with pytest.raises(TypeError, match=r"argument 3 \(f\) takes float, got double"):
        k((1,), (1,), (out, np.int32(3), 1, 1.0, 2.0, np.uint32(7), np.float16(0)))
    with pytest.raises(TypeError, match=r"argument 0 \(out\) points to double: got a float32 array"):
        k((1,), (1,), (out.astype(np.float32), np.int32(3), 1, np.float32(1), 2.0, np.uint32(7), np.float16(0)))
    with pytest.raises(TypeError, match="takes 7 arguments"):
        k((1,), (1,), (out,))
    ro = np.zeros(6)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        k((1,), (1,), (ro, np.int32(3), 1, np.float32(1), 2.0, np.uint32(7), np.float16(0)))


def _readonly(a):
    a.flags.writeable = False
    return a


UNDEFINED = [
    (
        "read_past_end",
        lambda: (np.zeros(32, np.float32), np.zeros(100, np.float32), np.int32(100)),
        32,
        r"invalid memory access: read .*0 bytes past the end of the buffer of argument 1 \(x\) \(400 bytes\)",
    ),
    (
        "write_at",
        lambda: (np.zeros(100, np.float32), np.int32(-1)),
        1,
        r"a write 4 bytes before the start of the buffer of argument 0 \(x\) \(400 bytes\)",
    ),
    (
        "write_at",
        lambda: (np.zeros(25, np.float32), np.int32(25)),
        1,
        r"a write 0 bytes past the end of the buffer of argument 0 \(x\) \(100 bytes\)",
    ),
    (
        "write_readonly",
        lambda: (_readonly(np.zeros(64, np.float32)),),
        32,
        r"write .*a write into the read-only buffer of argument 0 \(x\)",
    ),
    (
        "misaligned_half2",
        lambda: (np.zeros(32, np.float32), np.zeros(8, np.float16)),
        32,
        r"misaligned address: a __half2 access",
    ),
    (
        "shuffle_after_exit",
        lambda: (np.zeros(32, np.float32),),
        32,
        r"lane 16 exits while lanes 0x0000ffff of its warp wait for it in __shfl_xor_sync",
    ),
    ("barrier_deadlock", lambda: (np.zeros(32, np.float32),), 32, r"deadlock: 16 threads wait in __syncthreads"),
    ("shuffle_outside_mask", lambda: (np.zeros(32, np.int32),), 16, r"reads lane 20, which is not in the mask"),
    ("deep_recursion", lambda: (np.zeros(32, np.int32), np.int32(500)), 2, r"stack overflow of an emulated thread"),
]


@pytest.mark.parametrize("name,args,threads,message", UNDEFINED, ids=[f"{u[0]}-{i}" for i, u in enumerate(UNDEFINED)])
def test_undefined_behaviour_is_an_error_not_a_result(st, name, args, threads, message):
    with pytest.raises(KernelError, match=message):
        st.get_function(name)((1,), (threads,), args())
    out = np.full(32, -1, np.int32)  # the emulator is usable after a failed launch
    st.get_function("half_warps")((1,), (32,), (out,))
    assert out[0] == 120


def test_ucontext_fallback_schedules_the_same(tmp_path):
    """Where the x86-64 context switch is not available, swapcontext runs the fibers."""
    m = Module.from_built(build_source(SELFTEST, "selftest-ucontext", extra_flags=("-DLKV_EMU_UCONTEXT",)))
    out = np.zeros(32, np.int32)
    m.get_function("half_warps")((1,), (32,), (out,))
    assert out.tolist() == [120] * 16 + [376] * 16
    x = np.arange(256, dtype=np.float32)
    sums = np.zeros(1, np.float32)
    m.get_function("block_sum")((1,), (256,), (sums, x, np.int32(256)), shared_mem=1024)
    assert sums[0] == x.sum()
