"""The prefix hit rate of a 10-turn chat with and without warming the next turn (next_turn.py),
for a thinking model whose template drops earlier turns' thinking: `localkv bench cache`'s
scripted chat (a thinking model thinks 32 tokens a turn) with a system prompt and reply length
of your choosing, one fresh engine per mode, the disk tier off. Prints each turn and, for turns
2-10, the hits over the prompt tokens and the lowest turn's rate.

    python scripts/thinking_turns.py -m MODEL [--system 64] [--reply 128] [-t THREADS]
"""

import argparse

from localkv.bench import cache
from localkv.config import EngineConfig
from localkv.engine import Engine


class Quiet:
    def say(self, message: str):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--system", type=int, default=64, help="system prompt tokens")
    ap.add_argument("--reply", type=int, default=128, help="answer tokens at most, after the thinking")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    for warm in (False, True):
        eng = Engine(EngineConfig(model=a.model, threads=a.threads, disk_cache=False))
        rows = cache.chat(eng, cache.system_text(eng, a.system), a.turns, a.reply, Quiet(), warm=warm)
        print(f"warm {'on' if warm else 'off'}: turn, prompt, hits, hit rate, thinking, warmed after, warm s")
        for r in rows:
            print(
                f"  {r['turn']:>2} {r['prompt_tokens']:>6} {r['hit_tokens']:>6} {r['hit_rate']:>7.1%} "
                f"{r['reasoning_tokens']:>4} {r['warmed_tokens']:>5} {r['warm_s']:.3f}"
            )
        later = rows[1:]
        hits, asked = sum(r["hit_tokens"] for r in later), sum(r["prompt_tokens"] for r in later)
        lowest = min(r["hit_rate"] for r in later)
        print(f"  turns 2-{len(rows)}: {hits}/{asked} tokens = {hits / asked:.1%}, lowest turn {lowest:.1%}")


if __name__ == "__main__":
    main()
