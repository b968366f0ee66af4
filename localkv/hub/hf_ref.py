"""`hf:OWNER/REPO/FILE.gguf[@REVISION]`: a GGUF file on the Hugging Face hub. Pulls land in the
Hugging Face cache (hf_cache.py); copies that earlier localkv versions pulled into
LOCALKV_HOME/models/hf/OWNER/REPO/FILE (another revision than main: REPO@REVISION) are still used."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from localkv.errors import ModelError
from localkv.home import models_dir

PREFIX = "hf:"
ENDPOINT = "https://huggingface.co"
MAIN = "main"
# the hub's own rules for user, organisation and repository names; revisions: branches, tags, commits
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


def endpoint() -> str:
    """The hub's base URL: HF_ENDPOINT, else huggingface.co; read at each call (huggingface_hub
    reads it once, when it is imported, so localkv passes it along)."""
    return (os.environ.get("HF_ENDPOINT") or ENDPOINT).rstrip("/")


def is_hf(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class HfRef:
    owner: str
    repo: str
    file: str  # the file's path inside the repository, "/"-separated
    revision: str = MAIN

    @classmethod
    def parse(cls, spec: str) -> "HfRef":
        """hf:OWNER/REPO/FILE.gguf, with @REVISION after the file or the repository."""
        body = spec.strip()[len(PREFIX) :] if is_hf(spec) else spec.strip()
        parts = body.split("/")
        if len(parts) < 3:
            raise _bad(spec, "it names no file")
        owner, repo, rest = parts[0], parts[1], parts[2:]
        revision = MAIN
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        elif "@" in rest[-1]:
            rest[-1], revision = rest[-1].rsplit("@", 1)
        return cls.checked(owner, repo, rest, revision, spec)

    @classmethod
    def checked(cls, owner: str, repo: str, file_parts: list[str], revision: str, spec: str = "") -> "HfRef":
        spec = spec or f"{PREFIX}{owner}/{repo}/{'/'.join(file_parts)}"
        for what, value in (("owner", owner), ("repository", repo)):
            if not _NAME.fullmatch(value) or ".." in value or "--" in value:
                raise _bad(spec, f"'{value}' is not a valid {what} name")
        if not _REVISION.fullmatch(revision):
            raise _bad(spec, f"'{revision}' is not a revision (a branch, tag or commit)")
        for part in file_parts:  # no way out of the models folder, nothing the hub would not serve
            if part in ("", ".", "..") or any(c in part for c in "\\\0") or part.startswith("."):
                raise _bad(spec, f"'{'/'.join(file_parts)}' is not a file path")
        if not file_parts[-1].lower().endswith(".gguf"):
            raise _bad(spec, "localkv pulls single .gguf files from the hub")
        return cls(owner, repo, "/".join(file_parts), revision)

    @property
    def spec(self) -> str:
        at = "" if self.revision == MAIN else f"@{self.revision}"
        return f"{PREFIX}{self.owner}/{self.repo}/{self.file}{at}"

    @property
    def name(self) -> str:
        return self.file.rsplit("/", 1)[-1]

    @property
    def path(self) -> Path:
        folder = self.repo if self.revision == MAIN else f"{self.repo}@{self.revision}"
        return hf_dir().joinpath(self.owner, folder, *self.file.split("/"))

    @property
    def page(self) -> str:
        return f"{endpoint()}/{self.owner}/{self.repo}"

    @property
    def quant(self) -> str:
        """The quantization the file name says (Q4_K_M, IQ3_XS, F16, ...), else ''."""
        found = _QUANT.findall(self.name.rsplit(".", 1)[0])
        return found[-1].upper() if found else ""


def _bad(spec: str, why: str) -> ModelError:
    return ModelError(f"bad Hugging Face model '{spec}': {why}; write hf:OWNER/REPO/FILE.gguf (optionally @REVISION)")


def hf_dir() -> Path:
    return models_dir() / "hf"


def pulled() -> list[tuple[HfRef, Path]]:
    """The hub files earlier localkv versions pulled into hf_dir(): whole files only (not a .part)."""
    root = hf_dir()
    out = []
    for p in sorted(root.rglob("*.gguf")) if root.is_dir() else ():
        parts = p.relative_to(root).parts
        if len(parts) < 3 or p.is_symlink() or not p.is_file():
            continue
        repo, _, revision = parts[1].partition("@")
        try:
            out.append((HfRef.checked(parts[0], repo, list(parts[2:]), revision or MAIN), p))
        except ModelError:  # not a name localkv would have written: someone else's file
            continue
    return out
