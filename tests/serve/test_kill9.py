"""`localkv serve` with a disk cache, killed with SIGKILL at random moments under concurrent
load, then started again: every entry on disk is whole, no entry that could be corrupt is used
(answers from the disk cache are the answers computed cold), the killed writers' temp files are
swept, and the server answers."""

import os
import random
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from serve_process import COMPLETIONS, ServeProcess, temp_files

from localkv.kv import disk_entry as entry
from localkv.kv import disk_files
from tiny_model import write_gguf

RNG = np.random.default_rng(9)
PREFIXES = [RNG.integers(3, 261, 48).tolist() for _ in range(4)]  # three full blocks each, shared by the load
CHECKED = [p + RNG.integers(3, 261, 20).tolist() for p in PREFIXES]  # answered cold first, from disk at the end
# kills in a suite run; the reliability target (20 kills, 20 healthy restarts) runs with
# LOCALKV_TEST_KILLS=20 python -m pytest tests/serve/test_kill9.py
KILLS = int(os.environ.get("LOCALKV_TEST_KILLS", "4"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("kill9") / "tiny.gguf", ctx=2048)


def answer(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + COMPLETIONS, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def load(url: str, stop: threading.Event, seed: int):
    """Requests, streamed and whole, over the shared prefixes, until the server dies."""
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = rng.choice(PREFIXES)[: rng.choice((16, 32, 48))] + [rng.randrange(3, 261) for _ in range(20)]
        body = {"prompt": prompt, "max_tokens": rng.randrange(4, 40), "stream": rng.random() < 0.5}
        try:
            with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=60) as r:
                for _ in r.iter_bytes():
                    pass
        except httpx.TransportError:  # killed under us
            return


def assert_every_entry_is_whole(home):
    files = list((home / "kvcache").rglob("*.kvb"))
    for p in files:
        assert entry.decode(p.read_bytes()) is not None, p  # Damaged: a torn or corrupt entry on disk
    return files


@pytest.mark.slow
def test_kill_9_under_load_then_restart(tiny, tmp_path):
    rnd = random.Random(4)
    server = ServeProcess(tiny, tmp_path).wait_ready()
    try:
        cold = [answer(server.url, p)["choices"][0]["text"] for p in CHECKED]
    finally:
        server.kill()
    for kill in range(KILLS):
        server = ServeProcess(tiny, tmp_path).wait_ready()
        stop = threading.Event()
        threads = [threading.Thread(target=load, args=(server.url, stop, 10 * kill + i)) for i in range(6)]
        try:
            for t in threads:
                t.start()
            time.sleep(rnd.uniform(0.2, 1.5))  # a random moment under load, not a timing check
            server.proc.send_signal(signal.SIGKILL)
            assert server.proc.wait(30) == -signal.SIGKILL
        finally:
            stop.set()
            server.kill()
            for t in threads:
                t.join(60)
        files = assert_every_entry_is_whole(tmp_path)
    if not temp_files(tmp_path):  # no kill landed inside a write this time: leave what one would
        name = f"{disk_files.TMP_PREFIX}{disk_files.HOST}-{server.proc.pid}-{files[0].stem}-x.tmp"
        (files[0].parent / name).write_bytes(b"half a block")
    server = ServeProcess(tiny, tmp_path).wait_ready()
    try:
        warm = [answer(server.url, p) for p in CHECKED]
        assert [w["choices"][0]["text"] for w in warm] == cold, "an entry loaded from disk changed an answer"
        assert all(w["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48 for w in warm)
        fresh = answer(server.url, RNG.integers(3, 261, 40).tolist())  # its write sweeps the killed writers' temps
        assert fresh["usage"]["completion_tokens"] == 12
        assert temp_files(tmp_path) == []
        assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        server.kill()
    assert len(assert_every_entry_is_whole(tmp_path)) >= 4 * 3
    assert "Traceback" not in server.stderr, server.stderr
