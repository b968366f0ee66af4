"""Several `localkv serve` nodes behind a router, measured as a client sees them: the
multi-turn replay (conversations that each open with a document of their own, every turn sent
with the whole history), its prefix hit rate over the fleet, and the nodes and routers as child
processes (scripts/fleet.py, the fleet tests, `localkv bench serve --url`).

The hit rate is cached prompt tokens over prompt tokens, summed over turns 2..T, from each
answer's usage (prompt_tokens_details.cached_tokens): what the nodes actually reused, however the
router chose. Turn 1 is a cold document everywhere, so it is left out.
"""

import asyncio
import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from localkv.bench.serve_load import ServerProcess, free_port
from localkv.bench.text import TEXT
from localkv.errors import LocalkvError
from localkv.serve.metrics import parse

QUESTIONS = [
    "Summarize the part of the document about {topic} in two sentences.",
    "What does the document say a recipient may do with {topic}?",
    "Quote the sentence that matters most about {topic}.",
    "Is anything about {topic} left unsaid? Answer briefly.",
]
TOPICS = ["source code", "patents", "warranty", "distribution", "modification", "licensing", "liability", "notices"]


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


def documents(n: int, words: int) -> list[str]:
    """n distinct stretches of the GPL text, words words each (a conversation's opening)."""
    text = TEXT.read_text().split()
    step = max(1, (len(text) - words) // max(1, n))
    return [" ".join(text[i * step : i * step + words]) for i in range(n)]


def openings(docs: list[str]) -> list[list[dict]]:
    return [[{"role": "system", "content": f"Answer from this document only.\n\n{d}"}] for d in docs]


async def _ask(client: httpx.AsyncClient, url: str, model: str | None, history: list[dict], out: Turn, gen: int):
    body = {"messages": history, "max_tokens": gen, "temperature": 0} | ({"model": model} if model else {})
    try:
        r = await client.post(url + "/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            out.error = f"{r.status_code}: {str(data)[:200]}"
            return
        usage = data["usage"]
        out.prompt_tokens = usage["prompt_tokens"]
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"


async def replay(
    url: str,
    histories: list[list[dict]],
    turns: int,
    model: str | None = None,
    gen: int = 16,
    on_turn=None,
    at_once: bool = True,
):
    """Send turn t of every conversation at once, then turn t + 1 with the answers in; on_turn(t)
    runs before each turn (a test kills or restarts a node there). at_once=False: the turns after
    the first one request after another, so that a router weighs the cache alone (no node is
    busier than another); the first still spreads the conversations over the nodes by load.
    Returns every Turn."""
    done: list[Turn] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(turns):
            if on_turn is not None:
                await asyncio.to_thread(on_turn, t)
            now = []
            for c, history in enumerate(histories):
                q = QUESTIONS[t % len(QUESTIONS)].format(topic=TOPICS[(c + t) % len(TOPICS)])
                history.append({"role": "user", "content": q})
                now.append(Turn(c, t))
            asks = [_ask(client, url, model, h, out, gen) for h, out in zip(histories, now)]
            if at_once or t == 0:
                await asyncio.gather(*asks)
            else:
                for ask in asks:
                    await ask
            for h, out in zip(histories, now):
                if out.error:
                    h.pop()  # the question is asked again next turn, as a user would
            done += now
    return done


FULL = dict(conversations=9, turns=4, words=300, gen=32)
QUICK = dict(conversations=3, turns=3, words=16, gen=8)


def conversations_row(url: str, model: str | None, quick: bool) -> dict:
    """`localkv bench serve --url`'s replay row: the hit rate the server (a router: the fleet)
    gives to conversations it saw before."""
    size = QUICK if quick else FULL
    t0 = time.perf_counter()
    histories = openings(documents(size["conversations"], size["words"]))
    turns = asyncio.run(replay(url, histories, size["turns"], model, size["gen"]))
    lost = [t.error for t in turns if t.error]
    if lost:
        raise LocalkvError(f"--url {url}: {len(lost)} of the replay's requests failed: {lost[0]}")
    return {
        "load": f"{size['conversations']} conversations x {size['turns']} turns",
        "hit_rate": hit_rate(turns),
        "wall_s": time.perf_counter() - t0,
        "tokens": sum(t.prompt_tokens for t in turns),
    }


def hit_rate(turns: list[Turn], first: int = 1) -> float:
    later = [t for t in turns if t.turn >= first and t.error is None]
    total = sum(t.prompt_tokens for t in later)
    return sum(t.cached_tokens for t in later) / total if total else 0.0


# ------------------------------------------------------------------ processes


class Node:
    """`localkv serve` on a fixed port with its KV events on another (a restart keeps both, as
    a router is configured with them), its own LOCALKV_HOME unless given a shared one."""

    def __init__(self, model: Path, home: Path, kv_mem: str = "256MiB", threads: int = 1, extra: tuple = ()):
        self.port, self.events_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{self.events_port}"
        self.cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(model), "--port", str(self.port)]
        self.cmd += ["--threads", str(threads), "--kv-mem", kv_mem, "--kv-events", self.events, *extra]
        self.env = os.environ | {"LOCALKV_HOME": str(home), "LOCALKV_API_KEY": ""}
        self.proc: ServerProcess | None = None

    def start(self) -> "Node":
        self.proc = ServerProcess(self.cmd, self.url, "/health", env=self.env)
        return self

    def wait(self) -> "Node":
        self.proc.wait_ready()
        return self

    def kill(self):
        """SIGKILL: no drain, no goodbye to the router."""
        self.proc.proc.kill()
        self.proc.proc.wait()

    def stop(self):
        if self.proc is not None:
            self.proc.stop()

    def metric(self, name: str) -> float:
        """A /metrics counter, summed over its labels."""
        values = parse(httpx.get(self.url + "/metrics", timeout=30).text)
        return sum(v for key, v in values.items() if key.split("{")[0] == name)


def router_cmd(policy: str, nodes: list[Node], port: int, model: str, block_size: int) -> list[str]:
    """vllm-router for kv_aware and round_robin (fed each node's events for kv_aware),
    sglang-router for cache_aware (its own prefix tree of the request text)."""
    urls = [n.url for n in nodes]
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls", *urls]
    if policy == "cache_aware":
        return [sys.executable, "-m", "sglang_router.launch_router", *common, "--policy", policy]
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    cmd = [exe, *common, "--policy", policy, "--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "2"]
    if policy == "kv_aware":
        cmd += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
        for n in nodes:
            cmd += ["--kv-event-source", f"{n.url}={n.events}"]
    return cmd


class Router:
    def __init__(self, policy: str, nodes: list[Node], model: str, block_size: int = 16):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = router_cmd(policy, nodes, self.port, model, block_size)
        if not Path(cmd[0]).exists():
            raise LocalkvError(f"{policy} needs vllm-router: pip install 'localkv[cluster]'")
        self.proc = ServerProcess(cmd, self.url, "/health", env=os.environ | {"RUST_LOG": "warn"})

    def wait(self) -> "Router":
        self.proc.wait_ready(120)
        return self

    def wait_health(self, node: "Node", healthy: bool, within: float = 120.0):
        """Wait until the router (vllm-router: its /workers) holds node as healthy, or not."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = httpx.get(self.url + "/workers", timeout=10).json()["workers"]
                if any(w["url"] == node.url and w["is_healthy"] == healthy for w in workers):
                    return
            time.sleep(0.2)
        raise LocalkvError(f"the router did not see {node.url} {'up' if healthy else 'down'} in {within:.0f}s")

    def restart(self, node: "Node"):
        """Kill node (-9), let the router notice, start it again and wait until the router routes
        to it and has had its events (a subscriber gets the whole state at once)."""
        node.kill()
        self.wait_health(node, False)
        node.start().wait()
        self.wait_health(node, True)
        time.sleep(0.5)  # the subscription reaches the node, its snapshot the router

    def stop(self):
        self.proc.stop()


@contextlib.contextmanager
def fleet(model: Path, homes: list[Path], policy: str, name: str, kv_mem: str = "256MiB", extra: tuple = ()):
    """Nodes (one per home; the same home twice: a shared disk tier) and a router in front."""
    nodes = [Node(model, h, kv_mem, extra=extra).start() for h in homes]
    router = None
    try:
        for n in nodes:
            n.wait()
        router = Router(policy, nodes, name).wait()
        yield router, nodes
    finally:
        if router is not None:
            router.stop()
        for n in nodes:
            n.stop()
