"""What `localkv cache ls` and `cache stats` show of a disk store: a row per entry, read from
its header (a damaged one by its folder and file name), and the totals per model."""

from pathlib import Path

from localkv.kv import disk_counters as counters
from localkv.kv.disk_entry import read_header
from localkv.kv.disk_files import scan

DAMAGED = "(damaged)"  # the model column of an entry that fails its checks


def rows(root: Path) -> list[tuple[dict, bool]]:
    """(row, valid) for every entry under root, most recently used first."""
    out = []
    for e in scan(root):
        try:
            m = read_header(e.path)
        except FileNotFoundError:  # removed by another process meanwhile
            continue
        ok = m is not None
        m = m or {"model": DAMAGED, "fingerprint": e.path.parent.parent.name, "hash": e.path.stem, "tokens": []}
        row = {
            "model": m["model"],
            "fingerprint": m["fingerprint"][:16],
            "hash": m["hash"][:12],
            "tokens": len(m["tokens"]),
            "dtype": m.get("dtype", "?"),
            "bytes": e.size,
            "last_used": e.mtime,
        }
        out.append((row, ok))
    return sorted(out, key=lambda r: -r[0]["last_used"])


def stats(root: Path, max_bytes: int) -> dict:
    """Entries and bytes per model (and of damaged entries), with the lifetime counters."""
    models: dict[str, dict] = {}
    damaged = {"entries": 0, "bytes": 0}
    for r, ok in rows(root):  # newest first: a model shows its most recent name
        if not ok:
            damaged["entries"] += 1
            damaged["bytes"] += r["bytes"]
            continue
        m = models.setdefault(
            r["fingerprint"], {"name": r["model"], "fingerprint": r["fingerprint"], "entries": 0, "bytes": 0}
        )
        m["entries"] += 1
        m["bytes"] += r["bytes"]
    ms = sorted(models.values(), key=lambda m: -m["bytes"])
    return {
        "root": str(root),
        "entries": sum(m["entries"] for m in ms) + damaged["entries"],
        "bytes": sum(m["bytes"] for m in ms) + damaged["bytes"],
        "max_bytes": max_bytes,
        "models": ms,
        "damaged": damaged,
        **counters.read(root),
    }
