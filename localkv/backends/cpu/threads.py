"""How many threads the CPU backend's kernels and BLAS use right now: the engine's count, fewer
while other processes keep cores busy.

The kernels' OpenMP workers and OpenBLAS's spin while they wait for each other, and a decode
step starts about a hundred and fifty parallel regions. When another process holds a core, the
worker on it runs only in time slices, every region waits for one, and a step gets many times
slower than on one thread (measured on 2 cores with other busy threads). So the share of the
CPUs that other processes used over the last interval (/proc/stat's busy time less this
process's own) decides: a core counts as taken when others used half of it or more, for two
intervals in a row. Linux only; elsewhere the engine's count is used as it is.
"""

import os
import time
from collections.abc import Callable

INTERVAL = 0.2  # seconds between two looks at the CPU counters
_STAT = "/proc/stat"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's clock ticks a second
WINDOW = 0.2  # seconds busy_elsewhere looks (its own: CoreShare's INTERVAL is a re-measure period)


def _busy_jiffies() -> tuple[float, float] | None:
    """(busy, all) CPU time of the machine since boot in clock ticks, from /proc/stat's first line."""
    try:
        with open(_STAT, "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    return float(sum(ticks) - idle), float(sum(ticks))


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _others(before: tuple, after: tuple, tick: float = _TICK) -> float:
    """Cores' worth of CPU time other processes used between two samples (clock seconds, the
    machine's busy ticks, this process's own CPU seconds)."""
    (t0, busy0, own0), (t1, busy1, own1) = before, after
    return ((busy1 - busy0) / tick - (own1 - own0)) / (t1 - t0)


def busy_elsewhere(machine=_busy_jiffies, own=_own_seconds, clock=time.monotonic, sleep=time.sleep) -> float:
    """Cores' worth of CPU time other processes use over the next WINDOW seconds; elsewhere
    than Linux the load average. Not the load average where the counters exist: it trails the
    last minute, so a first compile right after `pip install` (the README's first command)
    found no CPU free and ran alone, twice as long. The readers are parameters so tests can
    play a machine."""

    def sample():
        m = machine()
        return None if m is None else (clock(), m[0], own())

    first = sample()
    if first is None:
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average here
            return 0.0
    sleep(WINDOW)
    return max(0.0, _others(first, sample()))


class CoreShare:
    """threads() is at most max_threads: the cores other processes leave idle, re-measured every
    INTERVAL seconds. The readers are parameters so tests can play a machine."""

    def __init__(
        self,
        max_threads: int,
        machine: Callable[[], tuple[float, float] | None] = _busy_jiffies,
        own: Callable[[], float] = _own_seconds,
        clock: Callable[[], float] = time.monotonic,
        cpus: int | None = None,
    ):
        self.max_threads = max_threads
        self.cpus = cpus or os.cpu_count() or 1
        self._machine, self._own, self._clock = machine, own, clock
        self._threads, self._pending = max_threads, max_threads
        self._last = self._sample()

    def _sample(self):
        m = self._machine()
        return None if m is None else (self._clock(), m[0], self._own())

    def threads(self) -> int:
        if self._last is None or self.max_threads == 1:
            return self.max_threads
        if self._clock() - self._last[0] >= INTERVAL:
            self._update()
        return self._threads

    def _update(self):
        now = self._sample()
        if now is None:
            return
        others = _others(self._last, now)
        self._last = now
        want = max(1, min(self.max_threads, int(self.cpus - others + 0.5)))
        if want == self._pending:  # the same answer twice in a row: a change, not a blip
            self._threads = want
        self._pending = want
