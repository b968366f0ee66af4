"""Pulling GGUFs from the Hugging Face hub through huggingface_hub, against a stand-in hub on
127.0.0.1 (no network; HF_ENDPOINT points at it): an HTTP server that answers resolve URLs as
the hub does (X-Repo-Commit, a redirect to a CDN on another host name, the sha256 in
X-Linked-Etag and the size in X-Linked-Size), serves byte ranges, and fails to order. Pulls land
in the Hugging Face cache under HF_HOME."""

import errno
import hashlib
import http.server
import io
import json
import pathlib
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from localkv.cli import main
from localkv.errors import ModelError
from localkv.hub import catalog as registry
from localkv.hub import hf
from localkv.hub.catalog import CatalogEntry, list_models
from localkv.hub.hf_cache import listed
from localkv.hub.hf_ref import HfRef
from localkv.hub.pull import ensure_model, pull
from localkv.hub.resolve import resolve_model
from tiny_model import write_gguf

SPEC = "hf:test-org/Tiny-GGUF/tiny-Q8_0.gguf"
KEY = "test-org/Tiny-GGUF/tiny-Q8_0.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 1024


class Hub:
    """What the stand-in hub serves and how it misbehaves; every request is recorded."""

    def __init__(self):
        self.files: dict[str, bytes] = {}  # "OWNER/REPO/FILE" -> content
        self.sha: dict[str, str] = {}  # the sha256 announced, when not the content's own
        self.size: dict[str, int] = {}  # the size announced, when not the content's own
        self.requests: list[tuple[str, str, dict]] = []
        self.redirect = True  # resolve -> 302 to the CDN (as the hub does for LFS files)
        self.token: str | None = None  # the bearer token the resolve URL requires
        self.drops: list[int] = []  # CDN bodies to cut after this many bytes, one per GET
        self.stalls: list[int] = []  # CDN bodies to stall after this many bytes, one per GET
        self.head_delay = 0.0  # seconds before answering a resolve request
        self.ranges = True  # honour Range headers
        self.cdn_status: int | None = None  # the CDN refuses with this status
        self.port = 0

    def gets(self, prefix="/cdn/"):
        return [r for r in self.requests if r[0] == "GET" and r[1].startswith(prefix)]


class Handler(http.server.BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body: bool):
        hub = self.hub
        hub.requests.append((self.command, self.path, dict(self.headers)))
        parts = self.path.split("/")
        if self.path.startswith("/cdn/"):
            return self.serve("/".join(parts[2:]), body)
        if len(parts) < 6 or parts[3] != "resolve":
            return self.fail(404, "RepoNotFound", "Repository not found")
        time.sleep(hub.head_delay)
        if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
            code = 403 if self.headers.get("Authorization") else 401
            return self.fail(code, "GatedRepo", "Access to this model is restricted.\nLog in.")
        key = "/".join([parts[1], parts[2], *parts[5:]])
        if key not in hub.files:
            return self.fail(404, "EntryNotFound", "Entry not found")
        if not hub.redirect:
            return self.serve(key, body)
        data = hub.files[key]
        self.send_response(302)
        self.send_header("Location", f"http://localhost:{hub.port}/cdn/{key}")
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("X-Linked-Etag", f'"{self.sha256(key)}"')
        self.send_header("X-Linked-Size", str(hub.size.get(key, len(data))))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef01234567"')  # a git blob id, not the sha256
        self.send_header("Content-Length", "0")
        self.end_headers()

    def sha256(self, key: str) -> str:
        return self.hub.sha.get(key) or hashlib.sha256(self.hub.files[key]).hexdigest()

    def fail(self, code: int, kind: str, message: str):
        self.send_response(code)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("X-Error-Code", kind)
        self.send_header("X-Error-Message", message.replace("\n", " "))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def serve(self, key: str, body: bool):
        hub, data = self.hub, self.hub.files.get(key)
        if data is None:
            return self.fail(404, "EntryNotFound", "Entry not found")
        if hub.cdn_status and hub.redirect:
            return self.fail(hub.cdn_status, "", "Request has expired")
        start, rng = 0, self.headers.get("Range")
        if rng and hub.ranges:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        if not hub.redirect:  # the hub answering itself: its ETag is the sha256
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{self.sha256(key)}"')
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body:
            return
        cut = hub.drops.pop(0) if hub.drops else None
        stall = hub.stalls.pop(0) if hub.stalls else None
        try:
            if cut is not None:
                self.wfile.write(data[start : start + cut])
                self.wfile.flush()
                self.close_connection = True
                return
            if stall is not None:
                self.wfile.write(data[start : start + stall])
                self.wfile.flush()
                time.sleep(3)
                return
            self.wfile.write(data[start:])
        except OSError:  # the client gave up (a timeout test)
            pass


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("hf") / "tiny.gguf", quant="Q8_0", ctx=64).read_bytes()


