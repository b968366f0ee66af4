"""Where localkv keeps its files: LOCALKV_HOME (default ~/.cache/localkv); how its folders are
made (private), how its files are opened (regular files only, never blocking) and how the
temporaries of writers that died are swept (by age)."""

import contextlib
import errno
import os
import re
import shutil
import stat
import time
from pathlib import Path

from localkv.errors import LocalkvError

# A temporary untouched this long belongs to a writer that died: a live writer keeps writing
# to it (or, for a folder, to the files in it), which keeps its modification time recent.
STALE_AGE = 3600


def home() -> Path:
    """LOCALKV_HOME; a LocalkvError when it names a file. (When a folder above it is a file, the
    first write says so: reading an absent folder just finds nothing.)"""
    try:
        p = Path(os.environ.get("LOCALKV_HOME") or Path.home() / ".cache" / "localkv")
    except RuntimeError:  # no HOME and no passwd entry
        raise LocalkvError("cannot find the home folder: set LOCALKV_HOME to a folder") from None
    if p.exists() and not p.is_dir():
        raise LocalkvError(f"LOCALKV_HOME {p} is not a folder: point LOCALKV_HOME at a folder, or unset it")
    return p


def models_dir() -> Path:
    return home() / "models"


def private_dir(path: Path) -> Path:
    """Make path and the folders above it that are missing as 0700 (they hold prompts, replies and
    their KV); folders that exist keep their mode. OSError when it cannot."""
    missing = []
    p = Path(path)
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it meanwhile
            if not d.is_dir():
                raise
    return Path(path)


def _last_change(entry: os.DirEntry) -> float:
    """The newest modification time of a temporary: the file, or a folder and what is in it."""
    t = entry.stat(follow_symlinks=False).st_mtime
    if entry.is_dir(follow_symlinks=False):
        with os.scandir(entry.path) as it:
            t = max([t, *(e.stat(follow_symlinks=False).st_mtime for e in it)])
    return t


def sweep_stale(folder: Path, pattern: re.Pattern) -> int:
    """Remove the temporaries in folder whose names match pattern and that no one has touched for
    STALE_AGE (files, or folders with what is in them). Temporaries removed; never raises."""
    old = time.time() - STALE_AGE
    removed = 0
    with contextlib.suppress(OSError), os.scandir(folder) as it:
        for e in it:
            if not pattern.fullmatch(e.name):
                continue
            with contextlib.suppress(OSError):
                if _last_change(e) >= old:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path)
                else:
                    os.unlink(e.path)
                removed += 1
    return removed


class NotRegularFile(Exception):
    """A symlink, FIFO, socket, device or folder where localkv expects one of its files."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path, flags: int = os.O_RDONLY, follow: bool = False) -> int | None:
    """A descriptor of path if it is a regular file (made, 0600, when flags hold O_CREAT); None if
    it is absent; NotRegularFile for anything else at that name. Never blocks (opening a FIFO
    waits for a writer; O_NONBLOCK returns at once), and unless follow is set never opens a
    special file at all: lstat first, then O_NOFOLLOW, so a symlink cannot lead a read or a
    write out of localkv's folders."""
    if not follow:
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise NotRegularFile(path)
        except (FileNotFoundError, NotADirectoryError):
            if not flags & os.O_CREAT:
                return None
    try:
        fd = os.open(path, flags | _NONBLOCK | (0 if follow else _NOFOLLOW), 0o600)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, FIFO or folder (perhaps just swapped in)
            raise NotRegularFile(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(path)
    return fd
