"""Pull a GGUF from the Hugging Face hub over plain HTTP (urllib), resumably.

A HEAD on the file's resolve URL tells its size and, for files stored in LFS (every GGUF), its
sha256: the hub's X-Linked-Etag header (huggingface_hub reads the same one). The GET follows the
hub's redirect to its CDN; HF_TOKEN goes as a bearer token to the hub's own host only. Bytes go
to FILE.part beside the target: it is kept when a transfer breaks and resumed with an HTTP Range
(within one pull, and by the next pull while the hub still serves the same file). The file gets
its name only once it is whole and its sha256 matches (an atomic rename), so a file at the
target path is always a complete one.
"""

import contextlib
import errno
import hashlib
import http.client
import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from localkv.errors import LocalkvError, ModelError, first_line
from localkv.home import NotRegularFile, open_regular, private_dir
from localkv.hub.hf_ref import HfRef, endpoint
from localkv.hub.progress import progress_bar, say
from localkv.units import format_size

try:
    import fcntl
except ImportError:  # not POSIX: no lock between two pulls of one file
    fcntl = None

TIMEOUT = 30.0  # seconds: connecting, and each wait for bytes (LOCALKV_HF_TIMEOUT)
RETRIES = 5  # resumed attempts within one pull when a transfer breaks after making progress
CHUNK = 1 << 20
MAX_REDIRECTS = 10
_REDIRECTS = (301, 302, 303, 307, 308)
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_BROKEN = (http.client.HTTPException, OSError)  # a transfer cut, reset or timed out mid-body


@dataclass(frozen=True, slots=True)
class Remote:
    """What the hub says about the file before it is downloaded."""

    size: int | None
    sha256: str | None  # from the LFS ETag; None for files outside LFS
    tag: str  # identifies this version of the file: a partial of another version is not resumed


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # followed by _open, which decides where the token may go


_OPENER = urllib.request.build_opener(_NoRedirect)


def timeout() -> float:
    text = os.environ.get("LOCALKV_HF_TIMEOUT")
    try:
        t = float(text) if text else TIMEOUT
    except ValueError:
        t = -1.0
    if not t > 0:
        raise LocalkvError(f"invalid LOCALKV_HF_TIMEOUT {text!r}: use a number of seconds, e.g. 30")
    return t


def _token() -> str | None:
    return os.environ.get("HF_TOKEN", "").strip() or None


def _open(ref: HfRef, method: str, headers: dict, cross_host: bool):
    """The response to method on ref's URL, redirects followed (only those on the hub's host
    unless cross_host), and the headers of every hop. The token goes to the hub's host only."""
    url, hops, home = ref.url, [], urlsplit(endpoint()).netloc
    for _ in range(MAX_REDIRECTS):
        h = {"User-Agent": "localkv", "Accept-Encoding": "identity", **headers}
        if (tok := _token()) and urlsplit(url).netloc == home:
            h["Authorization"] = f"Bearer {tok}"
        try:
            resp = _OPENER.open(urllib.request.Request(url, method=method, headers=h), timeout=timeout())
        except urllib.error.HTTPError as e:
            location = e.headers.get("Location")
            e.close()
            if e.code not in _REDIRECTS or not location:
                raise _http_error(ref, e, url) from None
            hops.append(e.headers)
            url = urljoin(url, location)
            if not cross_host and urlsplit(url).netloc != urlsplit(ref.url).netloc:
                return None, hops
            continue
        except (urllib.error.URLError, *_BROKEN) as e:
            raise _network_error(url, getattr(e, "reason", e)) from None
        hops.append(resp.headers)
        return resp, hops
    raise ModelError(f"the hub redirected {ref.spec} more than {MAX_REDIRECTS} times: try again later")


def _http_error(ref: HfRef, e: urllib.error.HTTPError, url: str) -> ModelError:
    hub_says = " ".join((e.headers.get("X-Error-Message") or "").split())[:200]  # the hub's reason, on one line
    why = f": {hub_says}" if hub_says else ""
    host = urlsplit(url).netloc
    if host != urlsplit(ref.url).netloc:  # the CDN the hub sent us to (its signed link may have expired)
        return ModelError(f"{host} answered HTTP {e.code} {e.reason} for {ref.spec}{why}: pull again")
    if e.code == 404:
        return ModelError(
            f"{ref.spec} was not found on the hub (HTTP 404{why}): check the owner, repository, file name "
            f"and revision at {ref.page}"
        )
    if e.code in (401, 403):
        if _token():
            return ModelError(
                f"the hub refused HF_TOKEN for {ref.spec} (HTTP {e.code}{why}): check the token, and for a gated "
                f"model accept its terms at {ref.page}"
            )
        return ModelError(
            f"{ref.spec} needs a Hugging Face login (HTTP {e.code}{why}): a gated or private repository (or none "
            f"at all); accept its terms at {ref.page} and set HF_TOKEN to an access token"
        )
    if e.code == 429:
        return ModelError(f"the hub is rate-limiting downloads (HTTP 429): try {ref.spec} again later")
    return ModelError(f"the hub answered HTTP {e.code} {e.reason} for {ref.spec}{why}: try again later")


