"""One compile per model, not per command: from an empty kernel cache, the first command on a
model fills it, and run, fork, chat (Textual's pilot, in a process of its own) and serve with one
request then start without compiling. numba writes machine code to its cache as it compiles,
so "no compile" reads as "the cache's files unchanged" (the compile line is for terminals only)."""

import os
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

CHAT = """
import asyncio, sys
from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.engine import Engine
from localkv.sampling import SamplingParams
from localkv.tui.app import ChatApp

async def main():
    app = ChatApp(Engine(EngineConfig(model=sys.argv[1])), ConversationStore(), sampling=SamplingParams(max_tokens=4))
    async with app.run_test() as pilot:
        await pilot.press(*"hi", "enter")
        for _ in range(3000):
            await pilot.pause(0.02)
            if not app.busy:
                break
    assert app.store.path(app.at)[-1].role == "assistant", "no reply"

asyncio.run(main())
"""


def machine_code(cache) -> list:
    return sorted((p.relative_to(cache), p.stat().st_mtime_ns) for p in cache.rglob("*.nb[ic]"))


def localkv(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localkv", *args], env=env, capture_output=True, text=True, **kw)


def serve_one_request(model, env: dict):
    cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(model), "--port", "0"]
    proc = subprocess.Popen(cmd, env=env | {"LOCALKV_API_KEY": ""}, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "listening on http://" in first, first
        url = first.split("listening on ")[1].split()[0]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while httpx.get(url + "/health", timeout=5).status_code != 200:  # the model loads after the port opens
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_first_command_compiles_and_no_later_command_does(real_model_path, tmp_path):
    cache = tmp_path / "kernels"
    env = os.environ | {"NUMBA_CACHE_DIR": str(cache)}
    m = str(real_model_path)
    first = localkv("run", "-m", m, "-n", "4", "--no-save", "hi", env=env)
    assert first.returncode == 0, first.stderr
    filled = machine_code(cache)
    assert filled, "the first command compiled nothing into the empty cache"

    for args in (("run", "-m", m, "-n", "4", "--no-save", "hello"), ("fork", "-m", m, "-b", "2", "-n", "4", "hi")):
        done = localkv(*args, env=env)
        assert done.returncode == 0, done.stderr
        assert machine_code(cache) == filled, f"`localkv {args[0]}` compiled"
    chat = subprocess.run([sys.executable, "-c", CHAT, m], env=env, capture_output=True, text=True)
    assert chat.returncode == 0, chat.stderr
    assert machine_code(cache) == filled, "`localkv chat` compiled"
    serve_one_request(m, env)
    assert machine_code(cache) == filled, "`localkv serve` compiled"
