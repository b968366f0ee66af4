"""The causal attention kernel alone: a pass of T query tokens after PAST cached positions, on
SmolLM2's shapes (9 query heads, 3 kv heads, head dim 64, blocks of 16) over an f16 pool, as
the model calls it (compiled.causal_attention). Prints ms per layer: the best of R rounds of
30 calls.

    python scripts/attention_bench.py [-T 18] [--past 2000] [-r 5] [-t 2]
"""

import argparse
import time

import numpy as np

from localkv.backends.cpu import build, compiled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-T", type=int, default=18, help="query tokens in the pass")
    ap.add_argument("--past", type=int, default=2000, help="positions already cached")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    if not build.load():
        raise SystemExit(f"attention_bench: no compiled kernels ({build.why_not()})")
    compiled.set_threads(a.threads)
    H, kvh, hd, bs = 9, 3, 64, 16
    n = a.past + a.T
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((-(-n // bs), bs, kvh, hd)).astype(np.float16) for _ in range(2))
    table = np.arange(len(k), dtype=np.int64)
    table.flags.writeable = False
    q = rng.standard_normal((a.T, H, hd)).astype(np.float32)
    compiled.causal_attention(q, k, v, table, n, 0.125)  # compiled or loaded from the cache
    best = float("inf")
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for _ in range(30):
            compiled.causal_attention(q, k, v, table, n, 0.125)
        best = min(best, (time.perf_counter() - t0) / 30)
    flops = 4 * a.T * H * hd * (a.past + a.T / 2)
    print(f"T={a.T} past={a.past} threads={a.threads}: {best * 1e3:.3f} ms per layer, {flops / best / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
