"""A content-addressed store of KV blocks on disk, shared by every localkv process.

An entry is one full block's K and V, keyed by the block's chain hash. The hash already
covers the model fingerprint, block size and dtype (the KVManager salt), so another model
never matches; entries still live under a directory per model so stats/ls/clear can work
per model:  root/<fingerprint[:16]>/<hash hex[:2]>/<hash hex>.kvb

File: fixed header (magic, format version, JSON length) + JSON header + raw payload
(K then V). The JSON's checksum (CRC-32, 4 GB/s here where BLAKE2b did 1 GB/s: it guards
against torn writes and bit rot, not against an attacker who can write the cache
directory anyway) covers the rest of the JSON and the payload, so any bit flip or
truncation is caught. Writes go to a temp file in the same directory and are
renamed into place, so readers see whole files or none; two processes may share a root.
"""

import contextlib
import json
import os
import re
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localkv.home import home

MAGIC = b"LKVB"
VERSION = 2  # 2: CRC-32 checksum (1 used BLAKE2b; such files read as another version: a miss)
FIXED = struct.Struct("<4sHI")  # magic, format version, JSON header length
SUFFIX = ".kvb"
TMP_PREFIX = ".lkv-"  # our temp files: distinct enough that foreign dotfiles are never swept
TMP_MAX_AGE = 3600  # a temp file this old belongs to a crashed writer
LOW_WATER = 0.9  # evict down to this share of the cap, so a full cache is not evicted per put
_NS = re.compile(r"[0-9A-Za-z_-]{1,16}")
_SUB = re.compile(r"[0-9a-f]{2}")
_FILE = re.compile(r"[0-9a-f]{32}\.kvb")
_TMP = re.compile(re.escape(TMP_PREFIX) + r"[^/]*\.tmp")


@dataclass(slots=True)
class _Entry:
    path: Path
    size: int
    mtime: float


class _Corrupt(Exception):
    """The file is ours (right magic) but damaged, or in a format older than VERSION that
    this version never reads: delete it so it gets rewritten (put skips a block whose file
    exists, so a kept old-format file would be a miss for good)."""


