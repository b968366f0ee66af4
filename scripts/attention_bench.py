"""The attention kernels alone: a pass of T query tokens after PAST cached positions, on
SmolLM2's shapes (9 query heads, 3 kv heads, head dim 64, blocks of 16) over a pool in one K/V
format, as the model calls them (compiled.causal_attention; with --decode, one sequence's
decode step, compiled.decode_rows). Prints ms per layer: the best of R rounds of 30 calls.

    python scripts/attention_bench.py [-T 18] [--past 2000] [--kv f16] [--decode] [-r 5] [-t 2]
"""

import argparse
import time

import numpy as np

from localkv import kv_format
from localkv.backends.cpu import build, compiled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-T", type=int, default=18, help="query tokens in the pass")
    ap.add_argument("--past", type=int, default=2000, help="positions already cached")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--kv", default="f16", help="the pool's K:V formats, as --kv-dtype says them")
    ap.add_argument("--decode", action="store_true", help="one decode step (T=1) after PAST positions")
    a = ap.parse_args()
    if not build.load():
        raise SystemExit(f"attention_bench: no compiled kernels ({build.why_not()})")
    compiled.set_threads(a.threads)
    H, kvh, hd, bs = 9, 3, 64, 16
    T = 1 if a.decode else a.T
    n = a.past + T
    rng = np.random.default_rng(0)
    k, v = (
        kv_format.encode(rng.standard_normal((-(-n // bs), bs, kvh, hd)).astype(np.float32), fmt)
        for fmt in kv_format.parse(a.kv)
    )
    table = np.arange(len(k), dtype=np.int64)
    table.flags.writeable = False
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    if a.decode:
        tables, lens = table[None], np.array([n], np.int64)
        lens.flags.writeable = False
        call = lambda: compiled.decode_rows(q, k, v, tables, lens, 0.125)  # noqa: E731
    else:
        call = lambda: compiled.causal_attention(q, k, v, table, n, 0.125)  # noqa: E731
    call()  # compiled or loaded from the cache
    best = float("inf")
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for _ in range(30):
            call()
        best = min(best, (time.perf_counter() - t0) / 30)
    flops = 4 * T * H * hd * (a.past + T / 2)
    what = f"T={T} past={a.past} kv={a.kv}{' decode' if a.decode else ''} threads={a.threads}"
    print(f"{what}: {best * 1e3:.3f} ms per layer, {flops / best / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
