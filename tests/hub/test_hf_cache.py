"""Hub files already in the Hugging Face cache (what huggingface_hub, transformers or llama.cpp's
-hf downloaded into HF_HOME): run, shown and "pulled" in place with no download; a catalog pin
that the cached blob does not match is not taken; HF_HUB_OFFLINE refuses to download."""

import hashlib
import io
import json
import socket
import sys
from pathlib import Path

import pytest

from localkv.cli import main
from localkv.errors import ModelError
from localkv.hub import catalog as registry
from localkv.hub.catalog import CatalogEntry
from localkv.hub.hf_cache import cached
from localkv.hub.hf_ref import HfRef
from localkv.hub.pull import ensure_model
from tiny_model import write_gguf

SPEC = "hf:some-org/Tiny-GGUF/tiny-Q8_0.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("hf-cache") / "tiny.gguf", quant="Q8_0", ctx=64).read_bytes()


def put_in_cache(hub: Path, ref: HfRef, data: bytes) -> Path:
    """huggingface_hub's layout: blobs named by sha256, a snapshot link per commit, refs/main."""
    repo = hub / f"models--{ref.owner}--{ref.repo}"
    sha = hashlib.sha256(data).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(data)
    link = repo / "snapshots" / COMMIT / ref.file
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("../..") / "blobs" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return link


@pytest.fixture
def in_cache(tmp_path, monkeypatch, tiny_bytes):
    """The file in HF_HOME's cache, and a hub address where nothing answers: any download fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    return put_in_cache(tmp_path / "hf-home" / "hub", HfRef.parse(SPEC), tiny_bytes)


def test_a_file_in_the_hf_cache_runs_without_a_download(in_cache, capsys):
    code = main(["run", "-m", SPEC, "hello", "-n", "3", "--ignore-eos", "-t", "0", "--json", "--no-save"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["completion_tokens"] == 3
    assert not HfRef.parse(SPEC).path.exists()  # no copy of it in LOCALKV_HOME


def test_pull_and_show_find_it_in_the_cache(in_cache, capsys):
    assert main(["pull", SPEC]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(in_cache) and "in the Hugging Face cache" in out.err
    assert main(["show", SPEC, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(in_cache)


def test_hf_hub_cache_names_the_cache_itself(in_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert cached(HfRef.parse(SPEC)) is None
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    assert cached(HfRef.parse(SPEC)) == in_cache
    assert cached(HfRef.parse(SPEC.replace("tiny-", "other-"))) is None


def test_a_catalog_pin_the_cached_blob_does_not_match_is_not_taken(in_cache, tiny_bytes, monkeypatch):
    ref = HfRef.parse(SPEC)
    good = CatalogEntry(name="tinyhf", hf=ref, size=len(tiny_bytes), sha256=hashlib.sha256(tiny_bytes).hexdigest())
    assert ensure_model("tinyhf", progress=False, entry=good) == in_cache
    bad = CatalogEntry(name="tinyhf", hf=ref, size=len(tiny_bytes), sha256="0" * 64)
    monkeypatch.setattr(registry, "catalog", lambda: {bad.name: bad})
    with pytest.raises(ModelError, match="127.0.0.1"):  # it went to the (dead) hub instead
        ensure_model("tinyhf", progress=False, entry=bad)


def test_hf_hub_offline_refuses_to_download(in_cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "-m", SPEC, "hi", "-n", "1", "--no-save"]) == 0  # the cached file needs no network
    capsys.readouterr()
    assert main(["pull", SPEC.replace("tiny-", "other-")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_HUB_OFFLINE" in err[0]


def test_models_lists_it_and_rm_removes_it(in_cache, tiny_bytes, capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"name": SPEC, "size": len(tiny_bytes), "params": 0, "quant": "Q8_0", "path": str(in_cache)} in rows
    blob = in_cache.resolve()
    assert main(["rm", SPEC, "-y"]) == 0
    assert f"removed {in_cache}" in capsys.readouterr().out
    assert not in_cache.exists() and not in_cache.is_symlink() and not blob.exists()
    assert cached(HfRef.parse(SPEC)) is None
    assert main(["models", "--json"]) == 0
    assert SPEC not in [r["name"] for r in json.loads(capsys.readouterr().out)]


def test_rm_keeps_a_blob_another_revision_links_to(in_cache, capsys):
    other = "fedcba9876543210fedcba9876543210fedcba98"
    repo = in_cache.parents[2]
    link = repo / "snapshots" / other / in_cache.name
    link.parent.mkdir()
    link.symlink_to(Path("../..") / "blobs" / in_cache.resolve().name)
    (repo / "refs" / "v1").write_text(other)
    assert main(["rm", SPEC, "-y"]) == 0
    capsys.readouterr()
    assert not in_cache.is_symlink() and not in_cache.parent.exists()  # its emptied snapshot folder too
    assert cached(HfRef.parse(SPEC + "@v1")) == link and link.read_bytes().startswith(b"GGUF")
