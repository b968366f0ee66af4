"""The transcript's widgets: messages, notices, and the transcript holding them."""

import pytest
from textual.app import App, ComposeResult

from localkv.tui.widgets.message import ChatMessage, Notice, clean
from localkv.tui.widgets.transcript import Transcript


def test_clean_shows_control_characters_instead_of_sending_them():
    assert clean("a\x1bb\n\tc\x7f\x85") == "a\u241bb\n\tc\u2421\ufffd"


def test_message_title_is_its_role_and_short_id():
    m = ChatMessage("user", "hi\x07")
    assert m.border_title == "you" and m.has_class("user") and m.mid is None
    m.set_id("abc1234")
    assert m.border_title == "you · abc1234"
    assert ChatMessage("assistant", mid="f" * 32, short="fffffff").border_title == "assistant · fffffff"


def test_notice_is_an_info_or_an_error_line():
    assert Notice("ok").has_class("info") and Notice("bad", error=True).has_class("error")


class _Host(App):
    def compose(self) -> ComposeResult:
        yield Transcript()


@pytest.mark.asyncio
async def test_transcript_shows_a_branch_and_notices_after_it():
    app = _Host()
    async with app.run_test(size=(60, 12)) as pilot:
        t = app.query_one(Transcript)
        await t.say("first notice")
        await t.show([ChatMessage("user", "q\x1b"), ChatMessage("assistant", "a")])  # replaces everything
        await t.add(ChatMessage("assistant"))
        await t.say("[b]not markup[/b]", error=True)
        await pilot.pause()
        views = list(t.children)
        assert [type(w) for w in views] == [ChatMessage, ChatMessage, ChatMessage, Notice]
        assert [w.source for w in views[:3]] == ["q\u241b", "a", ""]
        assert str(views[3].content) == "[b]not markup[/b]" and views[3].has_class("error")
        for i in range(10):
            await t.say(f"notice {i}")
        await pilot.pause()
        assert t.scroll_y == t.max_scroll_y > 0  # it follows the newest line
