"""`localkv serve` stopped by SIGTERM or SIGINT, as a service manager stops it: streams in
flight end with a last event and [DONE], new requests get 503 meanwhile, the prompts' blocks
reach the disk cache, no temp file is left, exit 0; a second signal stops at once."""

import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from serve_process import COMPLETIONS, ServeProcess, final_event, read_stream, temp_files

from localkv.config import ServeOptions
from localkv.errors import LocalkvError
from localkv.kv.disk_store import DiskStore
from localkv.serve.metrics import parse
from tiny_model import write_gguf

RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("shutdown") / "tiny.gguf", ctx=8192)


def prompt() -> list[int]:
    return RNG.integers(3, 261, 40).tolist()  # two full blocks of 16 for the disk cache


def streams_in_flight(server: ServeProcess, n: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    """n streams, each past its first chunk when this returns; results[i]: events or the error."""
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    def stream(i):
        try:
            results[i] = read_stream(server.url, body | {"prompt": prompt()}, started[i])
        except Exception as e:  # a cut connection: what this test is about
            results[i] = e
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(300)
    return results, threads


def running(server: ServeProcess, n: int):
    """Wait until n requests are being computed."""
    for _ in range(3000):
        if parse(httpx.get(server.url + "/metrics", timeout=5).text).get("localkv_requests_running") == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"never {n} requests running")


def assert_refused_while_stopping(server: ServeProcess):
    health = server.wait_status("stopping")
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    late = httpx.post(server.url + COMPLETIONS, json={"prompt": "late", "max_tokens": 2}, timeout=60)
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    assert late.json()["error"]["code"] == "server_shutting_down"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_lets_the_streams_in_flight_finish_and_exits_0(tiny, tmp_path, sig):
    server = ServeProcess(tiny, tmp_path, "--shutdown-timeout", "300").wait_ready()
    try:
        results, threads = streams_in_flight(server, 4, max_tokens=300)
        server.proc.send_signal(sig)
        assert_refused_while_stopping(server)
        for t in threads:
            t.join(300)
        assert [final_event(r) for r in results] == [{"finish_reason": "length"}] * 4, results
        assert server.proc.wait(60) == 0, server.stderr
    finally:
        server.kill()
    assert "stopped" in server.stderr and "Traceback" not in server.stderr
    assert DiskStore(tmp_path / "kvcache").stats()["entries"] >= 4 * 2, "each prompt's full blocks are on disk"
    assert temp_files(tmp_path) == []


def test_past_the_shutdown_timeout_each_request_ends_with_an_error(tiny, tmp_path):
    server = ServeProcess(tiny, tmp_path, "--shutdown-timeout", "0.5").wait_ready()
    whole = {}
    try:
        results, threads = streams_in_flight(server, 3, max_tokens=8000)
        body = {"prompt": prompt(), "max_tokens": 8000, "ignore_eos": True}
        asker = threading.Thread(
            target=lambda: whole.update(r=httpx.post(server.url + COMPLETIONS, json=body, timeout=300))
        )
        asker.start()
        running(server, 4)
        server.proc.send_signal(signal.SIGTERM)
        for t in [*threads, asker]:
            t.join(300)
        assert server.proc.wait(60) == 0, server.stderr
    finally:
        server.kill()
    for r in results:
        assert final_event(r)["error"]["code"] == "server_shutting_down", r[-3:]
    assert whole["r"].status_code == 503 and whole["r"].headers["retry-after"] == "1", whole["r"].text
    assert whole["r"].json()["error"] == {
        "message": "the server is shutting down",
        "type": "server_error",
        "param": None,
        "code": "server_shutting_down",
    }
    assert "ended with an error" in server.stderr
    assert temp_files(tmp_path) == []


def test_a_second_signal_stops_at_once(tiny, tmp_path):
    server = ServeProcess(tiny, tmp_path, "--shutdown-timeout", "300").wait_ready()
    try:
        results, threads = streams_in_flight(server, 1, max_tokens=8000)
        server.proc.send_signal(signal.SIGTERM)
        server.wait_status("stopping")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 128 + signal.SIGTERM
        for t in threads:
            t.join(60)
    finally:
        server.kill()
    assert "stopped at once" in server.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "1e9"])
def test_a_bad_shutdown_timeout_is_one_clear_error(tiny, value):
    with pytest.raises(LocalkvError, match="invalid --shutdown-timeout"):
        ServeOptions(shutdown_timeout=float(value)).validate()
    cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(tiny), "--port", "0", "--shutdown-timeout", value]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().startswith("error: invalid --shutdown-timeout "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
