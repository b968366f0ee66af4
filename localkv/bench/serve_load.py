"""HTTP load for `localkv bench serve` and scripts/serve_robustness.py: a server in a child
process (localkv's own, or llama-cpp-python's OpenAI server), and streaming clients that time
each request's first token and the gaps between the next ones."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from localkv.bench.peer import peer_env
from localkv.errors import LocalkvError


class ServerProcess:
    """A server in a child process; its stderr is drained into a tail kept for error messages."""

    def __init__(self, cmd: list[str], url: str | None, ready_path: str, env: dict | None = None):
        self.cmd, self.url, self.ready_path = cmd, url, ready_path
        self.tail: deque[str] = deque(maxlen=40)
        self._url_seen = threading.Event()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            if self.url is None and "listening on http" in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                self._url_seen.set()

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise LocalkvError(f"the server exited ({self.proc.returncode}): {self._last()}")
            if self.url is not None:
                try:
                    if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise LocalkvError(f"the server did not become ready in {timeout:.0f}s: {self._last()}")

    def _last(self) -> str:
        lines = [x for x in self.tail if x.strip()]
        return lines[-1] if lines else " ".join(self.cmd)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def localkv_server(model: Path, threads: int, kv_mem: str, home: str, extra: tuple[str, ...] = ()) -> ServerProcess:
    """`localkv serve` on a free port, with its own LOCALKV_HOME (an empty disk cache)."""
    cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(model), "--port", "0", "--threads", str(threads)]
    cmd += ["--kv-mem", kv_mem, *extra]
    return ServerProcess(cmd, None, "/health", env=os.environ | {"LOCALKV_HOME": home, "LOCALKV_API_KEY": ""})


def free_port() -> int:
    """A free loopback port, handed over (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_server(model: Path, threads: int, n_ctx: int) -> ServerProcess:
    """llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on the same GGUF."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--verbose", "False"]
    cmd += ["--interrupt_requests", "False"]  # queue concurrent requests (its default cuts the running one off)
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", "/v1/models", env=peer_env())


@dataclass(slots=True)
class Outcome:
    """One streamed request as its client saw it."""

    status: int = 0
    start: float = 0.0  # perf_counter() when it was sent
    ttft: float = 0.0  # from sending to the first text
    total: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between successive text chunks
    chunks: int = 0
    usage: dict = field(default_factory=dict)
    finish: str = ""
    error: str = ""

    @property
    def tokens(self) -> int:
        return int(self.usage.get("completion_tokens", self.chunks))

    @property
    def cached(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    t0 = time.perf_counter()
    out, last = Outcome(start=t0), None
    async with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode("utf-8", "replace")[:300]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            if obj.get("usage"):
                out.usage = obj["usage"]
            choices = obj.get("choices") or ()
            out.finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), out.finish)
            if any(c.get("text") for c in choices):
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - t0
                else:
                    out.gaps.append(now - last)
                last, out.chunks = now, out.chunks + 1
    out.total = time.perf_counter() - t0
    return out


async def run_load(url: str, bodies: list[dict], concurrent: bool, watch=None) -> tuple[list[Outcome], float]:
    """All bodies at once (concurrent) or one after another; the outcomes and the wall time.
    watch(client) runs alongside (e.g. polling /metrics) until the load ends."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        watcher = asyncio.ensure_future(watch(client)) if watch else None
        t0 = time.perf_counter()
        if concurrent:
            outs = await asyncio.gather(*(stream_completion(client, url, b) for b in bodies))
        else:
            outs = [await stream_completion(client, url, b) for b in bodies]
        wall = time.perf_counter() - t0
        if watcher:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return list(outs), wall


def decode_tps(outs: list[Outcome]) -> float | None:
    """Tokens decoded after each request's first one, over the time any request was decoding
    (the union of the spans from a request's first token to its end): one at a time it is the
    sum of the spans, at once the spans overlap."""
    spans = sorted((o.start + o.ttft, o.start + o.total) for o in outs if o.chunks)
    busy, reach = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    tokens = sum(o.tokens - 1 for o in outs if o.chunks)
    return tokens / busy if busy > 0 else None


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None
