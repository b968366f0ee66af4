"""What a --model value names: a catalog entry (pulled on first use), a hub reference, a .gguf
file or a Hugging Face style directory, resolved to a local path."""

from collections.abc import Callable
from pathlib import Path

from localkv.errors import ModelError
from localkv.hub.catalog import DEFAULT_MODEL, find, names
from localkv.hub.hf_ref import is_hf
from localkv.hub.ollama_store import find as find_ollama
from localkv.hub.ollama_store import is_ollama
from localkv.hub.pull import ensure_model


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _check_dir(p: Path) -> Path:
    missing = [n for n in ("config.json", "tokenizer.json") if not (p / n).is_file()]
    if not any(p.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"'{p}' is not a model directory: it lacks {', '.join(missing)}")
    return p


def resolve_model(spec: str | None, progress: bool = True, before_pull: Callable[[], None] | None = None) -> Path:
    """None or a catalog name/alias -> the local GGUF (pulled if missing); hf:OWNER/REPO/FILE.gguf
    -> its copy under models_dir()/hf (pulled from the hub if missing); ollama:NAME[:TAG] -> its
    blob in Ollama's store (never pulled: Ollama pulls); a .gguf path or a Hugging Face style
    directory -> itself. Catalog names win over same-named local paths. before_pull: called
    once a pull is about to start."""
    if spec is None:
        return ensure_model(DEFAULT_MODEL, progress=progress, before_pull=before_pull)
    if (e := find(spec)) is not None:
        return ensure_model(e.name, progress=progress, entry=e, before_pull=before_pull)
    if is_hf(spec):
        return ensure_model(spec, progress=progress, before_pull=before_pull)
    if is_ollama(spec):
        return find_ollama(spec).path
    p = Path(spec).expanduser()
    if p.is_dir():
        return _check_dir(p)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelError(f"'{p}' is not a model: expected a .gguf file or a model directory")
        if not _is_gguf(p):
            raise ModelError(f"'{p}' is not a GGUF file (bad magic bytes)")
        return p
    raise ModelError(f"unknown model '{spec}': not a catalog name ({names()}) nor a .gguf file or model directory")
