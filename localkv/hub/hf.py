"""Pull a GGUF from the Hugging Face hub with huggingface_hub, into the Hugging Face cache.

One HEAD first (get_hf_file_metadata, no retries, so a dead hub fails at once rather than after
huggingface_hub's minute of backoff) tells the file's size and, for LFS files (every GGUF), its
sha256 (X-Linked-Etag): a catalog pin must equal it, and the disk must have room, before any
byte moves. hf_hub_download does the rest as every other tool does: HF_TOKEN (to the hub, never
to its CDN), HF_ENDPOINT, retries that resume with an HTTP Range within the pull, a temporary
renamed into blobs/SHA256 only when whole, the snapshot link, a lock against a second pull.
huggingface_hub names the blob by the hub's sha256 without hashing it, so localkv does: a blob
that is not what the hub (or the catalog) said is removed with its link.
"""

import contextlib
import errno
import hashlib
import logging
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

from localkv.errors import ModelError, first_line
from localkv.hub.hf_cache import cache_dir, remove
from localkv.hub.hf_ref import HfRef, endpoint
from localkv.hub.progress import download_bar, say
from localkv.units import format_size

CHUNK = 1 << 20
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_HEX = set("0123456789abcdef")


def pull(
    ref: HfRef, progress: bool = True, force: bool = False, sha256: str | None = None, size: int | None = None
) -> Path:
    """Download ref into the Hugging Face cache (force: again) and return its snapshot path.
    sha256/size: what a catalog entry pins, checked as well as the hub's own sha256."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    ep, repo_id = endpoint(), f"{ref.owner}/{ref.repo}"
    url = hf_hub_url(repo_id, ref.file, revision=ref.revision, endpoint=ep)
    try:
        meta = get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT, endpoint=ep)
    except Exception as e:  # every failure becomes one line; _error re-raises what it cannot name
        raise _error(ref, e, constants.HF_HUB_ETAG_TIMEOUT) from None
    etag = (meta.etag or "").lower()
    hub_sha = etag if len(etag) == 64 and set(etag) <= _HEX else None
    _check_pins(ref, hub_sha, meta.size, sha256, size)
    _check_space(ref, meta.size or size)
    total = f" ({format_size(meta.size)})" if meta.size else ""
    say(progress, f"pulling {ref.spec}{total} from {urlsplit(ep).netloc}")
    try:
        with _quiet():
            found = hf_hub_download(
                repo_id,
                ref.file,
                revision=ref.revision,
                cache_dir=cache_dir(),
                endpoint=ep,
                force_download=force,
                tqdm_class=download_bar(progress and sys.stderr.isatty()),
            )
    except Exception as e:
        raise _error(ref, e, constants.HF_HUB_DOWNLOAD_TIMEOUT) from None
    found = Path(found)
    _verify(ref, found, {w.lower() for w in (hub_sha, sha256) if w})
    say(progress, f"pulled {ref.spec}: {found}")
    return found


@contextlib.contextmanager
def _quiet():
    """huggingface_hub's warnings off while it downloads (each resume logs two lines): localkv
    says what happened in one line of its own."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_pins(ref: HfRef, hub_sha: str | None, hub_size: int | None, sha256: str | None, size: int | None):
    if (sha256 and hub_sha and sha256.lower() != hub_sha) or (size and hub_size and size != hub_size):
        raise ModelError(
            f"the hub's {ref.spec} is not the file the catalog names (sha256 {hub_sha}, {hub_size} bytes; the "
            f"catalog: {sha256 or '?'}, {size or '?'} bytes): the repository changed; pull it by its hf: name"
        )


def _free_space(folder: Path) -> int:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _check_space(ref: HfRef, total: int | None):
    """huggingface_hub only warns; localkv refuses before downloading what cannot fit."""
    folder = cache_dir()
    if total and total > (free := _free_space(folder)):
        raise ModelError(
            f"not enough disk space for {ref.spec}: it needs {format_size(total)}, {format_size(free)} is free "
            f"in {folder}; free some, or set HF_HOME (or HF_HUB_CACHE) to a larger disk"
        )


