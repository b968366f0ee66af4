"""The engine's worker without an app: what it posts, what it saves, what it frees."""

import threading
from dataclasses import replace

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.conversations.turn import Turn
from localkv.errors import LocalkvError
from localkv.sampling import SamplingParams
from localkv.tui.worker import (
    EngineReady,
    ReplyChunk,
    ReplyDone,
    ReplyStarted,
    Warmed,
    build_engine,
    error_line,
    generate,
    warm,
)

GREEDY = SamplingParams(temperature=0, seed=0, max_tokens=24)


def run(engine, turn, prompt, clock, params=GREEDY, stop=None):
    posted = []
    generate(engine, turn, prompt, params, posted.append, stop or threading.Event(), clock)
    return posted


def test_a_reply_streams_in_batches_and_is_saved(engine, reference, fake_clock):
    store = ConversationStore()
    posted = run(engine, Turn(store), "hello", fake_clock(0.02))
    want = reference([{"role": "user", "content": "hello"}])
    started, *chunks, done = posted
    assert isinstance(started, ReplyStarted) and isinstance(done, ReplyDone)
    assert all(isinstance(c, ReplyChunk) for c in chunks) and len(chunks) > 1  # batches, not one update at the end
    assert "".join(c.text for c in chunks) + done.tail == want.text and done.result.text == want.text
    assert (started.cached_tokens, started.prompt_tokens) == (0, done.result.prompt_tokens)
    assert done.reason == want.finish_reason and not done.error and done.tps > 0
    assert any(c.tps for c in chunks) and all((c.tps is None) == (c.snap is None) for c in chunks)
    user, reply = store.path(done.reply_id)
    assert (user.id, user.content, reply.content, done.cid) == (done.user_id, "hello", want.text, user.conversation_id)
    assert reply.completion_tokens == len(want.tokens) and reply.sampling["max_tokens"] == 24
    assert done.snap.usage["used"] == 0 == engine.pool.usage()["used"]  # freed before the last snapshot


def test_a_second_turn_reuses_the_cached_prompt(engine, fake_clock):
    store = ConversationStore()
    first = run(engine, Turn(store), "hello", fake_clock())[-1]
    path = store.path(first.reply_id)
    turn = Turn(store, first.cid, first.reply_id, [{"role": m.role, "content": m.content} for m in path])
    started = run(engine, turn, "again", fake_clock())[0]
    assert started.cached_tokens >= engine.block_size and started.snap.stats.prefix_hits >= engine.block_size


def test_stop_ends_the_reply_and_keeps_what_came(engine, fake_clock):
    store, stop = ConversationStore(), threading.Event()
    stop.set()  # checked after each piece: the reply ends after its first one
    params = replace(GREEDY, max_tokens=500, ignore_eos=True)
    done = run(engine, Turn(store), "hello", fake_clock(), params, stop)[-1]
    assert done.reason == "stopped" and not done.error and 0 < done.result.completion_tokens < 500
    assert store.get_message(done.reply_id).content == done.result.text == done.tail
    assert engine.pool.usage()["used"] == 0


def test_a_failure_mid_reply_keeps_and_saves_what_came(engine, fake_clock, monkeypatch):
    step, calls = engine.step, []

    def failing(plan, *a, **k):
        calls.append(len(plan.seqs))
        if len(calls) == 4:  # the prefill, two decode steps, then the failure
            raise RuntimeError("device lost")
        return step(plan, *a, **k)

    monkeypatch.setattr(engine, "step", failing)
    store = ConversationStore()
    done = run(engine, Turn(store), "hello", fake_clock(), replace(GREEDY, ignore_eos=True))[-1]
    assert (done.reason, done.error) == ("error", "error: internal error: RuntimeError: device lost")
    assert done.result.completion_tokens == 3  # the prefill's token and two decoded ones
    assert store.get_message(done.reply_id).content == done.result.text
    assert engine.pool.usage()["used"] == 0


def test_a_refused_request_posts_only_done_and_saves_nothing(engine, fake_clock):
    store = ConversationStore()
    [done] = run(engine, Turn(store), "x" * 5000, fake_clock())  # longer than the context
    assert done.result is None and done.error.startswith("error: ") and "context" in done.error
    assert done.reply_id is None and store.list_conversations() == []


def test_a_reply_that_cannot_be_saved_says_so(engine, fake_clock):
    done = run(engine, Turn(ConversationStore(), "0" * 32), "hello", fake_clock())[-1]
    assert done.result.text and done.reply_id is None
    assert done.error == f"error: not saved: no conversation {'0' * 32}"


def test_build_engine_posts_the_new_engine(config):
    posted = []
    build_engine(config, posted.append)
    [ready] = posted
    assert isinstance(ready, EngineReady) and ready.engine.config == config and not ready.error


def test_build_engine_posts_the_error_when_it_fails(tmp_path):
    posted = []
    build_engine(EngineConfig(model=tmp_path / "missing.gguf", device="cpu"), posted.append)
    [ready] = posted
    assert ready.engine is None and ready.error.startswith("error: ") and "internal" not in ready.error


def test_error_line_names_a_bug_as_one():
    assert error_line(LocalkvError("pool full")) == "error: pool full"
    assert error_line(KeyError("k")) == "error: internal error: KeyError: 'k'"


def test_a_reply_names_the_next_turns_start_and_warming_it_makes_the_next_turn_hit(engine, fake_clock):
    store = ConversationStore()
    first = run(engine, Turn(store), "hello", fake_clock())[-1]
    assert first.next_prefix
    posted = []
    warm(engine, first.next_prefix, posted.append, threading.Event())
    assert posted == [Warmed()]
    path = store.path(first.reply_id)
    turn = Turn(store, first.cid, first.reply_id, [{"role": m.role, "content": m.content} for m in path])
    started = run(engine, turn, "again", fake_clock())[0]
    assert started.cached_tokens == len(first.next_prefix) // engine.block_size * engine.block_size
