"""What a speed test moves through memory, and how fast this machine can read at all.

Bytes moved (a lower bound, the same for both engines): every forward pass reads each matmul
weight and the output head once (the embedding table only for the rows it looks up, not
counted; a tied head is the embedding table, read whole as the head), and every K/V row of
the context it attends over once. A tg pass is one token; a pp pass is one prefill chunk. The
weights are counted in the file's own encoding, the K/V in the pool's row formats.

The read probe is STREAM-style: passes summing a buffer of 64-bit words well past the
last-level cache, for PROBE_S seconds at least, in the bench's own process, on the suite's
thread count less the cores other processes hold (the kernels' own rule, CoreShare: on a
loaded machine a parallel pass on a taken core waits for its time slice), so a tg row's share
of it says how close decode runs to what the memory gives under the same load.
"""

import os
from time import perf_counter

import numba
import numpy as np

from localkv.backends.cpu import build
from localkv.backends.cpu.quant import QStack, QTensor
from localkv.backends.cpu.threads import CoreShare

PROBE_MIN_BYTES = 256 << 20
PROBE_S = 1.0  # a probe's passes last at least this long: time slices lost to other processes average out as in a rep
LLC_TIMES = 16  # the probe's buffer: this many last-level caches, PROBE_MIN_BYTES at least


def weight_bytes(weights: dict) -> int:
    """Bytes of the matrices one forward pass reads: every matmul weight and the output head."""
    total = 0
    for name, w in weights.items():
        if name == "tok_embd" and "output" in weights:
            continue  # looked up by row; the head is its own tensor
        for t in w.tensors if isinstance(w, QStack) else (w,):
            total += t.data.nbytes if isinstance(t, QTensor) else 0
    return total


def passes(n_depth: int, n_prompt: int, n_gen: int, chunk: int) -> list[int]:
    """The context each timed pass attends over: tg's first token is computed before the clock
    starts, so decode step i attends over depth + 2 + i tokens; pp's chunk j over its end."""
    if n_gen:
        return [n_depth + 2 + i for i in range(n_gen)]
    return [n_depth + min(end, n_prompt) for end in range(chunk, n_prompt + chunk, chunk)]


def bytes_moved(n_depth: int, n_prompt: int, n_gen: int, chunk: int, weights: int, kv_per_token: int) -> int:
    ctx = passes(n_depth, n_prompt, n_gen, chunk)
    return len(ctx) * weights + sum(ctx) * kv_per_token


def _llc_bytes() -> int:
    """The largest cache of CPU 0 (sysfs says "32768K"); 0 where it does not say."""
    base, sizes = "/sys/devices/system/cpu/cpu0/cache", [0]
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):  # not a cache index (uevent, power/)
            continue
    return max(sizes)


@numba.njit(parallel=True, cache=True)
def _sum_words(words, parts):
    # a slice's sum() compiles to a vectorized loop (an indexed loop keeps a negative-index test)
    n = words.size // parts
    out = np.zeros(parts, np.uint64)
    for p in numba.prange(parts):
        out[p] = words[p * n : (p + 1) * n].sum()
    return out.sum()


class ReadProbe:
    """Read bandwidth of this process on up to threads threads (gbps())."""

    def __init__(self, threads: int, nbytes: int | None = None, least_s: float = PROBE_S):
        build.load()  # numba's threading layer pinned as the kernels' before this compiles
        nbytes = nbytes or max(PROBE_MIN_BYTES, LLC_TIMES * _llc_bytes())
        self.threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        self.cores = CoreShare(self.threads)
        self.least_s = least_s
        self.parts = 8 * self.threads  # several per thread: a slow start of one thread evens out
        self.words = np.ones(nbytes // 8 // self.parts * self.parts, np.uint64)  # real pages, not the zero page
        self.nbytes = self.words.nbytes
        self.gbps(0.0)  # compiles, and the first pass warms the TLB

    def gbps(self, least_s: float | None = None) -> float:
        """Bytes read over seconds taken, in passes (at least one) until least_s (default: the
        probe's) have gone."""
        least_s = self.least_s if least_s is None else least_s
        was, passes = numba.get_num_threads(), 0
        t0 = perf_counter()
        try:
            while not passes or perf_counter() - t0 < least_s:
                numba.set_num_threads(self.cores.threads())
                _sum_words(self.words, self.parts)
                passes += 1
        finally:
            numba.set_num_threads(was)
        return passes * self.nbytes / (perf_counter() - t0) / 1e9

    def close(self):
        self.words = np.empty(0, np.uint64)