def _verify(ref: HfRef, found: Path, expected: set[str]):
    """A ModelError, and the blob and its link removed, unless the blob's sha256 is each of expected."""
    if not expected:
        return
    h, n = hashlib.sha256(), 0
    with open(found, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
            n += len(b)
    got = h.hexdigest()
    if any(w != got for w in expected):
        remove(found)
        raise ModelError(
            f"checksum mismatch for {ref.spec}: the hub says sha256 {', '.join(sorted(expected))}, the download "
            f"has sha256 {got} and {n} bytes; it was deleted: pull again"
        )


def _error(ref: HfRef, e: Exception, timeout: float) -> ModelError:
    """What went wrong, in one line; an exception no case names is re-raised as it is."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(e, LocalEntryNotFoundError) and isinstance(e.__cause__, Exception):
        e = e.__cause__  # the HEAD's own failure, which huggingface_hub wrapped
    if isinstance(e, HfHubHTTPError) and e.response is not None:
        return _http_error(ref, e)
    if isinstance(e, OfflineModeIsEnabled):
        return ModelError(f"{ref.spec} is not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE is set")
    if isinstance(e, httpx2.TimeoutException):
        return ModelError(
            f"no answer from {_host(e)} within {timeout:g} s: check the network, or raise HF_HUB_ETAG_TIMEOUT "
            "(the first answer) or HF_HUB_DOWNLOAD_TIMEOUT (each wait for bytes)"
        )
    if isinstance(e, httpx2.ConnectError):
        return ModelError(
            f"cannot reach the Hugging Face hub at {_host(e)} ({first_line(e)}): no network? (HF_ENDPOINT sets it)"
        )
    if isinstance(e, httpx2.TransportError):
        return ModelError(f"the download of {ref.spec} broke off ({first_line(e)}): pull again")
    if isinstance(e, OSError) and str(e).startswith("Consistency check failed"):  # huggingface_hub's size check
        return ModelError(f"the download of {ref.spec} is not the size the hub announced ({first_line(e)}): pull again")
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return ModelError(
            f"the disk is full writing {cache_dir()}: free some space and pull again, or set HF_HOME (or "
            "HF_HUB_CACHE) to a larger disk; nothing was kept"
        )
    if isinstance(e, OSError):
        return ModelError(f"cannot write {cache_dir()}: {e.strerror or e}; set HF_HOME to a writable folder")
    raise e


def _host(e: Exception) -> str:
    try:
        return e.request.url.netloc.decode()  # httpx2 errors know their request
    except (AttributeError, RuntimeError):
        return urlsplit(endpoint()).netloc


def _http_error(ref: HfRef, e) -> ModelError:
    status, resp = e.response.status_code, e.response
    hub_says = " ".join((e.server_message or "").split())[:200]  # the hub's reason, on one line
    why = f": {hub_says}" if hub_says else ""
    host = urlsplit(str(resp.url)).netloc
    if host != urlsplit(endpoint()).netloc:  # the CDN the hub sent us to (its signed link may have expired)
        return ModelError(f"{host} answered HTTP {status} {resp.reason_phrase} for {ref.spec}{why}: pull again")
    if status == 404:
        return ModelError(
            f"{ref.spec} was not found on the hub (HTTP 404{why}): check the owner, repository, file name "
            f"and revision at {ref.page}"
        )
    if status in (401, 403):
        from huggingface_hub import get_token

        if get_token():
            return ModelError(
                f"the hub refused HF_TOKEN for {ref.spec} (HTTP {status}{why}): check the token, and for a gated "
                f"model accept its terms at {ref.page}"
            )
        return ModelError(
            f"{ref.spec} needs a Hugging Face login (HTTP {status}{why}): a gated or private repository (or none "
            f"at all); accept its terms at {ref.page} and set HF_TOKEN to an access token"
        )
    if status == 429:
        return ModelError(f"the hub is rate-limiting downloads (HTTP 429): try {ref.spec} again later")
    return ModelError(f"the hub answered HTTP {status} {resp.reason_phrase} for {ref.spec}{why}: try again later")
