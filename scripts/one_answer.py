"""The one-answer check on a real model (issue 30's experiment), each part in new processes:

- cold vs warm: N prompts (GPL-3.0 excerpts to summarize, short questions), greedy, each run
  with `--no-cache`, then once to fill the disk cache, then again from it: how many give the
  same text all three times;
- the server: 8 story prompts after one shared system prompt, temperature 0, sent one at a time
  and then all together to a fresh `localkv serve`: how many answers are the same.

    python scripts/one_answer.py [-m MODEL] [--prompts 20] [-n 32]

Exit status 0 when every answer agrees, 1 when not.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

import httpx

from localkv.bench.serve_load import localkv_server
from localkv.bench.text import TEXT
from localkv.hub.resolve import resolve_model

QUESTIONS = [
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three uses of a paged KV cache.",
    "Explain what a block table is, briefly.",
    "Write two lines about winter.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "Translate 'good morning' into French and Spanish.",
    "What does a compiler do?",
]
STORIES = ["a lighthouse", "a lost key", "a robot cook", "the last train", "a paper boat", "an old map",
           "a quiet library", "a red kite"]  # fmt: skip
SYSTEM = "You are a storyteller. Every answer is a short story of a few sentences, told simply. " * 8


def prompts(n: int) -> list[str]:
    text = TEXT.read_text()
    excerpts = [f"Summarize in one sentence: {text[i * 900 : i * 900 + 900]}" for i in range(n)]
    both = [p for pair in zip(QUESTIONS, excerpts) for p in pair] + excerpts[len(QUESTIONS) :]
    return both[:n]


def run(model: str, home: str, prompt: str, n: int, *flags: str) -> str:
    cmd = [sys.executable, "-m", "localkv", "run", prompt, "-m", model, "-t", "0", "-n", str(n), "--no-save", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ | {"LOCALKV_HOME": home})
    if r.returncode != 0:
        sys.exit(f"localkv run failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout


def cold_warm(model: str, n_prompts: int, n: int) -> int:
    same = 0
    with tempfile.TemporaryDirectory() as home:
        for p in prompts(n_prompts):
            cold = run(model, home, p, n, "--no-cache")
            fill, warm = run(model, home, p, n), run(model, home, p, n)
            same += cold == fill == warm
    return same


async def answers(url: str, n: int, together: bool) -> list[str]:
    async def one(client, story):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"A story of {story}."}]
        body = {"messages": messages, "temperature": 0, "max_tokens": n}
        r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    async with httpx.AsyncClient() as client:
        if together:
            return list(await asyncio.gather(*(one(client, s) for s in STORIES)))
        return [await one(client, s) for s in STORIES]


def served(model: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as home:
        server = localkv_server(model, threads=2, kv_mem="256MiB", home=home).wait_ready()
        try:
            url = server.url
            alone = asyncio.run(answers(url, n, together=False))
            together = asyncio.run(answers(url, n, together=True))
        finally:
            server.stop()
    return sum(a == b for a, b in zip(alone, together))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=32, help="tokens per answer")
    a = ap.parse_args(argv)
    model = str(resolve_model(a.model, progress=True))
    warm = cold_warm(model, a.prompts, a.n)
    print(f"cold vs warm disk cache, new processes: {warm}/{a.prompts} identical")
    server = served(model, a.n)
    print(f"server, {len(STORIES)} requests alone vs together: {server}/{len(STORIES)} identical")
    return 0 if warm == a.prompts and server == len(STORIES) else 1


if __name__ == "__main__":
    sys.exit(main())