def _network_error(url: str, reason) -> ModelError:
    host = urlsplit(url).netloc
    if isinstance(reason, TimeoutError | socket.timeout):
        return ModelError(
            f"no answer from {host} within {timeout():g} s: check the network, or raise LOCALKV_HF_TIMEOUT"
        )
    why = first_line(reason) if isinstance(reason, BaseException) else " ".join(str(reason).split())
    return ModelError(f"cannot reach the Hugging Face hub at {host} ({why}): no network? (LOCALKV_HF_ENDPOINT sets it)")


def _etag(value: str | None) -> str:
    return (value or "").strip().removeprefix("W/").strip('"').lower()


def remote(ref: HfRef) -> Remote:
    """Size and sha256 of the file, from a HEAD request (no body)."""
    resp, hops = _open(ref, "HEAD", {}, cross_host=False)
    if resp is not None:
        resp.close()
    linked = next((h for h in hops if h.get("X-Linked-Etag") or h.get("X-Linked-Size")), None)
    last = hops[-1]
    etag = _etag((linked or last).get("X-Linked-Etag") or last.get("ETag"))
    sha = etag if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag) else None
    size = _int((linked or last).get("X-Linked-Size")) or (_int(last.get("Content-Length")) if resp else None)
    return Remote(size, sha, etag or (f"size:{size}" if size else ""))


def _int(text: str | None) -> int | None:
    try:
        n = int(text) if text is not None else None
    except ValueError:
        return None
    return n if n is None or n >= 0 else None


class _Partial:
    """FILE.part, locked against a second pull of the same file, and FILE.part.json: which
    version of the file (Remote.tag) the bytes in it belong to."""

    def __init__(self, target: Path):
        self.path = target.with_name(target.name + ".part")
        self.meta = target.with_name(target.name + ".part.json")
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except NotRegularFile:
            raise ModelError(f"{self.path} is not a regular file: remove it and pull again") from None
        except OSError as e:
            raise _disk_error(self.path, e) from None
        self.f = os.fdopen(fd, "r+b")
        self.sha = hashlib.sha256()  # of the bytes in the file, kept as they are written: no second pass
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.f.close()
                raise ModelError(f"another localkv process is pulling {target.name} now: wait for it") from None

    def resume_from(self, tag: str) -> int:
        """Bytes already there of this version of the file; a partial of another one is emptied."""
        self.f.seek(0, os.SEEK_END)
        if not tag or self._kept_tag() != tag:
            self.restart()
            try:
                fd = open_regular(self.meta, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps({"tag": tag}))
            except NotRegularFile:
                raise ModelError(f"{self.meta} is not a regular file: remove it and pull again") from None
            except OSError as e:
                raise _disk_error(self.meta, e) from None
        have = self.f.tell()
        self.f.seek(0)
        while have and (b := self.f.read(min(CHUNK, have - self.f.tell()))):
            self.sha.update(b)
        return self.f.tell()

    def _kept_tag(self) -> str | None:
        """The tag FILE.part.json records; None when it is absent or unreadable (a special file too)."""
        try:
            fd = open_regular(self.meta)
            if fd is None:
                return None
            with os.fdopen(fd, encoding="utf-8") as f:
                tag = json.loads(f.read(4096)).get("tag")
            return tag if isinstance(tag, str) else None
        except (OSError, NotRegularFile, ValueError, AttributeError):
            return None

    def restart(self):
        self.f.seek(0)
        self.f.truncate()
        self.sha = hashlib.sha256()

    def write(self, b: bytes):
        try:
            self.f.write(b)
        except OSError as e:
            raise _disk_error(self.path, e) from None
        self.sha.update(b)

    def close(self):
        with contextlib.suppress(OSError):
            self.f.close()

    def discard(self):
        self.close()
        for p in (self.path, self.meta):
            with contextlib.suppress(OSError):
                p.unlink()


def _disk_error(path: Path, e: OSError) -> ModelError:
    if e.errno in _NO_SPACE:
        return ModelError(
            f"the disk is full writing {path}: free some space and pull again (the partial download is kept "
            "and resumed), or set LOCALKV_HOME to a larger disk"
        )
    return ModelError(f"cannot write {path}: {e.strerror or e}; set LOCALKV_HOME to a writable folder")