@pytest.fixture
def hub(monkeypatch, tiny_bytes, tmp_path):
    h = Hub()
    h.files[KEY] = tiny_bytes
    handler = type("BoundHandler", (Handler,), {"hub": h})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    h.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{h.port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads these when it is imported; a test sets its own
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 5)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 5)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)  # a resume starts after the last whole chunk
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    yield h
    server.shutdown()
    server.server_close()


def repo_dir(tmp_path: Path) -> Path:
    return tmp_path / "hf-home" / "hub" / "models--test-org--Tiny-GGUF"


def leftovers(tmp_path: Path) -> list[str]:
    """Every file in the cache's copy of the repository but its refs: blobs, links, temporaries."""
    repo = repo_dir(tmp_path)
    return sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if not p.is_dir() and p.parts[-2] != "refs")


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ names


@pytest.mark.parametrize(
    "spec,want",
    [
        ("hf:a/b/c.gguf", ("a", "b", "c.gguf", "main")),
        ("hf:Org/Repo-GGUF/sub/dir/x-Q4_K_M.gguf", ("Org", "Repo-GGUF", "sub/dir/x-Q4_K_M.gguf", "main")),
        ("hf:a/b/c.gguf@v1.0", ("a", "b", "c.gguf", "v1.0")),
        ("HF:a/b@0123abc/c.GGUF", ("a", "b", "c.GGUF", "0123abc")),
    ],
)
def test_names_parse(spec, want):
    r = HfRef.parse(spec)
    assert (r.owner, r.repo, r.file, r.revision) == want
    assert HfRef.parse(r.spec) == r


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("hf:a/b", "names no file"),
        ("hf:a/b/c.bin", "single .gguf files"),
        ("hf:a/b/../c.gguf", "not a file path"),
        ("hf:a/b/.hidden.gguf", "not a file path"),
        ("hf:a/../c.gguf", "not a valid repository name"),
        ("hf:-a/b/c.gguf", "not a valid owner name"),
        ("hf:a/b/c.gguf@bad/rev", "single .gguf files"),
        ("hf:a/b/c.gguf@", "not a revision"),
    ],
)
def test_bad_names_are_one_line(spec, needle):
    with pytest.raises(ModelError) as e:
        HfRef.parse(spec)
    assert needle in one_line(e) and "hf:OWNER/REPO/FILE.gguf" in str(e.value)


def test_names_and_quants(private_home):
    r = HfRef.parse("hf:o/r/sub/f-Q4_K_M.gguf")
    assert r.path == private_home / "models" / "hf" / "o" / "r" / "sub" / "f-Q4_K_M.gguf"  # an older pull's place
    assert HfRef.parse("hf:o/r/f.gguf@v2").path == private_home / "models" / "hf" / "o" / "r@v2" / "f.gguf"
    assert (r.quant, HfRef.parse("hf:o/r/model.BF16.gguf").quant, HfRef.parse("hf:o/r/m.gguf").quant) == (
        "Q4_K_M",
        "BF16",
        "",
    )


