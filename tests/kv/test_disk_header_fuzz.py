"""A disk-cache entry whose JSON header holds any JSON value in any field is either an entry
with that meaning or a damaged one (a miss, deleted, rewritten); the reader, `cache stats`,
`cache ls`, `cache clear`, `localkv run` and the server never fail on it."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from localkv.cli.cache import cache_app
from localkv.config import EngineConfig
from localkv.kv import disk_entry as entry
from localkv.kv.disk_store import DiskStore
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf

FP = "ab" * 32
SHAPE = (2, 4, 2, 8)
ROOT = Path(__file__).resolve().parents[2]

# every JSON type, nested, and the values at the edges of what the reader takes
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 2**31, 2**63, 10**400, 4, 16])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["", "float16", "float32", "object", "x" * 5000, "AB" * 16, "ab" * 16])
)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=4), c, max_size=3))
FIELD = st.sampled_from(sorted(entry.FIELDS))


def block(seed: int):
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 50000, SHAPE[1]))
    h = int.from_bytes(rng.bytes(16), "little")
    return h, tokens, rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)


def rewrite(p: Path, head: bytes | None = None, change=None) -> dict | None:
    """Rewrite entry p's JSON header: change(meta) with the checksum recomputed over the new
    fields (only the values are wrong, nothing is torn), or the raw bytes head."""
    data = p.read_bytes()
    n = entry.FIXED.unpack_from(data)[2]
    payload = data[entry.FIXED.size + n :]
    meta = None
    if head is None:
        meta = json.loads(data[entry.FIXED.size : entry.FIXED.size + n])
        meta.pop("checksum")
        meta = change(meta)
        if type(meta) is dict and "checksum" not in meta:
            meta["checksum"] = entry.digest(meta, payload)
        head = json.dumps(meta).encode()
    p.write_bytes(entry.FIXED.pack(entry.MAGIC, entry.VERSION, len(head)) + head + payload)
    return meta


def check_store(root: Path, h: int, t, k, damaged: bool):
    """Every view of the store works. A damaged entry (always, when damaged) is shown as one in
    stats, is a miss that deletes it, and is rewritten; an entry that is well formed but not
    this block's is a miss and kept; any entry that loads holds the K written."""
    store = DiskStore(root)
    s, rows = store.stats(), store.ls()
    assert s["entries"] == len(rows) == 2
    shown = s["damaged"]["entries"]
    assert shown in (0, 1) and (shown or not damaged)
    got = store.get(FP, h, t)
    if got is not None:
        assert not damaged
        np.testing.assert_allclose(got[0], k, atol=2e-3)
    elif store.path(FP, h).exists():
        assert not damaged and not shown, "only a well-formed entry of another block is kept"
    else:
        assert store.put(FP, "tiny", h, t, k, k) and store.get(FP, h, t) is not None
    assert DiskStore(root).stats()["damaged"]["entries"] == 0


def fresh_store(root: Path):
    store = DiskStore(root)
    h, t, k, v = block(1)
    assert store.put(FP, "tiny", h, t, k, v)
    h2, t2, k2, v2 = block(2)
    assert store.put(FP, "tiny", h2, t2, k2, v2)
    return store, h, t, k


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=FIELD, value=values)
def test_any_json_value_in_any_field_is_an_entry_or_damage(field, value):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        store, h, t, k = fresh_store(root)
        meta = rewrite(store.path(FP, h), change=lambda m: {**m, field: value})
        check_store(root, h, t, k, damaged=not entry.header_ok(meta))


def test_only_well_typed_headers_pass():
    _, tokens, _, _ = block(0)
    good = {
        "fingerprint": FP,
        "model": "tiny",
        "hash": "0" * 32,
        "checksum": "0" * 8,
        "dtype": "float16",
        "tokens": list(tokens),
        "shape": list(SHAPE),
    }
    assert entry.header_ok(good)
    for bad in (
        {**good, "dtype": ["float16"]},  # the field that made every command fail with TypeError
        {**good, "dtype": {"float16": 1}},
        {**good, "tokens": [True, 1, 2, 3]},
        {**good, "tokens": [1.0, 2, 3, 4]},
        {**good, "tokens": [-1, 2, 3, 4]},
        {**good, "shape": [2, 4, 2, 2**40]},
        {**good, "shape": [2, 4, 2, True]},
        {**good, "hash": "XYZ"},
        {**good, "model": ""},
        {**good, "fingerprint": "f" * 10_000},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "model"},
    ):
        assert not entry.header_ok(bad), bad


