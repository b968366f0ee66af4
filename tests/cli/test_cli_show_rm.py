"""`localkv show` (a model file's facts from its header) and `localkv rm` (the file and its disk
cache entries, after a confirmation)."""

import dataclasses
import hashlib
import io
import json
import shutil
import sys

import pytest

from localkv.cli import main
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.hub import catalog as registry
from localkv.hub.catalog import CatalogEntry
from localkv.kv.disk_store import DiskStore
from localkv.sampling import SamplingParams
from tiny_model import write_gguf


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("show") / "tiny.gguf", ctx=256)


@pytest.fixture
def pulled(tiny_file, private_home, monkeypatch):
    """The tiny model as a pulled catalog model ("tiny"), with a sidecar, and its catalog entry."""
    models = private_home / "models"
    models.mkdir(parents=True)
    path = shutil.copy(tiny_file, models / "tiny.gguf")
    data = tiny_file.read_bytes()
    e = CatalogEntry(
        name="tiny",
        file="tiny.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        package="x",
        version="0",
        member="tiny.gguf",
        description="a tiny test model",
        license="MIT",
        sampling={"temperature": 0.3, "min_p": 0.1},
    )
    (models / "tiny.gguf.sha256").write_text(f"{e.sha256}  tiny.gguf\n")
    monkeypatch.setattr(registry, "catalog", lambda: {e.name: e})
    return path, e


def cli(monkeypatch, capsys, *argv, stdin="", tty=False):
    class In(io.StringIO):
        def isatty(self):
            return tty

    monkeypatch.setattr(sys, "stdin", In(stdin))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cache_entries(path) -> int:
    """Run a prompt of 3 full blocks through the model with the disk cache on: its entries."""
    eng = Engine(EngineConfig(model=str(path), block_size=8, kv_mem="4MiB"))
    Generation(eng, list(range(3, 30)), SamplingParams(temperature=0, max_tokens=2)).run()
    return sum(
        m["entries"] for m in DiskStore().stats()["models"] if m["fingerprint"] == eng.model_config.fingerprint[:16]
    )


# ------------------------------------------------------------------ show


def test_show_json_reads_the_header(pulled, monkeypatch, capsys):
    path, _ = pulled
    rc, out, err = cli(monkeypatch, capsys, "show", "tiny", "--json")
    info = json.loads(out)
    assert (rc, err) == (0, "")
    assert info["architecture"] == "llama" and info["context_length"] == 256 and info["layers"] == 2
    assert info["parameters"] > 0 and info["quantization"] and info["file_size"] == path.stat().st_size
    assert info["special_tokens"]["eos"]["text"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["sampling_defaults"] == {"temperature": 0.3, "min_p": 0.1} and info["license"] == "MIT"


def test_show_text_and_a_catalog_model_not_pulled(pulled, monkeypatch, capsys):
    rc, out, _ = cli(monkeypatch, capsys, "show", str(pulled[0]))
    assert rc == 0 and "context length    256" in out and "temperature       0.3" in out
    pulled[0].unlink()
    rc, out, _ = cli(monkeypatch, capsys, "show", "tiny")
    assert rc == 0 and "not pulled: `localkv pull tiny`" in out


@pytest.mark.parametrize("spec,needle", [("nope", "unknown model 'nope'"), (__file__, "GGUF")])
def test_show_refuses_what_is_not_a_model_in_one_line(monkeypatch, capsys, spec, needle):
    rc, out, err = cli(monkeypatch, capsys, "show", spec)
    assert rc == 1 and out == "" and needle in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------ rm


def test_rm_removes_the_file_its_sidecar_and_only_its_cache_entries(pulled, tmp_path, monkeypatch, capsys):
    path, _ = pulled
    other = write_gguf(tmp_path / "other.gguf", seed=1)
    assert cache_entries(path) == 3 and cache_entries(other) == 3
    rc, out, err = cli(monkeypatch, capsys, "rm", "tiny", "-y")
    assert (rc, err) == (0, "") and "and 3 disk cache entries" in out
    assert not path.exists() and not path.with_name("tiny.gguf.sha256").exists()
    models = {m["fingerprint"]: m["entries"] for m in DiskStore().stats()["models"]}
    assert list(models.values()) == [3]  # the other model's entries stay


def test_rm_asks_first(pulled, monkeypatch, capsys):
    path, _ = pulled
    rc, _, err = cli(monkeypatch, capsys, "rm", "tiny", stdin="n\n", tty=True)
    assert rc == 1 and "remove " in err and path.exists()
    rc, _, _ = cli(monkeypatch, capsys, "rm", "tiny", stdin="y\n", tty=True)
    assert rc == 0 and not path.exists()


def test_rm_without_a_terminal_needs_yes(pulled, monkeypatch, capsys):
    rc, out, err = cli(monkeypatch, capsys, "rm", "tiny")
    assert rc == 1 and err == "error: stdin is not a terminal to confirm on: pass -y to remove without asking\n"
    assert pulled[0].exists()


def test_rm_outside_the_models_folder_only_by_path_and_confirmed(pulled, tmp_path, monkeypatch, capsys):
    outside = shutil.copy(pulled[0], tmp_path / "mine.gguf")
    rc, _, err = cli(monkeypatch, capsys, "rm", str(outside), stdin="y\n", tty=True)
    assert rc == 0 and "(outside " in err and not outside.exists()
    # a catalog name whose file is not in the models folder is refused
    monkeypatch.setattr(registry, "catalog", lambda: {"far": dataclasses.replace(pulled[1], name="far")})
    monkeypatch.setattr(CatalogEntry, "path", property(lambda e: tmp_path / "far" / e.file))
    far = tmp_path / "far"
    far.mkdir()
    shutil.copy(pulled[0], far / "tiny.gguf")
    rc, _, err = cli(monkeypatch, capsys, "rm", "far", "-y")
    assert rc == 1 and "is not under" in err and (far / "tiny.gguf").exists()


@pytest.mark.parametrize("what", ["text", "dir", "missing", "unpulled"])
def test_rm_refuses_what_is_not_a_gguf_model(pulled, tmp_path, monkeypatch, capsys, what):
    target = {"text": tmp_path / "notes.gguf", "dir": tmp_path / "d", "missing": tmp_path / "none.gguf"}.get(what)
    if what == "text":
        target.write_text("not a model")
    elif what == "dir":
        target.mkdir()
    elif what == "unpulled":
        pulled[0].unlink()
    rc, out, err = cli(monkeypatch, capsys, "rm", str(target) if target else "tiny", "-y")
    assert rc == 1 and out == "" and err.startswith("error: ") and len(err.splitlines()) == 1
    assert what != "text" or target.exists()
