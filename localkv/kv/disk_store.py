"""A content-addressed store of KV blocks on disk, shared by every localkv process.

An entry is one full block's K and V, keyed by the block's chain hash. The hash already
covers the model fingerprint, block size, dtype, RoPE layout and KV format version (the
KVManager salt, made by the engine), so another model or format never matches; entries
still live under a directory per model so stats/ls/clear can work per model:
    root/<fingerprint[:16]>/<hash hex[:2]>/<hash hex>.kvb

The file format and its checks are in disk_entry.py; how a file is written into place (readers
see whole files or none, two processes may share a root) and which temp files are a dead
writer's, in disk_files.py.

Nothing but localkv names files <32 hex>.kvb in these folders, so a file there that fails its
checks is damage, whatever it holds (zeros after a crash, another format, a FIFO, a symlink):
reads and writes replace it, `cache stats/ls` show it as damaged, the size cap and `cache clear`
count and remove it. The folders are 0700 and never symlinks: a read or a write through one
could leave the cache.
"""

import contextlib
import errno
import functools
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import numpy as np

from localkv import kv_format
from localkv.home import STALE_AGE, home, private_dir
from localkv.kv import disk_counters as counters
from localkv.kv import disk_views
from localkv.kv.block_events import DISK, BlockLog, Stored
from localkv.kv.disk_entry import (
    PARENT,
    Damaged,
    ReadBuffer,
    all_finite,
    decode,
    encode,
    halves,
    holds_entry,
    read_file,
    read_header,
)
from localkv.kv.disk_files import (
    NS,
    SUB,
    TMP,
    Entry,
    dirs,
    make_dirs,
    orphan,
    real_dirs,
    scan,
    scan_dir,
    unlink,
    write_atomic,
)
from localkv.kv.evict.protocol import to_host

SUFFIX = ".kvb"
LOW_WATER = 0.9  # evict down to this share of the cap, so a full cache is not evicted per put
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a full disk, or the user's quota


@functools.lru_cache(maxsize=64)
def _ns(fingerprint: str) -> str:
    return re.sub(r"[^0-9A-Za-z_-]", "_", fingerprint[:16]) or "_"


