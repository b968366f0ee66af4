"""`ollama:NAME[:TAG]`: a model in Ollama's store, read in place and never written ($OLLAMA_MODELS,
else ~/.ollama/models). A manifest (manifests/HOST/NAMESPACE/NAME/TAG, a Docker v2 image manifest)
lists the model's layers by digest; each is a blob (blobs/sha256-HEX). The layer of media type
application/vnd.ollama.image.model is the GGUF itself; the template (a Go template: localkv runs
the GGUF's own Jinja one), parameters (JSON), system prompt and license are small text layers,
shown by `localkv show`."""

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from localkv.errors import ModelError

PREFIX = "ollama:"
HOST, NAMESPACE, TAG = "registry.ollama.ai", "library", "latest"
MEDIA = "application/vnd.ollama.image."  # + model, template, params, system, license
TEXT_MAX = 1 << 20  # bytes read of a text layer: a template or license, never a model
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # no "..", no "/": a path inside the store only
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def store_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def is_ollama(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class OllamaRef:
    name: str
    tag: str = TAG
    namespace: str = NAMESPACE
    host: str = HOST

    @classmethod
    def parse(cls, spec: str) -> "OllamaRef":
        """ollama:NAME[:TAG], NAME as Ollama writes it: name, namespace/name or host/namespace/name."""
        body = spec.strip()[len(PREFIX) :] if is_ollama(spec) else spec.strip()
        path, _, tag = body.partition(":")
        parts = path.split("/")
        if not 1 <= len(parts) <= 3 or not all(_PART.fullmatch(p) and ".." not in p for p in [*parts, tag or TAG]):
            raise ModelError(f"bad Ollama model '{spec}': write ollama:NAME[:TAG] (as `ollama list` shows it)")
        host, namespace = parts[:2] if len(parts) == 3 else (HOST, parts[0] if len(parts) == 2 else NAMESPACE)
        return cls(parts[-1], tag or TAG, namespace, host)

    @property
    def spec(self) -> str:
        return PREFIX + self.short

    @property
    def short(self) -> str:
        """The name `ollama list` shows: name:tag, with the namespace (and host) when not the default."""
        if self.host != HOST:
            return f"{self.host}/{self.namespace}/{self.name}:{self.tag}"
        if self.namespace != NAMESPACE:
            return f"{self.namespace}/{self.name}:{self.tag}"
        return f"{self.name}:{self.tag}"

    def manifest(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.name / self.tag


@dataclass(slots=True)
class OllamaModel:
    """A model found in the store: its GGUF blob and the manifest's text layers."""

    ref: OllamaRef
    path: Path  # the model layer's blob
    digest: str  # its sha256
    size: int
    template: str = ""
    system: str = ""
    license: str = ""
    parameters: dict = field(default_factory=dict)


def find(spec: str, root: Path | None = None) -> OllamaModel:
    """The model an ollama: name stands for; a ModelError naming what is missing."""
    ref = OllamaRef.parse(spec)
    root = root or store_dir()
    path = ref.manifest(root)
    if not path.is_file():
        raise ModelError(f"{ref.spec} is not in Ollama's store ({root}): `ollama pull {ref.short}` fetches it")
    return read_manifest(ref, path, root)


def read_manifest(ref: OllamaRef, path: Path, root: Path) -> OllamaModel:
    try:
        layers = json.loads(path.read_text(encoding="utf-8"))["layers"]
        by_type = {str(x["mediaType"]).removeprefix(MEDIA): str(x["digest"]) for x in layers}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{ref.spec}: its manifest {path} is not one Ollama writes ({type(e).__name__})") from None
    if "model" not in by_type:
        raise ModelError(f"{ref.spec}: its manifest {path} has no model layer ({MEDIA}model)")
    blob, digest = _blob(ref, root, by_type["model"])
    with open(blob, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{ref.spec}: its model blob {blob} is not a GGUF file")
    text = {kind: _text(ref, root, d) for kind, d in by_type.items() if kind in ("template", "system", "license")}
    params = json.loads(_text(ref, root, by_type["params"]) or "{}") if "params" in by_type else {}
    params = params if isinstance(params, dict) else {}
    return OllamaModel(ref, blob, digest, blob.stat().st_size, **text, parameters=params)


def _blob(ref: OllamaRef, root: Path, digest: str) -> tuple[Path, str]:
    m = _DIGEST.fullmatch(digest)
    if m is None:
        raise ModelError(f"{ref.spec}: its manifest names a layer {digest!r}, not a sha256 digest")
    blob = root / "blobs" / f"sha256-{m[1]}"
    if not blob.is_file():
        raise ModelError(f"{ref.spec}: the blob {blob} its manifest names is missing (`ollama pull {ref.short}`)")
    return blob, m[1]


def _text(ref: OllamaRef, root: Path, digest: str) -> str:
    blob, _ = _blob(ref, root, digest)
    with open(blob, "rb") as f:
        return f.read(TEXT_MAX).decode("utf-8", "replace")


def installed(root: Path | None = None) -> list[OllamaModel]:
    """Every model in the store whose manifest and model blob are whole (others are skipped)."""
    root = root or store_dir()
    out = []
    base = root / "manifests"
    for path in sorted(base.glob("*/*/*/*")) if base.is_dir() else ():
        host, namespace, name, tag = path.relative_to(base).parts
        try:
            ref = OllamaRef.parse(f"{host}/{namespace}/{name}:{tag}")
            out.append(read_manifest(ref, path, root))
        except ModelError:  # a pull in progress, or a model of another kind (no GGUF layer)
            continue
    return out
