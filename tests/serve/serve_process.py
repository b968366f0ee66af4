"""`localkv serve` as a real process for the tests that signal or kill it: start it on a free
port, wait for the model, read a stream's events, find temp files left in the disk cache."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
COMPLETIONS = "/v1/completions"


class ServeProcess:
    """`localkv serve -m model --port 0 ...args` with LOCALKV_HOME=home; its stderr is kept."""

    def __init__(self, model, home: Path, *args: str):
        env = os.environ | {"LOCALKV_API_KEY": "", "LOCALKV_HOME": str(home), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "localkv", "serve", "-m", str(model), "--port", "0", "--kv-mem", "16MiB", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        first = self.proc.stderr.readline()
        self.lines.append(first)
        if "listening on http://" not in first:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {first}{self.proc.stderr.read()}")
        self.url = first.split("listening on ")[1].split()[0]
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 300.0):
        deadline = time.monotonic() + timeout  # a bound on the wait (the kernels may compile), not a timing check
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}: {self.stderr}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the server never became ready: {self.stderr}")

    def wait_status(self, status: str, timeout: float = 60.0) -> httpx.Response:
        """The first /health answer whose status is status (e.g. 'stopping' after a signal)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.url + "/health", timeout=5)
            if r.json().get("status") == status:
                return r
            time.sleep(0.02)
        raise AssertionError(f"/health never said {status!r}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._reader.join(10)
        self.proc.stderr.close()


def read_stream(url: str, body: dict, started: threading.Event | None = None) -> list[str]:
    """A streamed completion's `data:` payloads until the server ends it; a broken connection
    raises. started is set at the first chunk."""
    out = []
    with httpx.stream("POST", url + COMPLETIONS, json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                out.append(line.removeprefix("data: "))
                if started is not None:
                    started.set()
    return out


def final_event(events: list[str]) -> dict:
    """The stream's last event before [DONE]: a finish reason, or an error."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        return {"error": last["error"]}
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", ()) if c["finish_reason"]]
    assert reasons, events[-3:]
    return {"finish_reason": reasons[-1]}


def temp_files(home: Path) -> list[Path]:
    return list((home / "kvcache").rglob(".lkv-*.tmp"))
