"""A long prefill's progress reaches the reply's frame: the worker posts ReplyProgress."""

import threading
from dataclasses import replace

import localkv.progress
from localkv.conversations.store import ConversationStore
from localkv.conversations.turn import Turn
from localkv.engine import Engine
from localkv.sampling import SamplingParams
from localkv.tui.worker import ReplyChunk, ReplyDone, ReplyProgress, ReplyStarted, generate

GREEDY = SamplingParams(temperature=0, seed=0, max_tokens=4)


def posts(engine, fake_clock, prompt="many words " * 30):
    posted = []
    generate(engine, Turn(ConversationStore()), prompt, GREEDY, posted.append, threading.Event(), fake_clock(0.02))
    return posted


def test_a_long_prefill_posts_its_progress_then_its_end(config, fake_clock, monkeypatch):
    monkeypatch.setattr(localkv.progress, "SHOW_AFTER_S", -1.0)  # every prefill counts as long
    engine = Engine(replace(config, prefill_chunk=64, disk_cache=False))
    started, *middle, done = posts(engine, fake_clock)
    progress = [m.progress for m in middle if isinstance(m, ReplyProgress)]
    assert isinstance(started, ReplyStarted) and isinstance(done, ReplyDone)
    total = done.result.prompt_tokens
    assert [p.done for p in progress] == [*range(64, total, 64), total] and progress[-1].finished
    assert all(p.total == total and "prefill" in p.summary() for p in progress)
    first_text = next(i for i, m in enumerate(middle) if isinstance(m, ReplyChunk))
    assert all(isinstance(m, ReplyProgress) for m in middle[:first_text])  # before the reply's text


def test_a_short_prefill_posts_none(config, fake_clock):
    engine = Engine(replace(config, prefill_chunk=64, disk_cache=False))
    assert not any(isinstance(m, ReplyProgress) for m in posts(engine, fake_clock))