RAW_HEADERS = {
    "duplicate_key": lambda m: json.dumps(m)[:-1].encode() + b', "dtype": "float16"}',
    "nan": lambda m: json.dumps(m).replace('"tiny"', "NaN").encode(),
    "huge_int": lambda m: json.dumps(m).replace('"tiny"', "9" * 5000).encode(),
    "nested": lambda m: b"[" * 50_000 + b"]" * 50_000,
    "not_utf8": lambda m: json.dumps(m).replace("tiny", "ti\udcffy").encode("utf-8", "surrogateescape"),
    "empty": lambda m: b"",
}


@pytest.mark.parametrize("bad", list(RAW_HEADERS))
def test_headers_that_are_not_plain_json_objects_are_damage(tmp_path, bad):
    store, h, t, k = fresh_store(tmp_path)
    p = store.path(FP, h)
    data = p.read_bytes()
    n = entry.FIXED.unpack_from(data)[2]
    meta = json.loads(data[entry.FIXED.size : entry.FIXED.size + n])
    rewrite(p, head=RAW_HEADERS[bad](meta))
    check_store(tmp_path, h, t, k, damaged=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=FIELD, value=values)
def test_cache_commands_never_fail_on_a_header(field, value):
    with tempfile.TemporaryDirectory() as d:
        store, h, _, _ = fresh_store(Path(d) / "kvcache")
        rewrite(store.path(FP, h), change=lambda m: {**m, field: value})
        env = {"LOCALKV_HOME": d}
        for args in (["stats"], ["stats", "--json"], ["ls"], ["ls", "--json"], ["ls", "-m", "tiny"], ["clear"]):
            r = CliRunner().invoke(cache_app, args, env=env)
            assert r.exit_code == 0 and r.exception is None, (args, r.output)
        assert not any(Path(d, "kvcache").rglob("*.kvb")), "clear removes damaged entries too"


# ------------------------------------------------------------------ through run and the server

PROMPT = "the quick brown fox " * 4  # a few full blocks of 16 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", ctx=256))


def localkv(home: Path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOCALKV_HOME=str(home))
    cmd = [sys.executable, "-m", "localkv", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def damage_all(home: Path) -> list[Path]:
    """A list where each entry's dtype string belongs (the checksum made to match)."""
    files = sorted((home / "kvcache").rglob("*.kvb"))
    for p in files:
        rewrite(p, change=lambda m: {**m, "dtype": [m["dtype"]]})
    return files


def test_a_list_as_dtype_never_bricks_run_or_cache(tiny, tmp_path):
    home = tmp_path / "home"
    args = ("run", PROMPT, "-m", tiny, "-n", "2", "-t", "0", "--json", "--no-save")
    first = localkv(home, *args)
    assert first.returncode == 0, first.stderr
    files = damage_all(home)
    assert files
    for cmd in (("cache", "stats"), ("cache", "ls")):
        p = localkv(home, *cmd)
        assert p.returncode == 0 and "internal error" not in p.stderr, p.stderr
    again = localkv(home, *args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["cached_tokens"] == 0, "a damaged entry is never loaded"
    assert DiskStore(home / "kvcache").stats()["damaged"]["entries"] == 0, "every damaged entry was rewritten"
    third = localkv(home, *args)
    assert json.loads(third.stdout)["cached_tokens"] > 0, "and the rewritten entries are used"


def test_a_list_as_dtype_never_fails_the_server(tiny, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALKV_HOME", str(home))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    cfg = EngineConfig(model=tiny, kv_mem="8MiB")
    with BackgroundServer(cfg) as s:
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
    damage_all(home)
    with BackgroundServer(cfg) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert DiskStore(home / "kvcache").stats()["damaged"]["entries"] == 0
