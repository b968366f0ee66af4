"""Hub files other tools already downloaded: the Hugging Face cache (HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub) is looked up with huggingface_hub's own reader, so a
GGUF that huggingface_hub, transformers or llama.cpp's -hf put there is used in place and never
downloaded again; localkv's own pulls (hf.py) land there too, and `models` and `rm`
see them there. HF_HUB_OFFLINE=1 means: only files already on this machine."""

import os
from pathlib import Path

from localkv.errors import ModelError
from localkv.hub.hf_ref import MAIN, HfRef

FALSE = ("", "0", "false", "no", "off")


def cache_dir() -> Path:
    """huggingface_hub's rule, read at each call (its constants are fixed when it is imported)."""
    if hub := os.environ.get("HF_HUB_CACHE"):
        return Path(hub).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in FALSE


def cached(ref: HfRef, sha256: str | None = None) -> Path | None:
    """ref's file in the Hugging Face cache, or None. With sha256 (a catalog pin), only a copy
    whose blob has that name: the cache names an LFS file's blob by its sha256."""
    from huggingface_hub import try_to_load_from_cache  # loads only when a hub file is asked for

    try:
        found = try_to_load_from_cache(f"{ref.owner}/{ref.repo}", ref.file, cache_dir(), ref.revision)
    except (ValueError, OSError):  # a name huggingface_hub refuses, an unreadable cache
        return None
    if not isinstance(found, str) or not Path(found).is_file():
        return None
    if sha256 and Path(found).resolve().name != sha256.lower():
        return None
    return Path(found)


def holds(path: Path) -> bool:
    """Whether path (a snapshot link, not followed) lies in the Hugging Face cache."""
    root, folder = cache_dir().resolve(), Path(path).absolute().parent.resolve()
    return folder == root or root in folder.parents


def remove(link: Path):
    """A cached file gone: its snapshot link, and its blob unless another snapshot links to it
    (huggingface_hub shares one blob between every revision that has the same file)."""
    link = Path(link).absolute()
    blob = link.resolve()
    repo = next((p for p in link.parents if p.name == "snapshots"), link.parent).parent
    link.unlink()
    others = (p for p in (repo / "snapshots").rglob("*") if p.is_symlink() and p.resolve() == blob)
    if blob != link and next(others, None) is None:
        blob.unlink(missing_ok=True)
    for folder in link.parents:  # the snapshot folders it leaves empty
        if folder == repo / "snapshots" or not folder.is_relative_to(repo):
            break
        try:
            folder.rmdir()
        except OSError:
            break


def listed() -> list[tuple[HfRef, Path]]:
    """Every GGUF in the Hugging Face cache, whoever downloaded it, by the hf: name that finds it
    again (@REVISION: a branch or tag the cache records for it, else its commit)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir())
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        owner, _, name = repo.repo_id.partition("/")
        if repo.repo_type != "model" or not name:
            continue
        for rev in repo.revisions:
            at = MAIN if MAIN in rev.refs else min(rev.refs, default=rev.commit_hash)
            for f in sorted(rev.files, key=lambda f: str(f.file_path)):
                parts = list(f.file_path.relative_to(rev.snapshot_path).parts)
                try:
                    out.append((HfRef.checked(owner, name, parts, at), f.file_path))
                except ModelError:  # not a GGUF, or a name localkv does not take
                    continue
    return out
