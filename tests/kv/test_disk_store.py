"""The on-disk KV block store: round trips, corruption, LRU cap, concurrency, the cache CLI."""

import contextlib
import errno
import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from localkv import kv_format
from localkv.cli.cache import cache_app
from localkv.kv import disk_entry as entry
from localkv.kv import disk_files
from localkv.kv import disk_store as ds
from localkv.kv.disk_store import DiskStore

FP = "ab" * 32  # a sha256-like model fingerprint
FP2 = "cd" * 32
SHAPE = (2, 4, 2, 8)  # layers, block_size, kv_heads, head_dim


def block(seed: int):
    """(hash, tokens, k, v) of a distinct block."""
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 50000, SHAPE[1]))
    h = int.from_bytes(rng.bytes(16), "little")
    return h, tokens, rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)


def put(store, seed, fp=FP, name="tiny"):
    h, t, k, v = block(seed)
    return store.put(fp, name, h, t, k, v)


def entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def test_round_trip_fp16_within_tolerance_and_fp32_exact(tmp_path):
    h, t, k, v = block(0)
    for dtype, tol in (("float16", 2e-3), ("float32", 0)):
        store = DiskStore(tmp_path / dtype, dtype=dtype)
        assert store.put(FP, "tiny", h, t, k, v)
        assert store.contains(FP, h)
        k2, v2 = store.get(FP, h, t)
        assert k2.dtype == v2.dtype == np.float32 and k2.shape == v2.shape == SHAPE
        np.testing.assert_allclose(k2, k, rtol=tol, atol=tol)
        np.testing.assert_allclose(v2, v, rtol=tol, atol=tol)
        if tol == 0:
            assert np.array_equal(k2, k) and np.array_equal(v2, v)
    # fp16 halves the payload
    for d, itemsize in (("float16", 2), ("float32", 4)):
        data = entries(tmp_path / d)[0].read_bytes()
        assert len(data) - entry.FIXED.size - entry.FIXED.unpack_from(data)[2] == 2 * k.size * itemsize


