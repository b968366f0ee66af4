"""Hub files other tools already downloaded: the Hugging Face cache (HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub) is looked up with huggingface_hub's own reader, so a
GGUF that huggingface_hub, transformers or llama.cpp's -hf put there is used in place, read only,
and never downloaded again. HF_HUB_OFFLINE=1 means: only files already on this machine."""

import os
from pathlib import Path

from localkv.hub.hf_ref import HfRef

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
