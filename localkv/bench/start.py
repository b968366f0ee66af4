"""Engine start, as a person's `localkv run` pays it before its prompt's first token: a fresh
process's imports of localkv and `Engine(config)`, with the page cache warm (a first start reads
the model file and numba's kernel cache, not timed). The interpreter's own start is not counted.

Python writes each module's bytecode cache on its first import, as it does on a user's machine:
the children run without PYTHONDONTWRITEBYTECODE, which would compile every module on every start.
"""

import os
import statistics
import subprocess
import sys
import tempfile

GOAL_S = 0.5  # issue 16's engine start
REPS = 3

_CHILD = """
import sys, time
t0 = time.perf_counter()
from localkv.config import EngineConfig
from localkv.engine import Engine
Engine(EngineConfig(model=sys.argv[1], threads=int(sys.argv[2])))
print(f"localkv-start-s {time.perf_counter() - t0}")
"""


def engine_starts(model: str, threads: int, reps: int = REPS) -> list[float]:
    """Seconds of `reps` starts, each in a new process, with a private LOCALKV_HOME, after one
    untimed start (which also writes the packed K-quant weights the others map). Raises
    RuntimeError with the child's last stderr line when one fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times = []
    with tempfile.TemporaryDirectory() as home:
        for _ in range(reps + 1):
            argv = [sys.executable, "-c", _CHILD, model, str(threads)]
            p = subprocess.run(argv, capture_output=True, text=True, env=env | {"LOCALKV_HOME": home})
            said = [line for line in p.stdout.splitlines() if line.startswith("localkv-start-s ")]
            if p.returncode != 0 or not said:
                last = (p.stderr.strip().splitlines() or [""])[-1]
                raise RuntimeError(f"engine start exited {p.returncode}: {last[-300:]}")
            times.append(float(said[-1].split()[1]))
    return times[1:]


def summary(model: str, threads: int) -> dict[str, str]:
    """The report line: the median start and whether it meets the goal."""
    times = engine_starts(model, threads)
    med = statistics.median(times)
    verdict = "holds" if med <= GOAL_S else "MISSED"
    spread = ", ".join(f"{t:.2f}" for t in times)
    return {f"engine start, median of {len(times)} ({spread} s)": f"{med:.2f} s (goal {GOAL_S} s): {verdict}"}
