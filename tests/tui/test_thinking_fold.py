"""A thinking model in `localkv chat` (the tiny Qwen3 of tests/thinking_models.py, made to think):
the thinking streams into its own widget above the reply, folded once the answer comes, with its
token count; the store keeps it, and a conversation opened again shows it folded."""

import itertools
import threading

import pytest
from test_app import GREEDY, SIZE, idle, make_app, messages, send
from thinking_models import scripted, write

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.conversations.turn import Turn
from localkv.engine import Engine
from localkv.tui.app import ChatApp
from localkv.tui.widgets.message import Thinking, clean
from localkv.tui.worker import ReplyChunk, generate

REPLY = "<think>\nThe capital: Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def qwen3(vocabularies, tmp_path_factory):
    path = write(tmp_path_factory.mktemp("qwen3"), "tiny-qwen3")
    return Engine(EngineConfig(model=str(path), disk_cache=False, kv_mem="16MiB", ctx=512))


def test_the_worker_streams_the_thinking_before_the_answer(qwen3, monkeypatch):
    scripted(monkeypatch, qwen3.tokenizer, REPLY)
    posted, clock = [], itertools.count(0, 1.0).__next__  # every piece is flushed at once
    generate(qwen3, Turn(ConversationStore()), "Capital?", GREEDY, posted.append, threading.Event(), clock)
    chunks = [m for m in posted if isinstance(m, ReplyChunk)]
    first_text = next(i for i, c in enumerate(chunks) if c.text)
    assert "".join(c.reasoning for c in chunks[:first_text]) == "The capital: Paris."
    assert "".join(c.text for c in chunks) == "Paris." and not any(c.reasoning for c in chunks[first_text:])


@pytest.mark.asyncio
async def test_the_thinking_is_folded_above_the_reply_with_its_token_count(qwen3, monkeypatch):
    scripted(monkeypatch, qwen3.tokenizer, REPLY)
    app = make_app(qwen3, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"Capital?", "enter")
        await idle(pilot)
        assert messages(app) == [("user", "Capital?"), ("assistant", "Paris.")]
        (t,) = app.transcript.query(Thinking)
        kids = list(app.transcript.children)
        assert kids.index(t) == len(kids) - 2  # just above the reply
        reply = app.store.get_message(app.at)
        tokens = len(qwen3.tokenizer.encode(REPLY[: REPLY.index("</think>")], add_bos=False)) + 1  # + </think>
        assert (t.text, t.collapsed, t.title) == ("The capital: Paris.", True, f"thinking · {tokens} tok")
        assert (reply.content, reply.reasoning) == ("Paris.", "The capital: Paris.")
        cid = app.cid
    again = ChatApp(qwen3, app.store, conversation=cid)
    async with again.run_test(size=SIZE) as pilot:
        (t,) = again.transcript.query(Thinking)
        assert (t.text, t.collapsed) == ("The capital: Paris.", True) and t.title.startswith("thinking · ")
        await send(pilot, "/set think off")  # the template's no-thinking form: the reply is all answer
        await send(pilot, "And of Spain?")
        assert len(again.transcript.query(Thinking)) == 1 and messages(again)[-1] == ("assistant", clean(REPLY))