def _canon(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def _digest(meta: dict, payload) -> str:
    return f"{zlib.crc32(payload, zlib.crc32(_canon(meta))):08x}"


def _encode(meta: dict, payload) -> list:
    head = _canon({**meta, "checksum": _digest(meta, payload)})
    return [FIXED.pack(MAGIC, VERSION, len(head)), head, payload]


def _decode(data: bytes) -> tuple[dict, memoryview] | None:
    """(meta, payload) of a verified file of this version; None for a foreign file or a
    newer format version (not ours to judge); _Corrupt for a damaged one or an older format."""
    if data[:4] != MAGIC:
        if MAGIC.startswith(data[:4]):  # cut off inside the magic
            raise _Corrupt("truncated")
        return None
    if len(data) < FIXED.size:
        raise _Corrupt("truncated")
    _, version, n = FIXED.unpack_from(data)
    if version > VERSION:
        return None  # a newer localkv's entry (they may share the folder): not ours to judge
    if version < VERSION:  # an older localkv's: never read again, so it must make way for a rewrite
        raise _Corrupt(f"format {version}, older than {VERSION}")
    try:
        meta = json.loads(data[FIXED.size : FIXED.size + n])
        check = meta.pop("checksum")
        shape = [int(x) for x in meta["shape"]]
        size = 2 * int(np.prod(shape)) * np.dtype(meta["dtype"]).itemsize
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Corrupt(f"bad header: {e}") from None
    payload = memoryview(data)[FIXED.size + n :]
    if len(shape) != 4 or len(payload) != size or _digest(meta, payload) != check:
        raise _Corrupt("size or checksum mismatch")
    return meta, payload


def _ns(fingerprint: str) -> str:
    return re.sub(r"[^0-9A-Za-z_-]", "_", fingerprint[:16]) or "_"


def _unlink(path: Path) -> bool:
    """True if the file is gone now: removed by us or already by another process."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


class DiskStore:
    def __init__(self, root: Path | None = None, max_bytes: int = 2 << 30, dtype="float16"):
        self.root = Path(root) if root is not None else home() / "kvcache"
        self.max_bytes = int(max_bytes)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float16, np.float32):
            raise ValueError(f"disk cache dtype must be float16 or float32, not {dtype}")
        self.disabled = False
        self.warning: str | None = None  # set once when writes fail; the CLI prints it
        self.cleared_bytes = 0  # bytes freed by the last clear()
        self._total: int | None = None  # running byte total: one scan per process, then tracked
        self._lock = threading.Lock()  # reads may run on two threads

    def path(self, fingerprint: str, h: int) -> Path:
        x = f"{h:032x}"
        return self.root / _ns(fingerprint) / x[:2] / (x + SUFFIX)

    def contains(self, fingerprint: str, h: int) -> bool:
        return self.path(fingerprint, h).is_file()

    # ------------------------------------------------------------------ read

    def get(self, fingerprint: str, h: int, tokens) -> tuple[np.ndarray, np.ndarray] | None:
        """The block's (K, V) as float32 [layers, block_size, kv_heads, head_dim], or None.
        Reads work even when writes are disabled: a read-only cache is still useful."""
        got = self.read(fingerprint, h, tokens)
        if got is None:
            return None
        kv = got.astype(np.float32)
        return kv[0], kv[1]

    def load_into(self, fingerprint: str, h: int, tokens, k_out: np.ndarray, v_out: np.ndarray) -> bool:
        """get() straight into two (pool) arrays [layers, block_size, kv_heads, head_dim],
        converting as it copies; False (outputs untouched) on a miss. Thread-safe: the
        engine loads a prompt's blocks two at a time."""
        got = self.read(fingerprint, h, tokens)
        if got is None or got.shape[1:] != k_out.shape:
            return False
        np.copyto(k_out, got[0], casting="unsafe")
        np.copyto(v_out, got[1], casting="unsafe")
        return True

    def read(self, fingerprint: str, h: int, tokens) -> np.ndarray | None:
        """The verified payload as [2, layers, block_size, kv_heads, head_dim] in its stored
        dtype (a view of the file's bytes), or None; a damaged entry is deleted."""
        path = self.path(fingerprint, h)
        try:
            data = path.read_bytes()
        except OSError:  # absent, or removed by another process mid-read
            return None
        try:
            got = _decode(data)
            if got is None:
                return None
            meta, payload = got
            if meta.get("hash") != f"{h:032x}":
                raise _Corrupt("hash does not match the file name")
        except _Corrupt:
            with self._lock:
                if _unlink(path) and self._total is not None:
                    self._total -= len(data)
            return None
        shape = meta["shape"]
        if meta.get("fingerprint") != fingerprint or meta.get("tokens") != list(tokens) or shape[1] != len(tokens):
            return None  # a valid entry, just not this block
        kv = np.frombuffer(payload, meta["dtype"]).reshape(2, *shape)
        with contextlib.suppress(OSError):
            os.utime(path)  # mtime is the LRU clock
        return kv

    # ----------------------------------------------------------------- write

    def put(self, fingerprint: str, model_name: str, h: int, tokens, k: np.ndarray, v: np.ndarray) -> bool:
        """Store one block (k, v: [layers, block_size, kv_heads, head_dim]) unless present.
        Never raises for I/O: a failure disables writes for this process and sets warning."""
        k, v = np.asarray(k), np.asarray(v)
        if k.shape != v.shape or k.ndim != 4 or k.shape[1] != len(tokens):
            raise ValueError(f"k {k.shape} and v {v.shape} must both be [layers, {len(tokens)}, heads, dim]")
        path = self.path(fingerprint, h)
        if self.disabled or path.exists():
            return False
        with np.errstate(over="ignore"):
            kv = np.stack([k, v]).astype(self.dtype)
        if self.dtype == np.float16 and not np.isfinite(kv).all():
            kv = np.stack([k, v]).astype(np.float32)  # fp16 would overflow: keep this block exact
        meta = {
            "fingerprint": fingerprint,
            "model": model_name,
            "hash": f"{h:032x}",
            "tokens": [int(t) for t in tokens],
            "dtype": kv.dtype.name,
            "shape": list(k.shape),
        }
        chunks = _encode(meta, memoryview(np.ascontiguousarray(kv)).cast("B"))
        try:
            if self._total is None:
                self.prune()
            path.parent.mkdir(parents=True, exist_ok=True)
            if not self._write(path, chunks, keep_existing=True):
                return False
        except OSError as e:
            self._disable(e)
            return False
        self._total += sum(len(c) for c in chunks)
        if self._total > self.max_bytes:
            self._enforce_cap()
        return True

    def _write(self, path: Path, chunks, keep_existing=False) -> bool:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.stem}-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    f.write(c)
            # no fsync: after a power loss the checksum turns a torn file into a miss
            if keep_existing and path.exists():
                return False  # another process wrote the same block meanwhile
            os.replace(tmp, path)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _disable(self, e: OSError):
        self.disabled = True
        where = e.filename or self.root
        self.warning = f"disk cache disabled: cannot write {where}: {e.strerror or e}"

    # ------------------------------------------------------ size cap, cleanup

    def _scan(self, temps: list | None = None) -> list[_Entry]:
        """Files named like entries (content unchecked); temp files go to temps if given.
        Directories may vanish under us: another process may be clearing."""
        out = []
        for d in self._dirs(self.root, _NS):
            for sub in self._dirs(d, _SUB):
                with contextlib.suppress(OSError), os.scandir(sub) as it:
                    for f in it:
                        if _FILE.fullmatch(f.name) and f.name.startswith(sub.name):
                            with contextlib.suppress(OSError):
                                st = f.stat()
                                out.append(_Entry(Path(f.path), st.st_size, st.st_mtime))
                        elif temps is not None and _TMP.fullmatch(f.name):
                            temps.append(Path(f.path))
        return out

    @staticmethod
    def _dirs(parent: Path, pattern) -> list[Path]:
        with contextlib.suppress(OSError), os.scandir(parent) as it:
            return [Path(e.path) for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        return []

    def prune(self) -> int:
        """Remove temp files left by crashed writers and enforce the cap. Files removed."""
        temps = []
        self._scan(temps)
        with contextlib.suppress(OSError), os.scandir(self.root) as it:  # stats.json temps
            temps += [Path(f.path) for f in it if _TMP.fullmatch(f.name)]
        old = time.time() - TMP_MAX_AGE
        removed = 0
        for t in temps:
            with contextlib.suppress(OSError):
                if t.stat().st_mtime < old:
                    t.unlink()
                    removed += 1
        return removed + self._enforce_cap()

    def _enforce_cap(self) -> int:
        """Rescan (other processes write too) and delete least recently used entries until
        under LOW_WATER of the cap. Entries the other process deleted count as gone."""
        entries = self._scan()
        total = sum(e.size for e in entries)
        removed = 0
        if total > self.max_bytes:
            for e in sorted(entries, key=lambda e: e.mtime):
                if total <= self.max_bytes * LOW_WATER:
                    break
                if _is_ours(e.path) and _unlink(e.path):
                    removed += 1
                total -= e.size  # a foreign look-alike is not part of the cache either
        self._total = total
        return removed

    # --------------------------------------------------------- counters, views

    def record(self, query_tokens: int, hit_tokens: int):
        """Add to the lifetime counters in stats.json; merged under a lock with what other
        processes wrote, so no process overwrites another's counts."""
        if self.disabled or not (query_tokens or hit_tokens):
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._locked():
                c = self._counters()
                c["query_tokens"] += int(query_tokens)
                c["hit_tokens"] += int(hit_tokens)
                self._write(self.root / "stats.json", [json.dumps(c).encode()])
        except OSError as e:
            self._disable(e)

    @contextlib.contextmanager
    def _locked(self):
        try:
            import fcntl
        except ImportError:  # no flock (Windows): a lost update under a race is tolerable
            yield
            return
        with open(self.root / ".stats.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _counters(self) -> dict:
        try:
            c = json.loads((self.root / "stats.json").read_text())
            return {k: int(c.get(k, 0)) for k in ("hit_tokens", "query_tokens")}
        except (OSError, ValueError, TypeError, AttributeError):
            return {"hit_tokens": 0, "query_tokens": 0}

    def ls(self) -> list[dict]:
        """Every entry, most recently used first."""
        rows = []
        for e in self._scan():
            m = _header(e.path)
            if m is not None:
                rows.append(
                    {
                        "model": m.get("model", "?"),
                        "fingerprint": str(m.get("fingerprint", ""))[:16],
                        "hash": str(m.get("hash", ""))[:12],
                        "tokens": len(m.get("tokens", ())),
                        "dtype": m.get("dtype", "?"),
                        "bytes": e.size,
                        "last_used": e.mtime,
                    }
                )
        return sorted(rows, key=lambda r: -r["last_used"])

    def stats(self) -> dict:
        models: dict[str, dict] = {}
        for r in self.ls():  # newest first: a model shows its most recent name
            m = models.setdefault(
                r["fingerprint"], {"name": r["model"], "fingerprint": r["fingerprint"], "entries": 0, "bytes": 0}
            )
            m["entries"] += 1
            m["bytes"] += r["bytes"]
        ms = sorted(models.values(), key=lambda m: -m["bytes"])
        return {
            "root": str(self.root),
            "entries": sum(m["entries"] for m in ms),
            "bytes": sum(m["bytes"] for m in ms),
            "max_bytes": self.max_bytes,
            "models": ms,
            **self._counters(),
        }

    def clear(self, model: str | None = None) -> int:
        """Delete entries of model (a model name or fingerprint prefix), or all. Entries
        removed; bytes freed go to cleared_bytes. Foreign files stay."""
        n = freed = 0
        for e in self._scan():
            m = _header(e.path)
            if m is None or (
                model is not None and m.get("model") != model and not str(m.get("fingerprint", "")).startswith(model)
            ):
                continue
            if _unlink(e.path):
                n += 1
                freed += e.size
        for d in self._dirs(self.root, _NS):  # drop emptied dirs; rmdir keeps non-empty ones
            for sub in self._dirs(d, _SUB):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()
        if self._total is not None:
            self._total = max(0, self._total - freed)
        self.cleared_bytes = freed
        return n


def _is_ours(path: Path) -> bool:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return MAGIC.startswith(f.read(4))  # a file cut inside the magic is a damaged entry
    return False


def _header(path: Path) -> dict | None:
    """The JSON header of an entry with our magic (any format version), or None."""
    try:
        with open(path, "rb") as f:
            magic, _, n = FIXED.unpack(f.read(FIXED.size))
            if magic != MAGIC:
                return None
            m = json.loads(f.read(n))
        return m if isinstance(m, dict) else None
    except (OSError, ValueError, struct.error):
        return None