def test_load_into_reuses_its_buffer_across_sizes_and_threads(tmp_path):
    """load_into reads through one buffer per thread: a bigger entry after a smaller one (while
    a view of the smaller read lives on), and two threads at once, each get their own bytes."""
    store = DiskStore(tmp_path, dtype="float16")
    small, big = block(1), block(2)
    wide = (SHAPE[0], SHAPE[1], SHAPE[2] * 4, SHAPE[3])
    rng = np.random.default_rng(3)
    kb, vb = (rng.standard_normal(wide).astype(np.float32) for _ in range(2))
    assert store.put(FP, "tiny", *small) and store.put(FP, "tiny", big[0], big[1], kb, vb)
    held = store.read(FP, small[0], small[1], store._buffer)  # a view that outlives the next read
    for h, t, k, v in ((small[0], small[1], small[2], small[3]), (big[0], big[1], kb, vb)):
        k_out, v_out = np.zeros(k.shape, np.float16), np.zeros(v.shape, np.float16)
        assert store.load_into(FP, h, t, k_out, v_out)
        assert np.array_equal(k_out, k.astype(np.float16)) and np.array_equal(v_out, v.astype(np.float16))
    assert np.array_equal(held[0], small[2].astype(np.float16))
    outs = {}

    def load(name, h, t, shape):
        for _ in range(50):
            k_out, v_out = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
            assert store.load_into(FP, h, t, k_out, v_out)
        outs[name] = k_out

    threads = [
        threading.Thread(target=load, args=a) for a in (("s", small[0], small[1], SHAPE), ("b", big[0], big[1], wide))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert np.array_equal(outs["s"], small[2].astype(np.float16)) and np.array_equal(outs["b"], kb.astype(np.float16))


def test_the_checksum_is_zlibs_crc32(tmp_path):
    """Entries written before the checksum moved to ISA-L still verify: the same CRC-32."""
    import zlib

    meta, payload = {"a": 1}, os.urandom(1000)
    assert entry.digest(meta, payload) == f"{zlib.crc32(payload, zlib.crc32(entry._canon(meta))):08x}"


def test_entry_path_layout_and_skip_if_present(tmp_path):
    store = DiskStore(tmp_path)
    h, t, k, v = block(1)
    assert store.put(FP, "tiny", h, t, k, v)
    x = f"{h:032x}"
    assert entries(tmp_path) == [tmp_path / FP[:16] / x[:2] / f"{x}.kvb"]
    assert not store.put(FP, "tiny", h, t, k + 1, v)  # present: not rewritten
    assert np.allclose(store.get(FP, h, t)[0], k, atol=2e-3)


def test_fp16_overflow_falls_back_to_fp32(tmp_path):
    store = DiskStore(tmp_path)
    h, t, k, v = block(2)
    k[0, 0, 0, 0] = 1e6  # beyond fp16 range
    assert store.put(FP, "tiny", h, t, k, v)
    assert store.get(FP, h, t)[0][0, 0, 0, 0] == 1e6


def test_wrong_tokens_fingerprint_or_hash_is_a_miss_and_keeps_the_entry(tmp_path):
    store = DiskStore(tmp_path)
    h, t, k, v = block(3)
    store.put(FP, "tiny", h, t, k, v)
    assert store.get(FP, h, t[:-1] + (t[-1] + 1,)) is None
    assert store.get(FP, h, t[:-1]) is None
    assert store.get(FP, h ^ 1, t) is None
    assert store.get(FP2, h, t) is None  # other namespace
    # same namespace prefix, different full fingerprint: the header catches it
    assert store.get(FP[:16] + "0" * 48, h, t) is None
    assert store.get(FP, h, t) is not None, "a valid entry must survive misses"


@pytest.mark.parametrize("damage", ["truncate", "truncate_header", "empty", "flip_payload", "flip_header", "flip_last"])
def test_damaged_file_is_a_miss_and_removed(tmp_path, damage):
    store = DiskStore(tmp_path)
    h, t, k, v = block(4)
    store.put(FP, "tiny", h, t, k, v)
    (p,) = entries(tmp_path)
    data = bytearray(p.read_bytes())
    n = entry.FIXED.size + entry.FIXED.unpack_from(data)[2]
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "truncate_header":
        data = data[: n - 5]
    elif damage == "empty":
        data = b""
    elif damage == "flip_payload":
        data[n + 7] ^= 0x10
    elif damage == "flip_header":  # a token digit: still valid JSON, caught by the checksum
        i = data.index(str(t[0]).encode(), entry.FIXED.size)
        data[i] = ord("1") if data[i] != ord("1") else ord("2")
    else:
        data[-1] ^= 0x01
    p.write_bytes(bytes(data))
    assert store.get(FP, h, t) is None
    assert not p.exists()
    assert store.put(FP, "tiny", h, t, k, v), "a removed entry gets rewritten"
    assert store.get(FP, h, t) is not None


def test_newer_format_version_is_a_miss_but_kept(tmp_path):
    store = DiskStore(tmp_path)
    h, t, k, v = block(5)
    store.put(FP, "tiny", h, t, k, v)
    (p,) = entries(tmp_path)
    data = bytearray(p.read_bytes())
    data[4] = entry.VERSION + 1
    p.write_bytes(bytes(data))
    assert store.get(FP, h, t) is None
    assert p.exists()
    assert not store.put(FP, "tiny", h, t, k, v), "a newer localkv's entry is left alone"
    assert p.read_bytes() == bytes(data)


def test_older_format_version_is_replaced(tmp_path):
    # an older localkv's entry is never read by this one; kept, it would block the rewrite for good
    store = DiskStore(tmp_path, dtype="float32")
    h, t, k, v = block(5)
    store.put(FP, "tiny", h, t, k, v)
    (p,) = entries(tmp_path)
    data = bytearray(p.read_bytes())
    data[4] = entry.VERSION - 1
    p.write_bytes(bytes(data))
    assert store.get(FP, h, t) is None
    assert not p.exists()
    assert store.put(FP, "tiny", h, t, k, v)
    got = store.get(FP, h, t)
    np.testing.assert_array_equal(got[0], k)
    np.testing.assert_array_equal(got[1], v)


def test_foreign_files_are_ignored_and_kept(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1)  # every put evicts: foreign files must survive it
    h, t, k, v = block(6)
    x = f"{h:032x}"
    sub = tmp_path / FP[:16] / x[:2]
    sub.mkdir(parents=True)
    foreign = [
        tmp_path / "README.txt",
        sub / "notes.kvb",
        sub / "notes.txt",
        tmp_path / FP[:16] / "x.kvb",
        sub / f"{x}.kvb.bak",
        tmp_path / ".hidden.tmp",
        sub / ".other.tmp",
    ]
    for f in foreign:
        f.write_bytes(b"not ours")
    old = 1_000_000_000
    for f in foreign:
        os.utime(f, (old, old))  # old enough for both the temp sweep and the LRU
    assert store.get(FP, h, t) is None
    assert store.put(FP, "tiny", h, t, k, v)
    assert put(store, 7)
    store.prune()
    assert store.stats()["entries"] <= 1 and len(store.ls()) == store.stats()["entries"]
    store.clear()
    assert all(f.read_bytes() == b"not ours" for f in foreign)


def test_lru_cap_evicts_least_recently_used(tmp_path):
    store = DiskStore(tmp_path)
    for i in range(5):
        put(store, 10 + i)
    size = max(p.stat().st_size for p in entries(tmp_path))
    paths = {i: store.path(FP, block(10 + i)[0]) for i in range(5)}
    for i, p in paths.items():  # ages: 10 is the oldest ... 14 the newest
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    h, t, _, _ = block(10)
    assert store.get(FP, h, t) is not None  # a hit makes 10 the most recently used
    # a new store (a new process) with room for 5.5 entries: the 6th put evicts down to 90% of
    # the cap (4.95 entries), so the two least recently used go: 1 and 2, not 0 (just read)
    small = DiskStore(tmp_path, max_bytes=int(size * 5.5))
    assert put(small, 20)
    left = {i for i, p in paths.items() if p.exists()}
    assert left == {0, 3, 4}, left
    assert small.contains(FP, block(20)[0])
    assert sum(p.stat().st_size for p in entries(tmp_path)) <= small.max_bytes * ds.LOW_WATER


def test_running_total_is_tracked_without_rescanning(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    put(store, 30)
    scans = []
    real = DiskStore._scan
    monkeypatch.setattr(DiskStore, "_scan", lambda self, *a: scans.append(1) or real(self, *a))
    for i in range(5):
        put(store, 31 + i)
    assert scans == []
    assert store._total == sum(p.stat().st_size for p in entries(tmp_path))


def test_prune_removes_stale_temp_files_only(tmp_path):
    store = DiskStore(tmp_path)
    put(store, 40)
    sub = entries(tmp_path)[0].parent
    stale, fresh = sub / ".lkv-aa-1.tmp", sub / ".lkv-bb-2.tmp"
    stale.write_bytes(b"half a block")
    fresh.write_bytes(b"being written")
    os.utime(stale, (1_000_000, 1_000_000))
    assert store.prune() == 1
    assert not stale.exists() and fresh.exists()
    assert len(entries(tmp_path)) == 1


def test_prune_sweeps_the_temp_files_of_a_writer_that_was_killed(tmp_path):
    store = DiskStore(tmp_path)
    put(store, 41)
    sub = entries(tmp_path)[0].parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid no longer runs (pids are not reused this fast)
    here = f"{disk_files.TMP_PREFIX}{disk_files.HOST}"
    killed, mine, elsewhere, live = (
        sub / f"{here}-{dead.pid}-x-1.tmp",
        sub / f"{here}-{os.getpid()}-x-2.tmp",
        sub / f".lkv-00000000-{dead.pid}-x-3.tmp",  # another host's pid: judged by age only
        tmp_path / f"{here}-{os.getppid()}-stats-4.tmp",
    )
    for f in (killed, mine, elsewhere, live):
        f.write_bytes(b"half a block")
    assert store.prune() == 1
    assert not killed.exists() and mine.exists() and elsewhere.exists() and live.exists()


def _worker(root, seeds, barrier, cap):
    store = DiskStore(Path(root), max_bytes=cap)
    barrier.wait()
    for s in seeds:
        h, t, k, v = block(s)
        store.put(FP, "tiny", h, t, k, v)
        got = store.get(FP, h, t)
        assert got is None or np.allclose(got[0], k, atol=2e-3)
    assert store.warning is None, store.warning


@pytest.mark.parametrize("capped", [False, True])
def test_two_processes_at_once_leave_only_valid_entries(tmp_path, capped):
    one = DiskStore(tmp_path / "probe")
    put(one, 0)
    size = entries(tmp_path / "probe")[0].stat().st_size
    cap = size * 8 if capped else 2 << 30
    shared = list(range(100, 130))
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(
            target=_worker, args=(str(tmp_path / "c"), shared + list(range(200 + 100 * i, 230 + 100 * i)), barrier, cap)
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    root = tmp_path / "c"
    files = entries(root)
    assert not [p for p in root.rglob("*") if p.is_file() and p.suffix != ".kvb"], "temp files left behind"
    store = DiskStore(root)
    seeds = shared + list(range(200, 230)) + list(range(300, 330))
    present = 0
    for s in seeds:
        h, t, k, v = block(s)
        if store.contains(FP, h):
            present += 1
            got = store.get(FP, h, t)
            assert got is not None, f"entry {s} is not valid"
            np.testing.assert_allclose(got[1], v, atol=2e-3)
    assert present == len(files)
    if capped:
        assert present > 0 and sum(p.stat().st_size for p in files) <= cap + 2 * size
    else:
        assert present == len(seeds)


def test_unwritable_root_disables_writes_with_one_warning(tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("a regular file where the cache directory should be")
    store = DiskStore(root)
    assert put(store, 50) is False
    assert store.disabled and store.warning.startswith("disk cache disabled: ")
    w = store.warning
    assert put(store, 51) is False
    store.record(10, 5)
    assert store.warning == w
    assert store.get(FP, block(50)[0], block(50)[1]) is None
    assert root.read_text().startswith("a regular file")


def test_a_disk_that_stays_full_gives_up_after_one_retry_and_leaves_no_temp_file(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    put(store, 60)
    tries = []

    def full(*a):
        tries.append(a)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds.os, "replace", full)
    assert put(store, 61) is False
    assert len(tries) == 2, "the write is retried once, after evicting"
    assert store.disabled and store.warning.startswith("disk cache disabled: ") and "No space left" in store.warning
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [], "the oldest entry made way; no temp file is left"
    monkeypatch.undo()
    assert put(store, 62) is False, "stays disabled for the process"


class Disk:
    """A file system that holds capacity bytes of entries: os.replace of an entry past it
    fails with ENOSPC, as a full disk fails a write."""

    def __init__(self, root: Path, capacity: int, monkeypatch):
        self.root, self.capacity, self.full = root, capacity, 0
        real = os.replace

        def replace(src, dst):
            if str(dst).endswith(".kvb") and self.used() + os.path.getsize(src) > self.capacity:
                self.full += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            real(src, dst)

        monkeypatch.setattr(ds.os, "replace", replace)

    def used(self) -> int:
        return sum(p.stat().st_size for p in entries(self.root))


def test_a_nearly_full_disk_evicts_the_oldest_entries_and_keeps_caching(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    put(store, 200)
    os.utime(store.path(FP, block(200)[0]), (1_000_200, 1_000_200))
    size = entries(tmp_path)[0].stat().st_size
    disk = Disk(tmp_path, int(size * 5.5), monkeypatch)  # far below the store's cap of 2 GiB
    for seed in range(201, 220):
        assert put(store, seed), seed
        os.utime(store.path(FP, block(seed)[0]), (1_000_000 + seed, 1_000_000 + seed))  # LRU order = write order
    assert disk.full >= 1 and not store.disabled and store.warning is None
    assert store.max_bytes < disk.capacity, "the cap follows the disk for the rest of the run"
    kept = [seed for seed in range(200, 220) if store.contains(FP, block(seed)[0])]
    assert kept == list(range(220 - len(kept), 220)) and len(kept) >= 3, "the newest entries are kept"
    h, t, k, _ = block(219)
    np.testing.assert_allclose(store.get(FP, h, t)[0], k, atol=2e-3)
    assert disk.full <= 2, "after the first full write, the lowered cap evicts before the disk fills"


def test_stats_ls_clear_per_model(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10 << 20)
    for i in range(3):
        put(store, 70 + i, FP, "alpha")
    for i in range(2):
        put(store, 80 + i, FP2, "beta")
    s = store.stats()
    a, b = (sum(p.stat().st_size for p in entries(tmp_path / f[:16])) for f in (FP, FP2))
    assert (s["entries"], s["bytes"], s["max_bytes"]) == (5, a + b, 10 << 20)
    assert s["models"] == [
        {"name": "alpha", "fingerprint": FP[:16], "entries": 3, "bytes": a},
        {"name": "beta", "fingerprint": FP2[:16], "entries": 2, "bytes": b},
    ]
    rows = store.ls()
    assert len(rows) == 5 and set(rows[0]) == {"model", "fingerprint", "hash", "tokens", "dtype", "bytes", "last_used"}
    assert rows[0]["tokens"] == SHAPE[1] and len(rows[0]["hash"]) == 12
    assert [r["last_used"] for r in rows] == sorted((r["last_used"] for r in rows), reverse=True)
    assert store.clear("beta") == 2 and store.cleared_bytes == b
    assert store.clear(FP[:6]) == 3  # a fingerprint prefix
    assert store.clear() == 0 and store.stats()["entries"] == 0
    put(store, 90, FP, "alpha")
    put(store, 91, FP2, "beta")
    assert store.clear("gamma") == 0 and store.clear() == 2
    assert not any(tmp_path.iterdir()), "emptied directories are removed"


def test_lifetime_counters_accumulate_across_instances(tmp_path):
    DiskStore(tmp_path).record(100, 64)
    b = DiskStore(tmp_path)
    b.record(50, 16)
    b.record(0, 0)
    s = DiskStore(tmp_path).stats()
    assert (s["query_tokens"], s["hit_tokens"]) == (150, 80)
    (tmp_path / "stats.json").write_text("{garbage")
    DiskStore(tmp_path).record(1, 1)  # a damaged counter file restarts, never crashes
    assert json.loads((tmp_path / "stats.json").read_text()) == {"hit_tokens": 1, "query_tokens": 1}


def _count(root, n):
    for _ in range(n):
        DiskStore(Path(root)).record(2, 1)


def test_counters_from_two_processes_are_merged(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_count, args=(str(tmp_path), 40)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert DiskStore(tmp_path).stats()["query_tokens"] == 160


def test_cache_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path))
    store = DiskStore()
    assert store.root == tmp_path / "kvcache"
    put(store, 100, FP, "alpha")
    put(store, 101, FP2, "beta")
    store.record(10, 4)
    run = CliRunner().invoke
    r = run(cache_app, ["stats", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["entries"] == 2 and s["hit_tokens"] == 4 and {m["name"] for m in s["models"]} == {"alpha", "beta"}
    r = run(cache_app, ["stats"])
    assert r.exit_code == 0 and "alpha" in r.stdout and "4 of 10 prompt tokens" in r.stdout
    r = run(cache_app, ["ls", "--json", "--model", "beta"])
    assert r.exit_code == 0 and [x["model"] for x in json.loads(r.stdout)] == ["beta"]
    r = run(cache_app, ["ls"])
    assert r.exit_code == 0 and "alpha" in r.stdout and "beta" in r.stdout
    r = run(cache_app, ["clear", "--model", "alpha"])
    assert r.exit_code == 0 and "removed 1 entry" in r.stdout
    r = run(cache_app, ["clear"])
    assert r.exit_code == 0 and "removed 1 entry" in r.stdout
    assert DiskStore().stats()["entries"] == 0


# ---------------------------------------------------------------- files that are not what they seem


def within(seconds: float, fn, fifo: Path | None = None):
    """fn() on a thread; fails (instead of hanging the suite) if it blocks, e.g. on a FIFO."""
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        if fifo is not None:  # let the blocked open() go: a writer shows up
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked")
    return out.get("v")


def test_fifo_where_an_entry_should_be_never_blocks_and_is_replaced(tmp_path):
    store = DiskStore(tmp_path / "kvcache")
    put(store, 110)
    h, t, k, v = block(111)
    p = store.path(FP, h)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(p)
    s = within(5, store.stats, p)
    assert (s["entries"], s["damaged"]["entries"]) == (2, 1) and [m["entries"] for m in s["models"]] == [1]
    assert sorted(r["model"] for r in within(5, store.ls, p)) == ["(damaged)", "tiny"]
    r = within(20, lambda: CliRunner().invoke(cache_app, ["stats"], env={"LOCALKV_HOME": str(tmp_path)}))
    assert r.exit_code == 0
    assert within(5, lambda: store.get(FP, h, t), p) is None
    assert not os.path.lexists(p), "the FIFO is removed"
    assert store.put(FP, "tiny", h, t, k, v) and store.get(FP, h, t) is not None


def test_fifo_as_counters_or_lock_file_never_blocks(tmp_path):
    store = DiskStore(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "stats.json")
    os.mkfifo(tmp_path / ".stats.lock")
    assert within(5, store.stats, tmp_path / "stats.json")["query_tokens"] == 0
    within(5, lambda: store.record(10, 4), tmp_path / ".stats.lock")
    assert store.warning is None
    assert (store.stats()["query_tokens"], store.stats()["hit_tokens"]) == (10, 4)


def test_symlinks_never_lead_out_of_the_folder(tmp_path):
    outside = DiskStore(tmp_path / "outside")
    h, t, k, v = block(112)
    outside.put(FP, "tiny", h, t, k, v)  # a valid entry, just not in this cache
    target = outside.path(FP, h)
    store = DiskStore(tmp_path / "c")
    p = store.path(FP, h)
    p.parent.mkdir(parents=True)
    p.symlink_to(target)
    assert store.get(FP, h, t) is None and not os.path.lexists(p) and target.exists()
    os.mkfifo(tmp_path / "fifo")
    p.symlink_to(tmp_path / "fifo")
    assert within(5, lambda: (store.stats(), store.get(FP, h, t))[1], tmp_path / "fifo") is None
    # a folder of the cache that is a symlink to another: never read through, never written into
    shutil.rmtree(tmp_path / "c" / FP[:16])
    (tmp_path / "c" / FP[:16]).symlink_to(tmp_path / "outside" / FP[:16])
    assert store.get(FP, h, t) is None and store.stats()["entries"] == 0
    h2, t2, k2, v2 = block(113)
    bait = outside.path(FP, h2)  # not an entry: in the cache it would be deleted, outside it must stay
    bait.parent.mkdir(parents=True, exist_ok=True)
    bait.write_bytes(b"someone else's file")
    assert store.put(FP, "tiny", h2, t2, k2, v2)
    assert bait.read_bytes() == b"someone else's file" and target.exists(), "nothing written or removed outside"
    assert len(entries(tmp_path / "outside")) == 2
    assert not (tmp_path / "c" / FP[:16]).is_symlink() and store.get(FP, h2, t2) is not None
    store.clear()
    assert target.exists()


def nonfinite_entry(store, seed, dtype, value):
    """An entry whose checksum is right but whose K holds value (NaN or Inf)."""
    h, t, k, v = block(seed)
    kv = np.stack([k, v]).astype(dtype)
    kv[0, 1, 2, 0, 3] = value
    meta = {"fingerprint": FP, "model": "tiny", "hash": f"{h:032x}", "tokens": list(t), "dtype": dtype,
            "shape": list(SHAPE)}  # fmt: skip
    p = store.path(FP, h)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"".join(entry.encode(meta, memoryview(np.ascontiguousarray(kv)).cast("B"))))
    return h, t, k, v, p


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_payload_is_never_loaded(tmp_path, dtype, value):
    store = DiskStore(tmp_path, dtype=dtype)
    h, t, k, v, p = nonfinite_entry(store, 114, dtype, value)
    k_out, v_out = np.full(SHAPE, 7.0, np.float32), np.full(SHAPE, 7.0, np.float32)
    assert not store.load_into(FP, h, t, k_out, v_out)
    assert (k_out == 7).all() and (v_out == 7).all(), "outputs untouched"
    assert not p.exists(), "removed, so the next put rewrites it"
    assert store.put(FP, "tiny", h, t, k, v) and np.isfinite(store.get(FP, h, t)[0]).all()
    nonfinite_entry(store, 115, dtype, value)
    assert store.get(FP, *block(115)[:2]) is None and store.read(FP, *block(115)[:2]) is None


@pytest.mark.parametrize("fmt", [kv_format.Q8_0, kv_format.Q4_0], ids=["q8_0", "q4_0"])
def test_a_quantized_payload_is_finite_when_every_scale_is(fmt):
    # every f16 bit pattern as the scale of one block among finite ones: the check reads the
    # scales in place, from their bytes, and must agree with numpy on each
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (64, fmt.block_bytes), dtype=np.uint8)
    blocks[:, :2] = np.array([0.5], np.float16).view(np.uint8)
    every = np.arange(1 << 16, dtype=np.uint16)
    finite = np.isfinite(every.view(np.float16))
    for bits in np.concatenate([every[::97], every[~finite][::7], [0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00]]):
        b = blocks.copy()
        b[17, :2] = np.array([bits], np.uint16).view(np.uint8)
        assert entry.all_finite(memoryview(b).cast("B"), fmt.stored) == bool(finite[bits]), hex(bits)
    assert entry.all_finite(memoryview(blocks).cast("B"), fmt.stored)


def test_nan_block_is_never_stored(tmp_path):
    store = DiskStore(tmp_path)
    h, t, k, v = block(116)
    k[1, 0, 0, 0] = np.nan
    assert not store.put(FP, "tiny", h, t, k, v)
    assert entries(tmp_path) == [] and store.warning is None


@pytest.mark.parametrize(
    "content", [b"\0" * 4096, b"", b"GIF89a" + b"\0" * 100, b"LK"], ids=["zeros", "empty", "foreign", "cut_magic"]
)
def test_zero_filled_or_foreign_file_at_an_entry_name_is_replaced(tmp_path, content):
    # nothing but localkv names files <32 hex>.kvb in these folders: what fails the checks is damage
    store = DiskStore(tmp_path)
    h, t, k, v = block(117)
    p = store.path(FP, h)
    p.parent.mkdir(parents=True)
    p.write_bytes(content)
    s = store.stats()
    assert (s["entries"], s["bytes"], s["damaged"]) == (1, len(content), {"entries": 1, "bytes": len(content)})
    assert [r["model"] for r in store.ls()] == ["(damaged)"]
    assert store.put(FP, "tiny", h, t, k, v), "replaced on the next write"
    assert store.get(FP, h, t) is not None and store.stats()["damaged"]["entries"] == 0
    p.write_bytes(content)
    assert store.get(FP, h, t) is None and not p.exists(), "or removed on the next read"
    p.write_bytes(content)
    assert store.clear() == 1 and not p.exists(), "and `cache clear` removes it"


def test_lru_cap_counts_and_evicts_damaged_entries(tmp_path):
    store = DiskStore(tmp_path)
    put(store, 118)
    size = entries(tmp_path)[0].stat().st_size
    h, t, _, _ = block(119)
    junk = store.path(FP, h)
    junk.parent.mkdir(parents=True, exist_ok=True)
    junk.write_bytes(b"\0" * size)
    os.utime(junk, (1_000_000, 1_000_000))  # the least recently used
    small = DiskStore(tmp_path, max_bytes=int(size * 2.5))
    assert put(small, 120)
    assert not junk.exists() and len(entries(tmp_path)) == 2


def reheader(p: Path, change) -> None:
    """Rewrite the JSON header of entry p through change(meta) -> new header object, with the
    checksum recomputed over the new fields: only the types are wrong, nothing is torn."""
    data = p.read_bytes()
    n = entry.FIXED.unpack_from(data)[2]
    meta = json.loads(data[entry.FIXED.size : entry.FIXED.size + n])
    payload = data[entry.FIXED.size + n :]
    meta.pop("checksum")
    new = change(meta)
    if isinstance(new, dict):
        new["checksum"] = entry.digest(new, payload)
    head = (new if isinstance(new, str) else json.dumps(new)).encode()
    p.write_bytes(entry.FIXED.pack(entry.MAGIC, entry.VERSION, len(head)) + head + payload)


BAD_HEADERS = {
    "tokens_int": lambda m: {**m, "tokens": 5},
    "tokens_str": lambda m: {**m, "tokens": ["a"] * len(m["tokens"])},
    "model_list": lambda m: {**m, "model": [1, 2]},
    "fingerprint_none": lambda m: {**m, "fingerprint": None},
    "hash_int": lambda m: {**m, "hash": 7},
    "shape_str": lambda m: {**m, "shape": "2,4,2,8"},
    "shape_3d": lambda m: {**m, "shape": m["shape"][:3]},
    "shape_negative": lambda m: {**m, "shape": [-2, -4, 2, 8]},
    "shape_huge": lambda m: {**m, "shape": [2**62, 4, 2, 8]},
    "dtype_int": lambda m: {**m, "dtype": 3},
    "dtype_object": lambda m: {**m, "dtype": "object"},
    "dtype_pair_unknown": lambda m: {**m, "dtype": "float16:bogus"},
    "dtype_triple": lambda m: {**m, "dtype": "float16:float16:float16"},
    "dtype_pair_rows": lambda m: {**m, "dtype": "q8_0:q4_0"},  # rows of 8 are no q8_0 blocks
    "list": lambda m: [m],
    "nested": lambda m: "[" * 50_000 + "]" * 50_000,  # deeper than Python's recursion limit
}


@pytest.mark.parametrize("bad", list(BAD_HEADERS))
def test_header_with_wrong_types_is_damage_not_a_crash(tmp_path, monkeypatch, bad):
    store = DiskStore(tmp_path / "kvcache")
    h, t, k, v = block(121)
    store.put(FP, "tiny", h, t, k, v)
    put(store, 122)
    reheader(store.path(FP, h), BAD_HEADERS[bad])
    s = store.stats()
    assert (s["entries"], s["damaged"]["entries"], len(store.ls())) == (2, 1, 2)
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path))
    for args in (["stats"], ["stats", "--json"], ["ls"], ["ls", "--json"]):
        r = CliRunner().invoke(cache_app, args)
        assert r.exit_code == 0 and r.exception is None, (args, r.output)
    assert "damaged" in CliRunner().invoke(cache_app, ["stats"]).stdout
    assert store.get(FP, h, t) is None and not store.path(FP, h).exists()
    assert store.put(FP, "tiny", h, t, k, v) and store.get(FP, h, t) is not None


def test_cache_folders_and_files_are_private(tmp_path):
    store = DiskStore(tmp_path / "kvcache")
    put(store, 123)
    store.record(4, 2)
    (p,) = entries(tmp_path)
    for d in (tmp_path / "kvcache", p.parent.parent, p.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (p, tmp_path / "kvcache" / "stats.json", tmp_path / "kvcache" / ".stats.lock"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_full_disk_keeps_a_prompts_first_blocks_over_its_tail(tmp_path, monkeypatch):
    """Within prefix(), a disk full of the prompt's own blocks ends the prompt there: older
    entries make way, the prompt's first blocks are never evicted for a later one, and the
    store stays enabled (it is full, not broken)."""
    store = DiskStore(tmp_path)
    for seed in (300, 301):
        put(store, seed)
        os.utime(store.path(FP, block(seed)[0]), (1_000_000 + seed, 1_000_000 + seed))
    size = entries(tmp_path)[0].stat().st_size
    Disk(tmp_path, int(size * 5.5), monkeypatch)
    with store.prefix():
        written = [put(store, seed) for seed in range(310, 320)]
    k = written.index(False)  # the disk's room, less the lowered cap's margin (_shrink)
    assert k >= 3 and not any(written[k:]) and store.full and not store.disabled
    assert [s for s in range(310, 320) if store.contains(FP, block(s)[0])] == list(range(310, 310 + k))
    assert not store.contains(FP, block(300)[0]) and not store.contains(FP, block(301)[0])
