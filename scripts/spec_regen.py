"""A regenerated answer with and without speculation: on one engine per mode, a greedy reply of
256 tokens, then the same request three times more (what `/regen` or another client's identical
request does); prints the first reply's and the repeats' decode t/s (median) per mode, and the
repeats' ratio. With prompt lookup the repeats draft from the engine's shared n-gram pool.

    python scripts/spec_regen.py [-m MODEL] [-n 256] [-t THREADS]
"""

import argparse
import statistics

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper."


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
    again = {}
    for mode in ("off", "ngram"):
        opts = {"model": a.model} if a.model else {}
        eng = Engine(EngineConfig(threads=a.threads, spec=mode, prefix_cache=False, **opts))
        tok = eng.tokenizer
        prompt = tok.encode(tok.render_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
        Generation(eng, prompt, SamplingParams(temperature=0, max_tokens=4)).run()  # kernels loaded
        first = Generation(eng, prompt, params).run()
        repeats = [Generation(eng, prompt, params).run() for _ in range(3)]
        if any(r.tokens != first.tokens for r in repeats):
            raise SystemExit(f"--spec {mode}: a repeat's text differs")
        again[mode] = statistics.median(r.timings()["eval_tps"] for r in repeats)
        s = repeats[0].speculation()
        print(
            f"--spec {mode}: first {first.timings()['eval_tps']:.1f} t/s, repeats {again[mode]:.1f} t/s "
            f"({s['tokens_per_pass']:.2f} tokens a pass)"
        )
    print(f"repeats, ngram vs off: {again['ngram'] / again['off']:.2f}x")


if __name__ == "__main__":
    main()
