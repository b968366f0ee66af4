"""The kernels' first compile (backends/cpu/warmup.py): one line on stderr before anything
compiles and none when everything loads from numba's cache, a bar only on a terminal, and the
jobs not yet begun compiled by a worker process into the cache, from which this process then
loads them (and checks them itself)."""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

numba = pytest.importorskip("numba")

from numba.core import event  # noqa: E402

from localkv.backends.cpu import warmup  # noqa: E402
from localkv.errors import LocalkvError  # noqa: E402

LINE = "compiling the CPU kernels for this machine, once: about"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@numba.njit(cache=False)
def _warm(x):
    return x + 1


_warm(1)  # compiled before any test: calling it compiles nothing


def _fresh():
    """A kernel never compiled before: calling it compiles."""

    @numba.njit(cache=False)
    def f(x):
        return x * 2

    return f


class _SeenAtCompile(event.Listener):
    """What the stream held when a compile began (listeners hear of it in the order registered)."""

    def __init__(self, stream):
        self.stream, self.seen = stream, []

    def on_start(self, ev):
        self.seen.append(self.stream.getvalue())

    def on_end(self, ev):
        pass


def test_a_compile_is_said_in_one_line_before_it_starts():
    stream = io.StringIO()
    seen = _SeenAtCompile(stream)

    def cold():
        with event.install_listener("numba:compile", seen):
            return _fresh()(3)

    jobs = [warmup.Job("warm", 2.0, lambda: _warm(1)), warmup.Job("cold", 5.0, cold)]
    results, compiled = warmup.run(jobs, [], progress=True, processes=1, stream=stream)
    assert results == {"warm": 2, "cold": 6} and compiled
    assert seen.seen and seen.seen[0].startswith(LINE)  # said when the compile began
    assert stream.getvalue() == f"{LINE} 5 s\n"  # one line, the cold job's estimate; no bar off a terminal


def test_nothing_is_said_when_everything_is_cached():
    stream = Terminal()
    jobs = [warmup.Job("a", 2.0, lambda: _warm(1)), warmup.Job("b", 3.0, lambda: _warm(2))]
    results, compiled = warmup.run(jobs, [], progress=True, processes=2, stream=stream)
    assert results == {"a": 2, "b": 3} and not compiled
    assert stream.getvalue() == ""


def test_a_bar_is_drawn_on_a_terminal_only():
    stream = Terminal()
    warmup.run([warmup.Job("cold", 1.0, lambda: _fresh()(1))], [], progress=True, processes=1, stream=stream)
    out = stream.getvalue()
    assert out.startswith(f"{LINE} 1 s\n")
    assert "\x1b[" in out[len(LINE) :]  # the bar: drawn, then erased, in terminal codes


def test_a_job_that_raises_is_its_exception():
    def broken():
        raise RuntimeError("no")

    results, _ = warmup.run([warmup.Job("x", 1.0, broken)], [], progress=False, processes=1)
    assert isinstance(results["x"], RuntimeError)


def test_jobs_not_begun_compile_in_a_worker_and_load_here(tmp_path):
    """On an empty cache the first job compiles here; the element-wise kernels' job, not begun,
    goes to a worker process, and this one then only loads its builds from numba's cache."""
    code = textwrap.dedent("""
        import io, json, numba
        from localkv.backends.cpu import build, warmup
        assert build._numba() is None
        from localkv.backends.cpu.kernels import elementwise

        @numba.njit(cache=False)
        def here(x):
            return x + 1

        (job,) = [j for j in build._jobs(True, []) if j.key == "base:elementwise.check"]
        jobs = [warmup.Job("here", 1.0, lambda: here(1)), job]
        stream = io.StringIO()
        results, compiled = warmup.run(jobs, build._WORKER, True, {processes}, stream)
        kernels = (elementwise.rmsnorm, elementwise.rope, elementwise.silu_mul)
        print(json.dumps([results[job.key], compiled, stream.getvalue(),
                          sum(sum(k.stats.cache_misses.values()) for k in kernels),
                          sum(sum(k.stats.cache_hits.values()) for k in kernels)]))
    """)
    for processes, misses in ((2, 0), (1, None)):
        cache = tmp_path / f"cache{processes}"
        argv = [sys.executable, "-c", code.replace("{processes}", str(processes))]
        out = subprocess.run(argv, capture_output=True, text=True, env=os.environ | {"NUMBA_CACHE_DIR": str(cache)})
        assert out.returncode == 0, out.stderr
        ok, compiled, said, missed, hit = json.loads(out.stdout.strip().splitlines()[-1])
        assert ok is True and compiled and said.startswith(LINE)
        if misses is not None:  # the worker compiled them: every build here came from the cache
            assert missed == misses and hit >= 3
        else:  # one process: compiled here
            assert missed >= 3


def test_prefetch_loads_the_attention_kernels_in_the_background():
    """What the engine starts before a model's download: the kernels no weight type decides,
    loaded (or compiled) by a background thread, no weight type's yet. In a fresh process."""
    code = textwrap.dedent("""
        import threading
        from localkv.backends.cpu import build
        from localkv.backends.cpu.backend import CpuBackend

        CpuBackend(1).prefetch()
        (loading,) = [t for t in threading.enumerate() if t.name == "localkv-kernels"]
        loading.join()
        print(build.state.ok, build.state.types)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "{}"]


def test_the_worker_count_is_the_free_cpus_or_the_setting(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(warmup, "busy_elsewhere", lambda: 1.6)
    assert warmup.workers() == 2  # two of the four kept busy by others
    monkeypatch.setattr(warmup, "busy_elsewhere", lambda: 9.0)
    assert warmup.workers() == 1
    monkeypatch.setenv("LOCALKV_COMPILE_WORKERS", "3")
    assert warmup.workers() == 3
    monkeypatch.setenv("LOCALKV_COMPILE_WORKERS", "many")
    with pytest.raises(LocalkvError, match="LOCALKV_COMPILE_WORKERS='many'"):
        warmup.workers()


def test_the_cpus_busy_elsewhere_are_measured_now_not_averaged(monkeypatch):
    """Other processes' CPU time over the next moment, this process's own left out; the load
    average only where there are no counters (it trails the last minute: after `pip install`
    no CPU looked free)."""
    tick = os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    machine = iter([(1000.0, 0.0), (1000.0 + 0.2 * 1.5 * tick, 0.0)]).__next__  # 1.5 cores busy for 0.2 s
    own = iter([10.0, 10.0 + 0.2 * 0.5]).__next__  # half a core of it this process's
    clock = iter([100.0, 100.2]).__next__
    assert warmup.busy_elsewhere(machine, own, clock, sleep=lambda s: None) == pytest.approx(1.0)
    assert warmup.busy_elsewhere(lambda: None) == 5.0