class DiskStore:
    def __init__(self, root: Path | None = None, max_bytes: int = 2 << 30, dtype="float16"):
        self.root = Path(root) if root is not None else home() / "kvcache"
        self.max_bytes = int(max_bytes)
        # entries are written in the pool's (K, V) formats (no conversion): float16, float32,
        # q8_0, q4_0, or a K:V pair of them (kv_format.pair_stored)
        self.formats = kv_format.pair_by_stored(dtype if isinstance(dtype, str) else np.dtype(dtype).name)
        if self.formats is None:
            raise ValueError(f"disk cache dtype must be float16, float32, q8_0, q4_0 or K:V of them, not {dtype}")
        self.disabled = False
        self.warning: str | None = None  # set once when writes fail; the CLI prints it
        self.cleared_bytes = 0  # bytes freed by the last clear()
        self._total: int | None = None  # running byte total: one scan per process, then tracked
        self._kept: set[Path] | None = None  # a prompt's entries while it is written (prefix())
        self.full = False  # the last prefix() found no room for all of its blocks
        self._lock = threading.Lock()  # reads may run on two threads
        self._buffer = ReadBuffer()  # load_into's reads: copied out at once
        self.log: BlockLog | None = None  # told of the entries this process writes and removes

    def path(self, fingerprint: str, h: int) -> Path:
        return Path(self._where(fingerprint, h))

    def _where(self, fingerprint: str, h: int) -> str:
        """path() as a string: a warm start names each block of its prompt twice, and pathlib's
        joins cost more than the system calls on the file."""
        x = f"{h:032x}"
        return f"{self.root}{os.sep}{_ns(fingerprint)}{os.sep}{x[:2]}{os.sep}{x}{SUFFIX}"

    def contains(self, fingerprint: str, h: int) -> bool:
        with contextlib.suppress(OSError):
            return stat.S_ISREG(os.lstat(self._where(fingerprint, h)).st_mode)
        return False

    # ------------------------------------------------------------------ read

    def get(self, fingerprint: str, h: int, tokens) -> tuple[np.ndarray, np.ndarray] | None:
        """The block's (K, V) as float32 [layers, block_size, kv_heads, head_dim], or None.
        Reads work even when writes are disabled: a read-only cache is still useful."""
        got = self.read(fingerprint, h, tokens)
        if got is None:
            return None
        return kv_format.decode(got[0]), kv_format.decode(got[1])

    def load_into(self, fingerprint: str, h: int, tokens, k_out: np.ndarray, v_out: np.ndarray) -> bool:
        """get() straight into two (pool) arrays [layers, block_size, kv_heads, head_dim] of
        the entry's own dtype; False (outputs untouched) on a miss, and an entry in another
        dtype is one (K/V are never converted on the way in). Thread-safe."""
        got = self.read_like(fingerprint, h, tokens, k_out, v_out, self._buffer)
        if got is None:
            return False
        np.copyto(k_out, got[0], casting="unsafe")
        np.copyto(v_out, got[1], casting="unsafe")
        return True

    def read_like(self, fingerprint: str, h: int, tokens, k_like, v_like, into: ReadBuffer | None = None):
        """read(), or None also when its K or V differs from k_like's / v_like's dtype or shape
        (a pool's block of another format: a miss, rows are never converted)."""
        got = self.read(fingerprint, h, tokens, into)
        if got is None or any(a.shape != o.shape or a.dtype != o.dtype for a, o in zip(got, (k_like, v_like))):
            return None
        return got

    def read(
        self, fingerprint: str, h: int, tokens, into: ReadBuffer | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The verified (K, V), each [layers, block_size, kv_heads, row_len] in its stored
        format (views of the file's bytes; read into `into`'s buffer if given: valid until this
        thread's next read), or None; a file that fails a check is deleted."""
        path = self._where(fingerprint, h)
        if not real_dirs(path):
            return None
        try:
            data = read_file(path, self.max_bytes, into)
            got = None if data is None else decode(data)
            if got is None:
                return None
            meta, payload = got
            if meta["hash"] != f"{h:032x}":
                raise Damaged("hash does not match the file name")
            if meta["fingerprint"] != fingerprint or meta["tokens"] != list(tokens):
                return None  # a valid entry, just not this block
            kv = halves(meta, payload)
            if kv is None:
                raise Damaged("NaN or Inf in K/V")
        except Damaged:
            self._drop(Path(path))
            return None
        except OSError:  # unreadable, or removed by another process mid-read
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # mtime is the LRU clock
        return kv

    def _drop(self, path: Path):
        """Delete what is at an entry's name (the file, or the link, FIFO... itself)."""
        with contextlib.suppress(OSError):
            size = os.lstat(path).st_size
            with self._lock:
                gone = unlink(path)
                if gone and self._total is not None:
                    self._total -= size
            if gone:
                self._tell_removed(path)

    def _tell_removed(self, path: Path):
        if self.log is not None:
            self.log.removed(int(path.name[:32], 16), DISK)

    # ----------------------------------------------------------------- write

    @contextlib.contextmanager
    def prefix(self):
        """A prompt's blocks are put (or kept) within, first block first. A prefix is reusable
        only from its start, so none of them is evicted to make room for a later one: a block
        that finds no room, even with every other entry evicted by least recent use, is not
        written, and `full` is set (put returns False); the blocks before it stay."""
        self._kept, self.full = set(), False
        try:
            yield
        finally:
            self._kept = None

    def keep(self, fingerprint: str, h: int):
        """Within prefix(): an entry already stored that the prompt starts with is kept too."""
        if self._kept is not None:
            self._kept.add(self.path(fingerprint, h))

    def put(
        self, fingerprint: str, model_name: str, h: int, tokens, k: np.ndarray, v: np.ndarray, parent: int | None = None
    ) -> bool:
        """Store one block (k, v: [layers, block_size, kv_heads, head_dim]) unless present; a
        block holding NaN or Inf is not stored; parent: the hash of the block before it. Never
        raises for I/O: a failure disables writes for this process and sets warning."""
        k, v = to_host(k), to_host(v)  # a GPU pool's block: copied to the host (CuPy has no implicit copy)
        if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[1] != len(tokens):
            raise ValueError(f"k {k.shape} and v {v.shape} must both be [layers, {len(tokens)}, heads, row]")
        path = self.path(fingerprint, h)
        if self.disabled or (self.full and self._kept is not None):  # the prefix ended at its last block
            return False
        if real_dirs(path) and self._holds(path):  # never look through a symlink
            return False
        got = self._payload(k, v)
        if got is None:
            return False  # the model made NaN or Inf: nothing a later run should load
        dtype, kv = got
        meta = {
            "fingerprint": fingerprint,
            "model": model_name,
            "hash": f"{h:032x}",
            "tokens": [int(t) for t in tokens],
            "dtype": dtype,
            "shape": list(k.shape),
        } | ({PARENT: f"{parent:032x}"} if parent is not None else {})
        chunks = encode(meta, memoryview(kv).cast("B"))
        try:
            if self._total is None:
                self.prune()
            make_dirs(self.root, path)
            if not self._write_or_make_room(path, chunks, keep_existing=True):
                return False
        except OSError as e:
            if e.errno in _NO_SPACE and self._kept:  # full of the prompt's own first blocks
                self.full = True
            else:
                self._disable(e)
            return False
        self._total += sum(len(c) for c in chunks)
        if self._kept is not None:
            self._kept.add(path)
        if self.log is not None:
            self.log.stored(h, parent, tuple(meta["tokens"]), DISK)
        if self._total > self.max_bytes:
            self._enforce_cap()
            if self._kept is not None and self._total > self.max_bytes:  # nothing but the prompt is left
                self._kept.discard(path)
                self._drop(path)
                self.full = True
                return False
        return True

    def _payload(self, k: np.ndarray, v: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(dtype field, payload: K's bytes then V's) of a block, or None when it holds NaN or
        Inf. One float format: converted to it, float32 where float16 would overflow (kept
        exact); otherwise the pool's bytes as they are, never requantized."""
        kf, vf = self.formats
        if kf == vf and not kf.quantized:
            for dtype in dict.fromkeys((kf.dtype, np.dtype(np.float32))):  # float32 where fp16 overflowed
                with np.errstate(over="ignore"):
                    kv = np.ascontiguousarray(np.stack([k, v]).astype(dtype))
                if all_finite(memoryview(kv).cast("B"), kv.dtype.name):
                    return kv.dtype.name, kv
            return None
        if k.dtype != kf.dtype or v.dtype != vf.dtype:
            name = kv_format.pair_name(kf, vf)
            raise ValueError(f"a {name} disk cache stores {name} blocks, not {k.dtype} and {v.dtype}")
        parts = [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in (k, v)]
        if not all(all_finite(memoryview(p), f.stored) for p, f in zip(parts, self.formats)):
            return None
        return kv_format.pair_stored(kf, vf), np.concatenate(parts)

    def _holds(self, path: Path) -> bool:
        """An entry is at path; anything else there is deleted, so the block gets written."""
        try:
            held = holds_entry(path)
        except OSError:
            return True  # unreadable: leave it, and this block unwritten
        if held is False:
            self._drop(path)
        return bool(held)

    def _write_or_make_room(self, path: Path, chunks, keep_existing=False) -> bool:
        """_write; on a full disk, evict least recently used entries and retry once (OSError if
        that fails too, or nothing could be evicted)."""
        try:
            return write_atomic(path, chunks, keep_existing)
        except OSError as e:
            if e.errno not in _NO_SPACE or not self._shrink(sum(len(c) for c in chunks)):
                raise
        return write_atomic(path, chunks, keep_existing)

    def _shrink(self, size: int) -> int:
        """The disk is full below the cap: lower this run's cap so the store gives up a tenth of
        what it holds, and at least size bytes, oldest entries first; later writes then evict
        under the new cap instead of filling the disk again. Entries removed."""
        total = sum(e.size for e in self._scan())
        self.max_bytes = max(0, min(int(total * LOW_WATER), total - size))
        return self._evict(self.max_bytes, self.max_bytes)

    def _disable(self, e: OSError):
        self.disabled = True
        where = e.filename or self.root
        self.warning = f"disk cache disabled: cannot write {where}: {e.strerror or e}"

    # ------------------------------------------------------ size cap, cleanup

    def _scan(self, temps: list | None = None) -> list[Entry]:
        return scan(self.root, temps)

    def prune(self) -> int:
        """Remove temp files left by writers that died (gone from this host, or untouched for
        STALE_AGE) and enforce the cap. Files removed."""
        temps = []
        self._scan(temps)
        with contextlib.suppress(OSError), os.scandir(self.root) as it:  # stats.json temps
            temps += [Path(f.path) for f in it if TMP.fullmatch(f.name)]
        old = time.time() - STALE_AGE
        removed = 0
        for t in temps:
            with contextlib.suppress(OSError):
                if orphan(t.name) or os.lstat(t).st_mtime < old:
                    t.unlink()
                    removed += 1
        return removed + self._enforce_cap()

    def _enforce_cap(self) -> int:
        return self._evict(self.max_bytes, self.max_bytes * LOW_WATER)

    def _evict(self, over: float, down_to: float) -> int:
        """Rescan (other processes write too) and, when the entries take more than over bytes,
        delete the least recently used, damaged ones included, until down_to. Entries the other
        process deleted count as gone. Entries removed."""
        entries = self._scan()
        total = sum(e.size for e in entries)
        removed = 0
        if total > over:
            for e in sorted(entries, key=lambda e: e.mtime):
                if total <= down_to:
                    break
                if self._kept is not None and e.path in self._kept:
                    continue  # a prompt's first blocks, being written: see prefix()
                if unlink(e.path):
                    removed += 1
                    self._tell_removed(e.path)
                total -= e.size
        self._total = total
        return removed

    # --------------------------------------------------------- counters, views

    def record(self, query_tokens: int, hit_tokens: int):
        """Add to the lifetime counters in stats.json; merged under a lock with what other
        processes wrote, so no process overwrites another's counts."""
        if self.disabled or not (query_tokens or hit_tokens):
            return
        try:
            private_dir(self.root)
            with counters.locked(self.root):
                c = counters.read(self.root)
                c["query_tokens"] += int(query_tokens)
                c["hit_tokens"] += int(hit_tokens)
                self._write_or_make_room(self.root / "stats.json", [json.dumps(c).encode()])
        except OSError as e:
            self._disable(e)

    def blocks(self, fingerprint: str) -> list[Stored]:
        """One model's valid entries as the log tells them (an entry written before entries
        named their parent is told as a first block)."""
        out = []
        for d in dirs(self.root, NS):
            for sub in dirs(d, SUB) if d.name == _ns(fingerprint) else ():
                for e in scan_dir(sub):
                    with contextlib.suppress(FileNotFoundError):
                        m = read_header(e.path)
                        if m is not None and m["fingerprint"] == fingerprint:
                            parent = int(m[PARENT], 16) if PARENT in m else None
                            out.append(Stored(int(m["hash"], 16), parent, tuple(m["tokens"]), DISK))
        return out

    def ls(self) -> list[dict]:
        """Every entry, most recently used first; damaged ones with the model disk_views.DAMAGED."""
        return [r for r, _ in disk_views.rows(self.root)]

    def stats(self) -> dict:
        return disk_views.stats(self.root, self.max_bytes)

    def clear(self, model: str | None = None) -> int:
        """Delete entries of model (a model name or fingerprint prefix), or all; damaged ones go
        with all, or with a fingerprint prefix their folder matches. Entries removed; bytes
        freed go to cleared_bytes. Foreign files stay."""
        n = freed = 0
        for e in self._scan():
            try:
                m = read_header(e.path)
            except FileNotFoundError:
                continue
            if m is None:
                m = {"model": None, "fingerprint": e.path.parent.parent.name}
            if model is not None and m["model"] != model and not m["fingerprint"].startswith(model):
                continue
            if unlink(e.path):
                n += 1
                freed += e.size
        for d in dirs(self.root, NS):  # drop emptied dirs; rmdir keeps non-empty ones
            for sub in dirs(d, SUB):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()
        if self._total is not None:
            self._total = max(0, self._total - freed)
        self.cleared_bytes = freed
        return n
