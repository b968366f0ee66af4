"""The cost of a speculative verify pass against a decode step, on one engine: after a prompt,
the median time of a 1-row decode step and of one forward pass of 1 + k rows with every row's
logits (what `--spec` verifies), each undone afterwards, interleaved. Prints both and the ratio.

    python scripts/verify_width.py [-m MODEL] [-k 8] [-r 15] [-t THREADS]
"""

import argparse
import statistics
from time import perf_counter

import numpy as np

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.sequence import Sequence


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-k", type=int, default=8, help="drafted rows beside the one (default 8)")
    ap.add_argument("-r", "--reps", type=int, default=15)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    opts = {"model": a.model} if a.model else {}
    eng = Engine(EngineConfig(threads=a.threads, prefix_cache=False, **opts))
    rng = np.random.default_rng(0)
    seq = Sequence([int(t) for t in rng.integers(10, 1000, 64)])
    eng.prefill(seq)
    one, wide = [], []
    for _ in range(a.reps + 2):  # the first two warm up
        seq.tokens.append(int(rng.integers(10, 1000)))
        t0 = perf_counter()
        eng.forward([seq], counts=[1])
        one.append(perf_counter() - t0)
        eng.rollback(seq, 1)
        seq.tokens += [int(t) for t in rng.integers(10, 1000, a.k + 1)]
        t0 = perf_counter()
        eng.forward([seq], counts=[a.k + 1], all_logits=True)
        wide.append(perf_counter() - t0)
        eng.rollback(seq, a.k + 1)
    s1, sk = statistics.median(one[2:]), statistics.median(wide[2:])
    print(f"model {eng.model_config.name}, threads {eng.threads}, {a.reps} reps after 2 warm-up")
    print(f"1-row decode step: {s1 * 1e3:.2f} ms; pass of 1 + {a.k} rows, all logits: {sk * 1e3:.2f} ms")
    print(f"ratio: {sk / s1:.2f}x")
    eng.free(seq)


if __name__ == "__main__":
    main()
