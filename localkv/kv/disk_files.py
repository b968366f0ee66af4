"""The cache's files on disk: folders that are never symlinks, writes that land whole (a temp
file in the same folder, renamed into place), which temp files a writer that died left, and
the files named like entries (scan).

A temp file's name carries its writer's host and pid: one left by a writer that was killed is
swept by the next process that writes, not only once it is STALE_AGE old.
"""

import contextlib
import os
import re
import socket
import stat
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from localkv.home import private_dir

TMP_PREFIX = ".lkv-"  # our temp files: distinct enough that foreign dotfiles are never swept
TMP = re.compile(re.escape(TMP_PREFIX) + r"[^/]*\.tmp")
HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"  # a pid names a process on its own host only
_OWNER = re.compile(re.escape(TMP_PREFIX) + r"([0-9a-f]{8})-(\d+)-")
NS = re.compile(r"[0-9A-Za-z_-]{1,16}")  # a model's folder
SUB = re.compile(r"[0-9a-f]{2}")  # the first two hex digits of the entries' hashes
ENTRY = re.compile(r"[0-9a-f]{32}\.kvb")


@dataclass(slots=True)
class Entry:
    path: Path
    size: int
    mtime: float


def scan(root: Path, temps: list | None = None) -> list[Entry]:
    """Files named like entries under root (content unchecked); temp files go to temps if
    given. Folders may vanish meanwhile: another process may be clearing."""
    out = []
    for d in dirs(root, NS):
        for sub in dirs(d, SUB):
            out += scan_dir(sub, temps)
    return out


def scan_dir(sub: Path, temps: list | None = None) -> list[Entry]:
    out = []
    with contextlib.suppress(OSError), os.scandir(sub) as it:
        for f in it:
            if ENTRY.fullmatch(f.name) and f.name.startswith(sub.name):
                with contextlib.suppress(OSError):
                    st = f.stat(follow_symlinks=False)
                    out.append(Entry(Path(f.path), st.st_size, st.st_mtime))
            elif temps is not None and TMP.fullmatch(f.name):
                temps.append(Path(f.path))
    return out


def dirs(parent: Path, pattern) -> list[Path]:
    """parent's folders (never symlinks) whose names match pattern."""
    with contextlib.suppress(OSError), os.scandir(parent) as it:
        return [Path(e.path) for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    return []


def real_dirs(path: Path | str) -> bool:
    """The entry's two folders are folders, not symlinks that could lead out of the cache."""
    sub = os.path.dirname(path)
    try:
        return all(stat.S_ISDIR(os.lstat(d).st_mode) for d in (os.path.dirname(sub), sub))
    except OSError:
        return False


def orphan(name: str) -> bool:
    """A temp file whose writer, named in it, was a process of this host that no longer runs."""
    m = _OWNER.match(name)
    if m is None or m[1] != HOST or os.name != "posix" or int(m[2]) == os.getpid():
        return False  # (on Windows os.kill(pid, 0) would end the process)
    try:
        os.kill(int(m[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    return False


def unlink(path: Path) -> bool:
    """True if the file is gone now: removed by us or already by another process."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def make_dirs(root: Path, path: Path):
    """The entry's folders, 0700; a symlink or a file where one belongs is removed first, so
    no write lands outside the cache."""
    private_dir(root)
    for d in (path.parent.parent, path.parent):
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                os.unlink(d)
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
    if not real_dirs(path):
        raise OSError(f"{path.parent} is not a folder")


def write_atomic(path: Path, chunks, keep_existing=False) -> bool:
    """Write chunks to path through a temp file renamed into place; False (nothing written) when
    keep_existing and another process wrote path meanwhile. OSError when it cannot."""
    prefix = f"{TMP_PREFIX}{HOST}-{os.getpid()}-{path.stem}-"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
        # no fsync: after a power loss the checksum turns a torn file into a miss
        if keep_existing and os.path.lexists(path):
            return False  # another process wrote the same block meanwhile
        os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
