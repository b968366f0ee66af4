"""The KV panel in a bare host app: what it shows for a snapshot, and the pool bar's arithmetic."""

from collections import deque
from dataclasses import replace

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Sparkline

from localkv.engine import Engine
from localkv.kv.evict import EvictConfig
from localkv.stats import Event, Stats
from localkv.tui.widgets.kv_panel import KVPanel, KVSnapshot, PoolBar, bar_widths

USAGE = {
    "blocks": 64,
    "block_size": 16,
    "used": 10,
    "shared": 3,
    "cached_free": 5,
    "free": 49,
    "bytes_per_block": 4096,
    "kv_dtype": "q8_0",
}


def snapshot(**kw) -> KVSnapshot:
    fields = dict(
        usage=USAGE,
        stats=Stats(
            prefix_queries=200,
            prefix_hits=50,
            disk_hits=16,
            cow_copies=2,
            evictions=7,
            offloads=1,
            recalls=4,
            events=deque([Event("evict", 0, 12, (32, 48), 0.25), Event("recall", 0, 5, (0, 16))]),
        ),
        policy="h2o",
        budget=128,
    )
    return KVSnapshot(**(fields | kw))


class _Host(App):
    def compose(self) -> ComposeResult:
        yield KVPanel()


@pytest.mark.asyncio
async def test_panel_shows_every_number_of_the_snapshot():
    app = _Host()
    async with app.run_test(size=(40, 40)) as pilot:
        panel = app.query_one(KVPanel)
        panel.snapshot = snapshot()
        panel.last_turn = (32, 40)
        await pilot.pause()
        assert panel.shown == {
            "blocks": "64 × 16 tok",
            "used": "10",
            "shared": "3",
            "cached": "5",
            "free": "49",
            "kv bytes": "40.0 KiB",
            "kv/token": "256 B q8_0",
            "cow copies": "2",
            "reuse last": "32/40 tok",
            "reuse total": "50/200 (25%)",
            "disk hits": "16",
            "policy": "h2o",
            "budget": "128 tok",
            "evictions": "7",
            "offloads": "1",
            "recalls": "4",
        }
        stats = str(panel.query_one("#kv-stats").content).splitlines()
        assert stats[0] == "blocks      64 × 16 tok" and stats[1] == "used        10  shared 3"
        events = str(panel.query_one("#kv-events").content)
        assert events == "evict   blk 12 @32-48 0.25\nrecall  blk 5 @0-16"
        assert panel.query_one(PoolBar).usage == USAGE


@pytest.mark.asyncio
async def test_panel_before_any_numbers_and_without_limits():
    app = _Host()
    async with app.run_test(size=(40, 40)) as pilot:
        panel = app.query_one(KVPanel)
        assert panel.shown == {} and str(panel.query_one("#kv-events").content) == "none yet"
        panel.snapshot = snapshot(stats=Stats(), budget=None, policy="none")
        await pilot.pause()
        assert (panel.shown["reuse last"], panel.shown["reuse total"], panel.shown["budget"]) == ("-", "0/0", "-")
        assert str(panel.query_one("#kv-events").content) == "none yet"


@pytest.mark.asyncio
async def test_rates_go_into_the_sparkline_and_the_last_one_is_shown():
    app = _Host()
    async with app.run_test(size=(40, 40)) as pilot:
        panel = app.query_one(KVPanel)
        for i in range(70):
            panel.add_rate(float(i), "now")
        panel.add_rate(12.345, "last reply")
        await pilot.pause()
        data = panel.query_one(Sparkline).data
        assert len(data) == 60 and data[-1] == 12.345 and data[0] == 11.0  # the last 60 samples
        assert str(panel.query_one("#kv-rate").content) == "12.3 last reply"


def test_snapshot_copies_the_engine_numbers(engine):
    s = engine.stats
    s.emit("evict", 0, 3, (16, 32), 0.5)
    s.prefix_queries, s.prefix_hits = 40, 16
    snap = KVSnapshot.of(engine, n_events=1)
    assert snap.usage == engine.pool.usage() and (snap.stats.prefix_queries, snap.stats.prefix_hits) == (40, 16)
    assert snap.stats.evictions == 1 and [e.kind for e in snap.stats.events] == ["evict"]
    assert (snap.policy, snap.budget) == (engine.config.evict.policy, engine.config.evict.budget) == ("none", None)
    s.emit("evict", 0, 4)
    assert snap.stats.evictions == 1 and len(snap.stats.events) == 1  # a copy: the engine may move on


def test_snapshot_takes_the_policy_from_the_engine_config(config):
    snap = KVSnapshot.of(Engine(replace(config, evict=EvictConfig("sliding", 64))))
    assert (snap.policy, snap.budget) == ("sliding", 64)


def test_bar_keeps_a_cell_for_every_non_empty_segment():
    assert bar_widths([3, 0, 1, 20000], 30) == [1, 0, 1, 28]


def test_bar_fills_the_width_exactly():
    assert sum(bar_widths([5, 5, 5, 5], 31)) == 31
    assert bar_widths([1, 1], 1) == [1, 1]  # too narrow for every segment: never below one cell


def test_bar_of_an_empty_pool_or_width_is_empty():
    assert bar_widths([0, 0, 0, 0], 10) == [0, 0, 0, 0] and bar_widths([1, 2], 0) == [0, 0]
