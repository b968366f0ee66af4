"""f16 against q8_0 K/V in one process, the two alternating rep by rep (a loaded machine moves
separate runs more than the formats do): `python scripts/kv_dtype_ab.py pp512 [REPS]` times
prefills of the same 512 tokens (prefix cache off); `python scripts/kv_dtype_ab.py tg [REPS]`
64 greedy decode steps after a 128-token prompt (short context, where the pool read is small);
`python scripts/kv_dtype_ab.py warm [REPS]`
the cache suite's warm TTFT: its 2,000-token system prompt + a user turn, each rep a fresh engine
per format (empty pool) on a disk tier the first request of each format filled. SmolLM2-135M,
2 threads; prints each rep and the medians' ratio."""

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("LOCALKV_HOME", tempfile.mkdtemp(prefix="kv-dtype-ab-"))  # a private disk tier

from localkv.bench.cache import QUESTIONS, chat_ids, system_text
from localkv.bench.text import text_ids
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.sequence import Sequence

DTYPES = ("f16", "q8_0")
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def config(kv_dtype: str, **kw) -> EngineConfig:
    return EngineConfig(threads=2, kv_dtype=kv_dtype, **kw)


def pp512(reps: int) -> dict[str, list[float]]:
    """Seconds per prefill of 512 tokens; the first round warms up."""
    engines = {d: Engine(config(d, prefix_cache=False, disk_cache=False)) for d in DTYPES}
    ids = text_ids(engines["f16"], 512)
    out = {d: [] for d in DTYPES}
    for i in range(reps + 1):
        for d in DTYPES if i % 2 else DTYPES[::-1]:
            seq = Sequence(list(ids))
            t = time.perf_counter()
            engines[d].prefill(seq)
            if i:
                out[d].append(time.perf_counter() - t)
            engines[d].free(seq)
    return out


def tg(reps: int) -> dict[str, list[float]]:
    """Seconds per decode step over 64 steps after a 128-token prompt; the first round warms up."""
    engines = {d: Engine(config(d, prefix_cache=False, disk_cache=False)) for d in DTYPES}
    ids = text_ids(engines["f16"], 128)
    params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    out = {d: [] for d in DTYPES}
    for i in range(reps + 1):
        for d in DTYPES if i % 2 else DTYPES[::-1]:
            r = Generation(engines[d], list(ids), params).run()
            if i:
                out[d].append(r.eval_s / (r.completion_tokens - 1))
    return out


def warm(reps: int) -> dict[str, list[float]]:
    """Time to first token of the warm request, a fresh engine each rep."""
    eng = Engine(config("f16", disk_cache=True))
    system = system_text(eng, 2000)
    fill, again = (
        chat_ids(eng, [{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in QUESTIONS[:2]
    )
    for d in DTYPES:
        Generation(Engine(config(d, disk_cache=True)), fill, ONE_TOKEN).run()
    out = {d: [] for d in DTYPES}
    for i in range(reps):
        for d in DTYPES if i % 2 else DTYPES[::-1]:
            r = Generation(Engine(config(d, disk_cache=True)), again, ONE_TOKEN).run()
            if r.cached_tokens < 2000:
                raise RuntimeError(f"{d}: the warm request found {r.cached_tokens} tokens on disk, not 2,000")
            out[d].append(r.ttft_s)
    return out


def main():
    what, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
    tests = {"pp512": pp512, "tg": tg, "warm": warm}
    if what not in tests:
        sys.exit(f"error: unknown test {what!r}: use pp512, tg or warm")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    times = tests[what](reps)
    per = {"pp512": 512, "tg": 1}.get(what)
    for d, ts in times.items():
        shown = [round(per / t, 1) for t in ts] if per else [round(t, 3) for t in ts]
        print(d, "t/s" if per else "TTFT s", shown)
    m = {d: statistics.median(ts) for d, ts in times.items()}
    best = {d: min(ts) for d, ts in times.items()}
    if per:
        print(f"q8_0 / f16 speed (medians): {m['f16'] / m['q8_0']:.3f}; best reps: {best['f16'] / best['q8_0']:.3f}")
    else:
        print(f"q8_0 / f16 warm TTFT (medians): {m['q8_0'] / m['f16']:.3f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