# ------------------------------------------------------------------ downloads


def test_pull_lands_in_the_hf_cache_verified(hub, tiny_bytes, tmp_path):
    p = pull(SPEC, progress=False)
    sha = hashlib.sha256(tiny_bytes).hexdigest()
    assert p == repo_dir(tmp_path) / "snapshots" / COMMIT / "tiny-Q8_0.gguf" and p.read_bytes() == tiny_bytes
    assert leftovers(tmp_path) == [f"blobs/{sha}", f"snapshots/{COMMIT}/tiny-Q8_0.gguf"]  # no temporary left
    assert (repo_dir(tmp_path) / "refs" / "main").read_text() == COMMIT
    assert not HfRef.parse(SPEC).path.exists()  # nothing in LOCALKV_HOME
    methods = [(m, path.split("/")[1]) for m, path, _ in hub.requests]
    assert methods == [("HEAD", "test-org"), ("HEAD", "test-org"), ("GET", "cdn")]  # localkv's, the library's
    assert all("Range" not in h for _, _, h in hub.requests)


def test_second_pull_and_resolve_are_offline(hub):
    p = pull(SPEC, progress=False)
    hub.files.clear()  # any request now fails
    n = len(hub.requests)
    assert pull(SPEC, progress=False) == p
    assert resolve_model(SPEC, progress=False) == p and ensure_model(SPEC, progress=False) == p
    assert len(hub.requests) == n


def test_dropped_connection_resumes_with_a_range(hub, tiny_bytes):
    cut = len(tiny_bytes) // 3 // CHUNK * CHUNK
    hub.drops = [cut]
    p = pull(SPEC, progress=False)
    assert p.read_bytes() == tiny_bytes
    first, second = hub.gets()
    assert "Range" not in first[2] and second[2]["Range"] == f"bytes={cut}-"


