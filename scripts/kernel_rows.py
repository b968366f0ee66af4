"""The weight kernels alone: one weight of each type (random blocks, [8195 x 2048] by default:
cache-resident, so compute, not memory) through quant.compiled.every_row for passes of a few
row counts, on the threads numba has; the minimum of the reps in ms.

    python scripts/kernel_rows.py [--types Q4_0,Q8_0,Q4_K,Q6_K] [--rows 1,9,64] [-r 20]
"""

import argparse
import time

import numpy as np

from localkv.backends.cpu.quant import compiled
from localkv.backends.cpu.quant.tensor import QStack, sample_weight


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,9,64")
    ap.add_argument("--outputs", type=int, default=8195)
    ap.add_argument("--inputs", type=int, default=2048)
    ap.add_argument("-r", "--reps", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for qtype in a.types.split(","):
        (run,) = QStack([sample_weight(qtype, a.outputs, a.inputs, 1)]).runs
        for rows in map(int, a.rows.split(",")):
            x = rng.standard_normal((rows, a.inputs), dtype=np.float32)
            out = np.zeros((-(-rows // 16) * 16 + 8, a.outputs), np.float32)  # the lanes kernels write whole blocks
            compiled.every_row(run, x, out)
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                compiled.every_row(run, x, out)
                best = min(best, time.perf_counter() - t0)
            print(f"{qtype} {rows:4d} rows: {best * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
