"""The kernels' first compile: build.load's jobs (each a check that compiles, or loads from
numba's cache, the builds it names) run here in order. When one starts compiling (numba's cache
missed: a fresh install, a new weight type, edited sources), a line says so with an estimate,
a terminal gets a bar, and the jobs not yet begun are shared with worker processes that compile
them into numba's cache while this one compiles its share; this process then loads each from
the cache and checks it, so every kernel is still checked here before its first use.

Each job's builds are compiled in one process only: two processes saving one kernel's cache
index at once could each number their build 1, and one's machine code would then be filed under
the other's signature. A worker that fails costs only time: its jobs then compile here.
"""

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from numba.core import event  # imported by build.load once numba has imported

from localkv.backends.cpu.threads import busy_elsewhere
from localkv.errors import LocalkvError


@dataclass(frozen=True, slots=True)
class Job:
    key: str  # how a worker process names it (build.run_in_worker)
    cost: float  # its compile's estimated seconds on an empty cache (kernels.Check.cost)
    run: Callable[[], object]


def workers() -> int:
    """Processes a first compile may use: LOCALKV_COMPILE_WORKERS, else the CPUs this process
    may run on less those other processes keep busy now, at least one. A worker on a busy core
    gains little (each gets a time slice) and costs its own start and the compile of numba's
    helpers every process repeats (BENCHMARKS.md, "The first run")."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return setting() or max(1, cpus - round(busy_elsewhere()))


def setting() -> int | None:
    """LOCALKV_COMPILE_WORKERS as a count of processes (None when unset); a bad value raises."""
    value = os.environ.get("LOCALKV_COMPILE_WORKERS", "").strip()
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise LocalkvError(f"LOCALKV_COMPILE_WORKERS={value!r} is not a number of processes") from None


def run(
    jobs: list[Job], worker: list[str], progress: bool, processes: int | None = None, stream: TextIO | None = None
) -> tuple[dict, bool]:
    """Each job's result by key (what its run() returned, or the exception it raised), and
    whether anything compiled. worker: the command that compiles the jobs whose keys follow
    it; progress: the line (and on a terminal the bar) when something compiles; processes:
    how many share a compile, this one included (None: workers(), asked only when something
    compiles, as it takes a moment to measure)."""
    first = _FirstCompile(jobs, worker, processes, progress, stream or sys.stderr)
    results = {}
    try:
        with event.install_listener("numba:compile", first):
            for i, job in enumerate(jobs):
                first.at = i
                if job.key not in first.handed:
                    results[job.key] = _call(job)
                    first.finished(job)
            first.wait()
            for job in jobs:  # their builds in the cache by now: loads and checks
                if job.key in first.handed:
                    results[job.key] = _call(job)
    finally:  # Ctrl-C in a compile: the bar is erased (the workers share the terminal's signal)
        first.close()
    return results, first.started


def _call(job: Job):
    try:
        return job.run()
    except Exception as e:  # the caller says what a failed check turns off
        return e


class _FirstCompile(event.Listener):
    """numba's compile events: the first one starts the line, the bar and the workers."""

    def __init__(self, jobs: list[Job], worker: list[str], processes: int | None, progress: bool, stream: TextIO):
        super().__init__()
        self.jobs, self.worker, self.processes = jobs, worker, processes
        self.progress, self.stream = progress, stream
        self.at = 0  # the job running here
        self.started = False
        self.handed: set[str] = set()  # keys of the jobs a worker compiles
        self.procs: list[tuple[subprocess.Popen, threading.Thread]] = []
        self.bar = self.task = None

    def on_start(self, ev):
        if not self.started:
            self.started = True
            self._begin()

    def on_end(self, ev):
        pass

    def _begin(self):
        """Inside the first compile: share out the jobs not begun, say so, start the workers."""
        current, rest = self.jobs[self.at], self.jobs[self.at + 1 :]
        if self.processes is None:
            self.processes = workers() if rest else 1
        shares, loads = [[] for _ in range(self.processes)], [current.cost] + [0.0] * (self.processes - 1)
        for job in sorted(rest, key=lambda j: -j.cost):  # longest first, to the least loaded
            w = loads.index(min(loads))
            shares[w].append(job)
            loads[w] += job.cost
        if self.progress:
            print(f"compiling the CPU kernels for this machine, once: about {max(loads):.0f} s", file=self.stream)
            self.stream.flush()
            self._start_bar(current.cost + sum(j.cost for j in rest))
        for share in shares[1:]:
            if share:
                self._spawn(share)

    def _spawn(self, share: list[Job]):
        try:
            proc = subprocess.Popen(
                [*self.worker, *(j.key for j in share)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:  # no process to spare: these compile here
            return
        self.handed.update(j.key for j in share)
        costs = {j.key: j.cost for j in share}
        reader = threading.Thread(target=self._read, args=(proc, costs), daemon=True)
        reader.start()
        self.procs.append((proc, reader))

    def _read(self, proc: subprocess.Popen, costs: dict[str, float]):
        """A worker says `done KEY` as each of its jobs is in the cache."""
        for line in proc.stdout:
            key = line.strip().removeprefix("done ")
            if key in costs:
                self._advance(costs[key])

    def finished(self, job: Job):
        if self.started:
            self._advance(job.cost)

    def wait(self):
        for proc, reader in self.procs:
            proc.wait()
            reader.join()

    def _start_bar(self, total: float):
        if not _isatty(self.stream):
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=self.stream, force_terminal=True)
        columns = (TextColumn("compiling"), BarColumn(), TimeElapsedColumn())
        # not redirected: the bar must not take over sys.stdout, where a reply may stream next
        self.bar = Progress(*columns, console=console, transient=True, redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task("compiling", total=total)
        self.bar.start()

    def _advance(self, cost: float):
        if self.bar is not None:
            self.bar.advance(self.task, cost)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