def test_a_transfer_that_stops_moving_fails_and_leaves_nothing(hub, tiny_bytes, tmp_path, monkeypatch):
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # its pause between resumes
    hub.drops = [len(tiny_bytes) // 5] + [0] * 10  # some bytes, then every resume gets none
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith(f"the download of {SPEC} broke off (") and "pull again" in str(e.value)
    assert leftovers(tmp_path) == []  # no blob, no link, no temporary under the model's name
    assert SPEC not in [r["name"] for r in list_models()]
    assert pull(SPEC, progress=False).read_bytes() == tiny_bytes


def test_server_without_ranges_restarts_from_zero(hub, tiny_bytes):
    hub.drops = [2 * CHUNK]
    hub.ranges = False
    assert pull(SPEC, progress=False).read_bytes() == tiny_bytes
    assert hub.gets()[-1][2]["Range"] == f"bytes={2 * CHUNK}-"  # asked for a range, got the whole file


def test_404_is_one_line_and_leaves_nothing(hub, tmp_path):
    with pytest.raises(ModelError) as e:
        pull("hf:test-org/Tiny-GGUF/missing.gguf", progress=False)
    msg = one_line(e)
    assert "hf:test-org/Tiny-GGUF/missing.gguf was not found on the hub (HTTP 404: Entry not found)" in msg
    assert leftovers(tmp_path) == []


def test_wrong_checksum_deletes_the_download(hub, tiny_bytes, tmp_path):
    hub.sha[KEY] = "ab" * 32
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    msg = one_line(e)
    assert msg.startswith(f"checksum mismatch for {SPEC}: the hub says sha256 {'ab' * 32}")
    assert hashlib.sha256(tiny_bytes).hexdigest() in msg and "deleted" in msg
    assert leftovers(tmp_path) == []
    assert SPEC not in [r["name"] for r in list_models()]


def test_a_download_shorter_than_announced_is_refused(hub, tiny_bytes, tmp_path):
    hub.size[KEY] = len(tiny_bytes) + 10
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith(f"the download of {SPEC} is not the size the hub announced (")
    assert leftovers(tmp_path) == []


def test_etag_of_a_direct_answer_is_the_checksum(hub):
    hub.redirect = False  # the server answers the resolve URL itself, its ETag the sha256
    hub.sha[KEY] = "cd" * 32
    with pytest.raises(ModelError, match="checksum mismatch"):
        pull(SPEC, progress=False)
    del hub.sha[KEY]
    assert pull(SPEC, progress=False).is_file()


def test_catalog_pin_must_match_the_hub(hub, tiny_bytes, monkeypatch):
    e = CatalogEntry(name="tiny-hf", hf=HfRef.parse(SPEC), sha256="ef" * 32)
    monkeypatch.setattr(registry, "catalog", lambda: {e.name: e})
    with pytest.raises(ModelError) as ei:
        pull("tiny-hf", progress=False)
    assert "is not the file the catalog names" in one_line(ei)
    assert not hub.gets()  # refused before downloading


def test_slow_server_times_out(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.3)
    hub.head_delay = 2
    t = time.monotonic()
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert f"no answer from 127.0.0.1:{hub.port}" in one_line(e) and "within 0.3 s" in str(e.value)
    assert time.monotonic() - t < 2  # gave up at the timeout, not when the server answered


def test_stalled_transfer_times_out_and_resumes(hub, tiny_bytes, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.3)
    hub.stalls = [2 * CHUNK]
    assert pull(SPEC, progress=False).read_bytes() == tiny_bytes
    assert hub.gets()[-1][2]["Range"] == f"bytes={2 * CHUNK}-"


def test_gated_model_needs_hf_token(hub, tiny_bytes, monkeypatch):
    hub.token = "hf_secret"
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    msg = one_line(e)
    assert "needs a Hugging Face login (HTTP 401: Access to this model is restricted. Log in.)" in msg
    assert "set HF_TOKEN" in msg
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert "the hub refused HF_TOKEN" in one_line(e) and "HTTP 403" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert pull(SPEC, progress=False).read_bytes() == tiny_bytes
    ((_, _, cdn),) = hub.gets()
    assert "Authorization" not in cdn  # the token stays with the hub, never goes to the CDN


def test_cdn_refusal_is_not_blamed_on_the_token(hub):
    hub.cdn_status = 403
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith(f"localhost:{hub.port} answered HTTP 403 Forbidden for {SPEC}: Request has expired")
    assert "HF_TOKEN" not in str(e.value)


def test_progress_on_a_terminal(hub, tiny_bytes, capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bars, real = [], hf.download_bar
    monkeypatch.setattr(hf, "download_bar", lambda on: bars.append(on) or real(on))
    hub.drops = [len(tiny_bytes) // 2]
    assert pull(SPEC, progress=True).read_bytes() == tiny_bytes
    assert bars == [True]  # a rich bar drew the transfer, across the resume
    err = capsys.readouterr().err
    assert f"pulling {SPEC} (" in err and f"pulled {SPEC}: " in err


def test_unreachable_hub(hub, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith(f"cannot reach the Hugging Face hub at 127.0.0.1:{port}")


def test_not_enough_disk_space_is_refused_before_downloading(hub, monkeypatch):
    monkeypatch.setattr(hf, "_free_space", lambda folder: 1000)
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith(f"not enough disk space for {SPEC}") and "1000 B is free" in str(e.value)
    assert not hub.gets()


class FullDisk:
    """A download's temporary file on a disk with room for `room` bytes while full[0] holds."""

    def __init__(self, f, room: int, full: list):
        self.f, self.room, self.full = f, room, full

    def write(self, b):
        if self.full[0] and self.f.tell() + len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_disk_full_while_writing_is_one_line_and_leaves_nothing(hub, monkeypatch, tiny_bytes, tmp_path):
    real_open, full = pathlib.Path.open, [True]

    def open_(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return FullDisk(f, 4 * CHUNK, full) if self.name.endswith(".incomplete") and "w" in mode else f

    monkeypatch.setattr(pathlib.Path, "open", open_)
    with pytest.raises(ModelError) as e:
        pull(SPEC, progress=False)
    assert one_line(e).startswith("the disk is full writing") and "nothing was kept" in str(e.value)
    assert leftovers(tmp_path) == []
    full[0] = False  # space was freed
    assert pull(SPEC, progress=False).read_bytes() == tiny_bytes


# ------------------------------------------------------------------ catalog and command line


def test_catalog_entry_with_hub_source(hub, tiny_bytes, monkeypatch):
    e = CatalogEntry(name="tiny-hf", hf=HfRef.parse(SPEC), quant="Q8_0", params=42, aliases=["tiny-alias"])
    monkeypatch.setattr(registry, "catalog", lambda: {e.name: e})
    p = resolve_model("tiny-alias", progress=False)
    assert p.read_bytes() == tiny_bytes and p == e.local
    assert list_models() == [dict(name="tiny-hf", size=len(tiny_bytes), params=42, quant="Q8_0", path=str(p))]
    assert registry.entry_for(p) is e and registry.entry_for(SPEC) is e


@pytest.fixture
def no_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


def test_cli_pull_models_show_rm_run(hub, tiny_bytes, capsys, no_stdin, tmp_path):
    assert main(["pull", SPEC]) == 0
    out = capsys.readouterr()
    path = repo_dir(tmp_path) / "snapshots" / COMMIT / "tiny-Q8_0.gguf"
    assert out.out.strip() == str(path)
    assert f"pulled {SPEC}" in out.err
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"name": SPEC, "size": len(tiny_bytes), "params": 0, "quant": "Q8_0", "path": str(path)} in rows
    assert main(["models"]) == 0
    assert SPEC in capsys.readouterr().out
    assert [(ref.spec, p) for ref, p in listed()] == [(SPEC, path)]
    assert main(["show", SPEC, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(path)
    hub.files.clear()  # run uses the pulled copy: no hub needed
    code = main(["run", "-m", SPEC, "hello", "-n", "4", "--ignore-eos", "-t", "0", "--json", "--no-save"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["completion_tokens"] == 4
    assert main(["rm", SPEC, "-y"]) == 0
    assert f"removed {path}" in capsys.readouterr().out
    assert leftovers(tmp_path) == [] and listed() == []


def test_cli_run_pulls_on_first_use(hub, capsys, no_stdin):
    code = main(["run", "-m", SPEC, "hi", "-n", "2", "--ignore-eos", "--json", "--no-save"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["completion_tokens"] == 2 and [ref.spec for ref, _ in listed()] == [SPEC]


def test_cli_errors_are_one_line(hub, capsys, no_stdin):
    assert main(["pull", "hf:test-org/Tiny-GGUF/nope.gguf"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: hf:test-org/Tiny-GGUF/nope.gguf was not found")
    assert main(["run", "-m", "hf:test-org/Tiny-GGUF", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad Hugging Face model" in err[0]
    assert main(["show", "hf:test-org/Tiny-GGUF/other.gguf"]) == 1
    assert "is not pulled: run `localkv pull hf:test-org/Tiny-GGUF/other.gguf`" in capsys.readouterr().err


def test_real_catalog_hub_entries():
    hub_entries = [e for e in registry.catalog().values() if e.hf is not None]
    names = {e.name for e in hub_entries}
    assert {"qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-1b", "llama3.2-3b"} <= names
    assert {"qwen3-0.6b", "qwen3-1.7b", "gemma3-1b", "phi3.5-mini"} <= names
    for e in hub_entries:
        assert e.quant == e.hf.quant == "Q4_K_M", e.name
        assert e.template and e.license and e.context > 0 and e.params > 0, e.name
        assert e.path.name == e.file and Path(e.hf.file).name == e.file
        assert registry.find(e.hf.spec) is e
    spellings = [a.lower() for e in registry.catalog().values() for a in (e.name, *e.aliases)]
    assert len(spellings) == len(set(spellings))
