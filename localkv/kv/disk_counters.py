"""The disk tier's lifetime counters (prompt tokens asked for, and found on disk): stats.json
beside the entries, updated under a file lock so that processes sharing the tier add to each
other's counts instead of overwriting them."""

import contextlib
import json
import os
from pathlib import Path

from localkv.home import NotRegularFile, open_regular
from localkv.kv.disk_entry import MAX_HEAD, Damaged, read_file
from localkv.kv.disk_files import unlink


@contextlib.contextmanager
def locked(root: Path):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): a lost update under a race is tolerable
        yield
        return
    lock = root / ".stats.lock"
    try:
        fd = open_regular(lock, os.O_WRONLY | os.O_CREAT)
    except NotRegularFile:  # a FIFO or link in its place: ours to replace
        unlink(lock)
        fd = open_regular(lock, os.O_WRONLY | os.O_CREAT)
    if fd is None:
        raise FileNotFoundError(f"cannot make {lock}")
    with open(fd, "wb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def read(root: Path) -> dict:
    """{"hit_tokens", "query_tokens"}: zeros for a missing or damaged file."""
    try:
        c = json.loads(read_file(root / "stats.json", MAX_HEAD) or b"{}")
        return {k: int(c.get(k, 0)) for k in ("hit_tokens", "query_tokens")}
    except (OSError, ValueError, TypeError, AttributeError, RecursionError, Damaged):
        return {"hit_tokens": 0, "query_tokens": 0}
