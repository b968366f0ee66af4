"""`-m ollama:NAME[:TAG]`: a GGUF in Ollama's store (a fake one here: manifests and sha256-named
blobs, the model blob a real tiny GGUF), run in place and never written; its manifest's template
and parameters in `localkv show`; `localkv models` listing the store apart; `rm` refusing it."""

import hashlib
import io
import json
import sys
from pathlib import Path

import pytest

from localkv.cli import main
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import ModelError
from localkv.generation import Generation
from localkv.hub.ollama_store import OllamaRef, find
from localkv.sampling import SamplingParams
from localkv.serve.app import model_id
from tiny_model import write_gguf

TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ .Prompt }}"
PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.2}


def _blob(store: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_store(store: Path, gguf: Path, name="tiny", tag="q4", namespace="library") -> Path:
    """Ollama's layout: blobs/sha256-HEX, manifests/registry.ollama.ai/NAMESPACE/NAME/TAG."""
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.model"} | _blob(store, gguf.read_bytes()),
        {"mediaType": "application/vnd.ollama.image.template"} | _blob(store, TEMPLATE.encode()),
        {"mediaType": "application/vnd.ollama.image.params"} | _blob(store, json.dumps(PARAMS).encode()),
        {"mediaType": "application/vnd.ollama.image.license"} | _blob(store, b"Apache-2.0\nfull text"),
    ]
    config = {"mediaType": "application/vnd.docker.container.image.v1+json"} | _blob(store, b"{}")
    manifest = {"schemaVersion": 2, "config": config, "layers": layers}
    path = store / "manifests" / "registry.ollama.ai" / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def snapshot(store: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(store.rglob("*"))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ollama-store") / "tiny.gguf", ctx=256)


@pytest.fixture
def store(tiny, tmp_path, monkeypatch):
    root = tmp_path / "ollama-models"
    make_store(root, tiny)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_model_in_ollamas_store_runs_in_place_and_the_store_is_not_written(store, tiny):
    before = snapshot(store)
    eng = Engine(EngineConfig(model="ollama:tiny:q4", disk_cache=False, kv_mem="4MiB"))
    assert eng.path.parent == store / "blobs" and eng.path.read_bytes() == tiny.read_bytes()
    got = Generation(eng, list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4)).run()
    ref = Engine(EngineConfig(model=str(tiny), disk_cache=False, kv_mem="4MiB"))
    assert got.text == Generation(ref, list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4)).run().text
    assert snapshot(store) == before


def test_show_gives_the_manifests_template_and_parameters(store, capsys):
    rc, out, err = cli(capsys, "show", "ollama:tiny:q4", "--json")
    info = json.loads(out)
    assert (rc, err) == (0, "") and info["name"] == "ollama:tiny:q4" and info["architecture"] == "llama"
    assert info["ollama"]["template"] == TEMPLATE and info["ollama"]["parameters"] == PARAMS
    assert info["license"] == "Apache-2.0" and "im_start" in info["chat_template"]  # the GGUF's own, run by localkv
    rc, out, _ = cli(capsys, "show", "ollama:tiny:q4")
    assert rc == 0 and "Ollama parameters" in out and '"<|im_end|>"' in out and "{{ .Prompt }}" in out


def test_models_lists_ollamas_store_apart(store, tiny, capsys):
    make_store(store, tiny, name="other", namespace="me")
    rc, out, _ = cli(capsys, "models")
    mine, _, theirs = out.partition(f"in Ollama's store ({store}, read only)")
    assert rc == 0 and "ollama:" not in mine and "ollama:tiny:q4" in theirs and "ollama:me/other:q4" in theirs
    rows = json.loads(cli(capsys, "models", "--json")[1])
    assert {r["name"] for r in rows if r.get("store") == "ollama"} == {"ollama:tiny:q4", "ollama:me/other:q4"}


def test_rm_leaves_ollamas_store_alone(store, capsys, monkeypatch):
    before = snapshot(store)
    monkeypatch.setattr(sys, "stdin", None)
    rc, out, err = cli(capsys, "rm", "ollama:tiny:q4", "-y")
    assert rc == 1 and "ollama rm" in err and len(err.splitlines()) == 1
    assert snapshot(store) == before


def test_what_is_missing_is_one_clear_line(store, tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, _, err = cli(capsys, "run", "-m", "ollama:absent", "hi")
    assert rc == 1 and "ollama pull absent:latest" in err and len(err.splitlines()) == 1, err
    manifest = json.loads((store / "manifests/registry.ollama.ai/library/tiny/q4").read_text())
    model = store / "blobs" / manifest["layers"][0]["digest"].replace(":", "-")
    model.write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="not a GGUF"):
        find("ollama:tiny:q4")
    model.unlink()
    with pytest.raises(ModelError, match="missing"):
        find("ollama:tiny:q4")
    for bad in ("ollama:../../etc", "ollama:a/b/c/d", "ollama:x:../y"):
        with pytest.raises(ModelError, match="bad Ollama model"):
            OllamaRef.parse(bad)


def test_names_as_ollama_writes_them():
    assert OllamaRef.parse("ollama:smollm2").short == "smollm2:latest"
    assert OllamaRef.parse("ollama:me/m:q4").manifest(Path("/s")) == Path("/s/manifests/registry.ollama.ai/me/m/q4")
    assert OllamaRef.parse("ollama:h.io/me/m").short == "h.io/me/m:latest"
    assert model_id("ollama:smollm2:135m") == "smollm2:135m"  # what the server's APIs call it
