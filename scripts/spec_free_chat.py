"""Free chat with and without speculation, as `localkv run` serves it: the first N prompts of
scripts/chat_loops.py, each answered by a `localkv run --json --seed 1` process per mode
(the model's default sampling), modes interleaved, reps times. Prints each prompt's decode t/s
(median of the reps) and the aggregate: generated tokens over decode time, per mode. The text
is the same in both modes (checked), so the ratio is the speculation's price or gain alone.

    python scripts/spec_free_chat.py [-m MODEL] [-n 128] [--prompts 10] [--reps 2] [--spec-max K]
"""

import argparse
import json
import statistics
import subprocess
import sys

from chat_loops import PROMPTS

MODES = ("off", "ngram")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=128, help="tokens per reply (default 128)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--spec-max", type=int, default=0, help="--spec-max of the ngram runs (default 0: its default)")
    a = ap.parse_args()
    model = ["-m", a.model] if a.model else []
    tps = {}
    total = {mode: [0, 0.0] for mode in MODES}
    texts = {}
    for _ in range(a.reps):
        for i, prompt in enumerate(PROMPTS[: a.prompts]):
            for mode in MODES:
                spec = ["--spec", mode, "--spec-max", str(a.spec_max)] if mode != "off" else ["--spec", mode]
                cmd = ["localkv", "run", *model, "--json", "-n", str(a.n), "--seed", "1", *spec, prompt]
                out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                tps.setdefault((i, mode), []).append(out["timings"]["eval_tps"])
                total[mode][0] += out["completion_tokens"] - 1  # the first token is the prompt's
                total[mode][1] += out["timings"]["eval_s"]
                if texts.setdefault(i, out["text"]) != out["text"]:
                    sys.exit(f"prompt {i}: the text differs between the modes")
    for i in range(a.prompts):
        off, on = statistics.median(tps[(i, "off")]), statistics.median(tps[(i, "ngram")])
        print(f"prompt {i}: off {off:.1f} t/s, ngram {on:.1f} t/s: {on / off:.2f}x")
    rate = {mode: n / s for mode, (n, s) in total.items()}
    print(f"aggregate: off {rate['off']:.1f} t/s, ngram {rate['ngram']:.1f} t/s: {rate['ngram'] / rate['off']:.3f}x")


if __name__ == "__main__":
    main()
