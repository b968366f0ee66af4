"""What a model file is, read from its GGUF header alone (no weights loaded): `localkv show`."""

import json
from collections import Counter
from pathlib import Path

from gguf.constants import LlamaFileType

from localkv.errors import ModelError
from localkv.hub.catalog import DEFAULT_MODEL, CatalogEntry, entry_for, find
from localkv.hub.hf_cache import cached
from localkv.hub.hf_ref import HfRef, is_hf
from localkv.hub.ollama_store import find as find_ollama
from localkv.hub.ollama_store import is_ollama
from localkv.model.gguf import open_gguf

# llama.cpp's token roles, as GGUF metadata names them
ROLES = ("bos", "eos", "eot", "eom", "unknown", "padding", "sep")
CONTROL = 3  # tokenizer.ggml.token_type of control tokens


def locate(spec: str | None) -> tuple[Path | None, CatalogEntry | None]:
    """The file a model spec names (None when a catalog model is not pulled yet) and its catalog
    entry; a ModelError for anything else. Never downloads."""
    e = find(spec if spec is not None else DEFAULT_MODEL)
    if e is not None:
        return e.local, e
    if is_ollama(spec):  # read in place, never pulled by localkv
        return find_ollama(spec).path, None
    if is_hf(spec):  # a hub file the catalog does not name: only once pulled (or in the HF cache)
        ref = HfRef.parse(spec)
        if (found := ref.path if ref.path.is_file() else cached(ref)) is None:
            raise ModelError(f"{ref.spec} is not pulled: run `localkv pull {ref.spec}`")
        return found, None
    p = Path(spec).expanduser()
    if not p.exists():
        raise ModelError(f"unknown model '{spec}': not a catalog name (see `localkv models`) nor a file")
    return p, entry_for(p)


def describe(spec: str | None) -> dict:
    """Architecture, size, context, chat template, special tokens, license and the catalog's
    sampling defaults of a model, as plain values."""
    if is_ollama(spec):
        return _ollama(spec)
    path, e = locate(spec)
    out: dict = {"name": e.name if e else (path.name if path else spec), "path": str(path) if path else None}
    if path is None:
        out |= {"pulled": False, "architecture": e.architecture, "parameters": e.params, "quantization": e.quant}
        out |= {"file_size": e.size, "context_length": e.context, "license": e.license}
    elif path.is_dir():
        out |= _hf_dir(path)
    else:
        out |= _gguf(path)
    if e is not None:
        out["description"] = e.description
        out["license"] = out.get("license") or e.license
    out["sampling_defaults"] = dict(e.sampling) if e else {}
    return out


def _ollama(spec: str) -> dict:
    """A model in Ollama's store: its GGUF blob, and what its manifest adds (Ollama's Go
    template and parameters: localkv runs the GGUF's Jinja template and its own sampling)."""
    m = find_ollama(spec)
    out = {"name": m.ref.spec, "path": str(m.path)} | _gguf(m.path)
    if not out.get("license") and m.license.strip():
        out["license"] = m.license.strip().splitlines()[0]
    out["ollama"] = {"digest": m.digest, "template": m.template, "parameters": m.parameters, "system": m.system}
    out["sampling_defaults"] = {}
    return out


def _gguf(path: Path) -> dict:
    with open_gguf(path) as g:
        m = g.meta
        arch = str(m.get("general.architecture", "?"))
        tokens = m.get("tokenizer.ggml.tokens") or []
        types = m.get("tokenizer.ggml.token_type")
        specials = {}
        for role in ROLES:
            i = m.get(f"tokenizer.ggml.{role}_token_id")
            if isinstance(i, int) and 0 <= i < len(tokens):
                specials[role] = {"id": i, "text": tokens[i]}
        return {
            "pulled": True,
            "format": f"GGUF v{g.version}",
            "architecture": arch,
            "model_name": m.get("general.name"),
            "parameters": sum(_count(t.shape) for t in g.tensors.values()),
            "quantization": _quant(m.get("general.file_type"), g),
            "file_size": g.file_size,
            "context_length": m.get(f"{arch}.context_length"),
            "embedding_length": m.get(f"{arch}.embedding_length"),
            "layers": m.get(f"{arch}.block_count"),
            "heads": m.get(f"{arch}.attention.head_count"),
            "kv_heads": m.get(f"{arch}.attention.head_count_kv"),
            "vocab_size": len(tokens),
            "tokenizer": m.get("tokenizer.ggml.model"),
            "special_tokens": specials,
            "control_tokens": int((types == CONTROL).sum()) if types is not None else 0,
            "chat_template": m.get("tokenizer.chat_template"),
            "license": m.get("general.license"),
        }


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _quant(file_type, g) -> str:
    """llama.cpp's file type name (MOSTLY_Q4_1 -> Q4_1), else the most common matrix type."""
    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        counts = Counter(t.qtype for t in g.tensors.values() if len(t.shape) > 1)
        return counts.most_common(1)[0][0] if counts else "?"


def _hf_dir(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"'{path}' is not a model: no readable config.json ({e})") from None
    files = list(path.glob("*.safetensors"))
    return {
        "pulled": True,
        "format": "Hugging Face directory",
        "architecture": (cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        "quantization": str(cfg.get("torch_dtype", "?")),
        "file_size": sum(f.stat().st_size for f in files),
        "context_length": cfg.get("max_position_embeddings"),
        "embedding_length": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
    }
