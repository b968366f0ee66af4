"""The suites of `localkv bench` and where each one is measured.

Every suite module has `run(options) -> Report`. Only the standard library is imported here:
the cache suite's timed children run as `python -m localkv.bench.child_ttft` (and
child_ttft_peer), and whatever this file imported would load before their clocks start.
"""

import importlib
from collections.abc import Callable

# what `all` runs, in this order
SUITES = ("speed", "memory", "fork", "cache", "evict", "kv", "grammar", "serve", "spec")

RUNNERS = {  # suite -> the module whose run(options) measures it
    "speed": "localkv.bench.speed",
    "memory": "localkv.bench.memory_suite",
    "fork": "localkv.bench.fork",
    "cache": "localkv.bench.cache",
    "evict": "localkv.bench.evict",
    "kv": "localkv.bench.kv",
    "grammar": "localkv.bench.grammar_cost",
    "serve": "localkv.bench.serve",
    "spec": "localkv.bench.spec",
}


def runner(suite: str) -> Callable:
    """The suite's run(options) -> Report."""
    return importlib.import_module(RUNNERS[suite]).run
