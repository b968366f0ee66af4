"""Several `localkv serve` nodes behind each router policy, on loopback: the multi-turn replay's
prefix hit rate over the fleet against one node alone, a node restarted with its disk tier, a
node killed for good, and a disk tier shared by every node (README "Several machines";
BENCHMARKS.md's fleet table).

    python scripts/fleet.py [-m MODEL] [--nodes 3] [--conversations 9] [--turns 4]

Each setup starts fresh nodes (each with an empty LOCALKV_HOME of its own unless shared) and
routers from the cluster extra (pip install 'localkv[cluster]').
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from localkv.bench.fleet import Node, documents, fleet, hit_rate, openings, replay
from localkv.bench.report import LoadMeter
from localkv.hub.resolve import resolve_model


def run(url: str, a, on_turn=None) -> tuple[list, float]:
    t0 = time.perf_counter()
    turns = asyncio.run(replay(url, openings(documents(a.conversations, a.words)), a.turns, a.name, a.gen, on_turn))
    return turns, time.perf_counter() - t0


def row(setup: str, turns: list, wall: float, one: float | None, note: str = "") -> str:
    rate = hit_rate(turns)
    vs = f"{rate / one:.2f}x" if one else "1.00x"
    prompt = sum(t.prompt_tokens for t in turns if t.turn >= 1)
    lost = sum(1 for t in turns if t.error)
    return f"| {setup} | {prompt:,} | {rate:.1%} | {vs} | {lost} | {wall:.1f} | {note} |"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--conversations", type=int, default=9)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--words", type=int, default=300, help="words of each conversation's document")
    p.add_argument("--gen", type=int, default=32)
    a = p.parse_args()
    model = resolve_model(a.model)
    a.name = model.stem
    meter = LoadMeter()
    print(f"{a.nodes} nodes, {a.conversations} conversations x {a.turns} turns, documents of {a.words} words")
    print("| setup | prompt tokens, turns 2.. | hit rate | vs one node | requests lost | wall s | note |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory(prefix="localkv-fleet-") as tmp:
        root = Path(tmp)
        alone = Node(model, root / "alone").start().wait()
        try:
            turns, wall = run(alone.url, a)
        finally:
            alone.stop()
        one = hit_rate(turns)
        print(row("one node alone", turns, wall, None), flush=True)
        homes = lambda tag: [root / f"{tag}{i}" for i in range(a.nodes)]  # noqa: E731
        for policy, router in (
            ("round_robin", "vllm-router"),
            ("cache_aware", "sglang-router"),
            ("kv_aware", "vllm-router"),
        ):
            with fleet(model, homes(policy), policy, a.name) as (r, _):
                turns, wall = run(r.url, a)
            print(row(f"{a.nodes} nodes, {router} {policy}", turns, wall, one), flush=True)
        with fleet(model, [root / "shared"] * a.nodes, "round_robin", a.name) as (r, _):
            turns, wall = run(r.url, a)
        print(row(f"{a.nodes} nodes, one shared disk tier, round_robin", turns, wall, one), flush=True)
        with fleet(model, homes("restart"), "kv_aware", a.name) as (r, nodes):

            def restart(t: int):
                if t == 1:
                    r.restart(nodes[0])

            turns, wall = run(r.url, a, restart)
            back = nodes[0].metric("localkv_requests_total"), nodes[0].metric("localkv_disk_hit_tokens_total")
        note = f"node 0 killed after turn 1, started again: {back[0]:.0f} requests, {back[1]:,.0f} tokens from its disk"
        print(row(f"{a.nodes} nodes, kv_aware, one restarted", turns, wall, one, note), flush=True)
        with fleet(model, homes("kill"), "kv_aware", a.name) as (r, nodes):
            turns, wall = run(r.url, a, lambda t: nodes[1].kill() if t == 2 else None)
        print(row(f"{a.nodes} nodes, kv_aware, one killed", turns, wall, one, "node 1 killed (-9) after turn 2"))
    h = meter.hardware(None)
    print(f"host: {h['cpu']}, {h['cores']} cores; load: other processes' CPU share {h['other_cpu_share']}")


if __name__ == "__main__":
    main()