def _free_space(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def pull(
    ref: HfRef, progress: bool = True, force: bool = False, sha256: str | None = None, size: int | None = None
) -> Path:
    """Download ref into ref.path unless it is there (force: again). sha256/size: what a catalog
    entry pins, checked as well as the hub's own sha256."""
    dest = ref.path
    if dest.is_file() and not force:
        say(progress, f"{ref.spec} is already pulled: {dest}")
        return dest
    try:
        private_dir(dest.parent)
    except OSError as e:
        raise _disk_error(dest.parent, e) from None
    info = remote(ref)
    _check_pins(ref, info, sha256, size)
    part = _Partial(dest)
    try:
        have = part.resume_from(info.tag if info.size else "")
        total = info.size or size
        if total and total - have > _free_space(dest.parent):
            raise ModelError(
                f"not enough disk space for {ref.spec}: it needs {format_size(total - have)} more, "
                f"{format_size(_free_space(dest.parent))} is free in {dest.parent}; free some or set LOCALKV_HOME"
            )
        _say_start(progress, ref, total, have)
        _transfer(ref, part, total, progress)
        got = _verify(ref, part, total, {w.lower() for w in (info.sha256, sha256) if w})
        part.close()
        os.replace(part.path, dest)
        _write_sidecar(dest, got)
        part.discard()
    except BaseException:
        part.close()  # a broken transfer keeps its bytes for the next pull; _verify discards bad ones
        raise
    say(progress, f"pulled {ref.spec}: {dest}")
    return dest


def _check_pins(ref: HfRef, info: Remote, sha256: str | None, size: int | None):
    if (sha256 and info.sha256 and sha256.lower() != info.sha256) or (size and info.size and size != info.size):
        raise ModelError(
            f"the hub's {ref.spec} is not the file the catalog names (sha256 {info.sha256}, {info.size} bytes; the "
            f"catalog: {sha256 or '?'}, {size or '?'} bytes): the repository changed; pull it by its hf: name"
        )


def _say_start(progress: bool, ref: HfRef, total: int | None, have: int):
    size = f" ({format_size(total)})" if total else ""
    again = f", resuming at {format_size(have)}" if have else ""
    say(progress, f"pulling {ref.spec}{size} from {urlsplit(ref.url).netloc}{again}")


def _transfer(ref: HfRef, part: _Partial, total: int | None, progress: bool):
    """Bytes from the hub into part until it holds total (or the body ends when total is unknown);
    a broken transfer that made progress is resumed up to RETRIES times."""
    bar = progress_bar(progress and sys.stderr.isatty())
    task = bar.add_task(f"pull {ref.name}", total=total, completed=part.f.tell()) if bar else None
    if bar:
        bar.start()
    try:
        for attempt in range(RETRIES + 1):
            start = part.f.tell()
            try:
                if _fetch(ref, part, total, bar, task):
                    return
                why = "the connection closed early"
            except _BROKEN as e:
                why = first_line(e)
            got = part.f.tell()
            if got == start or attempt == RETRIES:
                have = f"{format_size(got)} of {format_size(total)}" if total else format_size(got)
                raise ModelError(
                    f"the download of {ref.spec} broke off at {have} ({why}); the partial file is kept: "
                    "pull again to resume"
                )
    finally:
        if bar:
            bar.stop()


def _fetch(ref: HfRef, part: _Partial, total: int | None, bar, task) -> bool:
    """One GET from where part ends; True once the file is complete (or the body ended)."""
    have = part.f.tell()
    if total and have >= total:
        return True
    resp, _ = _open(ref, "GET", {"Range": f"bytes={have}-"} if have else {}, cross_host=True)
    with resp:
        if have and resp.status != 206:  # the server sent the whole file: take it from the start
            part.restart()
            if bar:
                bar.update(task, completed=0)
        elif have and _range_start(resp.headers) != have:
            part.discard()
            raise ModelError(f"the hub answered a resumed download of {ref.spec} with the wrong bytes: pull again")
        length = _int(resp.headers.get("Content-Length"))
        end = part.f.tell() + length if length is not None else total
        while b := resp.read1(_room(part, total)):  # what has arrived: a stall later loses none of it
            part.write(b)
            if bar:
                bar.update(task, advance=len(b))
    done = part.f.tell()
    return done == (total or end) if (total or end) is not None else True


def _room(part: _Partial, total: int | None) -> int:
    """The most to read next: a chunk, never past the size the hub announced (0 ends the read)."""
    return CHUNK if total is None else max(0, min(CHUNK, total - part.f.tell()))


def _range_start(headers: Message) -> int | None:
    """The first byte of a 206 answer: Content-Range is `bytes START-END/TOTAL`."""
    unit, _, span = (headers.get("Content-Range") or "").partition(" ")
    return _int(span.split("-")[0]) if unit == "bytes" else None


def _verify(ref: HfRef, part: _Partial, total: int | None, expected: set[str]) -> str:
    """The sha256 of the whole partial file; a ModelError (and no partial left) unless its size
    is total and its sha256 is each of expected."""
    try:
        part.f.flush()
    except OSError as e:
        raise _disk_error(part.path, e) from None
    n, got = part.f.tell(), part.sha.hexdigest()
    if (total and n != total) or any(w != got for w in expected):
        part.discard()
        said = f"sha256 {', '.join(sorted(expected))}" if expected else "no sha256"
        raise ModelError(
            f"checksum mismatch for {ref.spec}: the hub says {said}"
            + (f" and {total} bytes" if total else "")
            + f", the download has sha256 {got} and {n} bytes; it was deleted: pull again"
        )
    return got


def _write_sidecar(dest: Path, sha: str):
    """FILE.sha256 in sha256sum format (`sha256sum -c` works), written via a rename."""
    tmp = dest.with_name(dest.name + ".sha256.part")
    with contextlib.suppress(OSError):
        tmp.write_text(f"{sha}  {dest.name}\n", encoding="utf-8")
        os.replace(tmp, dest.with_name(dest.name + ".sha256"))
