"""The message box in a bare host app: shell-like history and Esc leaving it."""

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Static

from localkv.tui.widgets.prompt import PromptInput


class _Host(App):
    def __init__(self):
        super().__init__()
        self.sent: list[str] = []

    def compose(self) -> ComposeResult:
        yield PromptInput(id="prompt")
        yield Static("transcript", id="transcript")

    def on_input_submitted(self, event: PromptInput.Submitted) -> None:
        self.sent.append(event.value)
        event.input.remember(event.value)
        event.input.value = ""


async def sent(pilot, *lines):
    for line in lines:
        await pilot.press(*line, "enter")


@pytest.mark.asyncio
async def test_up_and_down_walk_the_lines_sent():
    app = _Host()
    async with app.run_test() as pilot:
        box = app.query_one(PromptInput)
        await sent(pilot, "one", "two", "three")
        await pilot.press("up")
        assert box.value == "three" and box.cursor_position == 5
        await pilot.press("up", "up", "up")  # stops at the oldest
        assert box.value == "one"
        await pilot.press("down")
        assert box.value == "two"
        await pilot.press("down", "down")  # past the newest: an empty line again
        assert box.value == ""
        await pilot.press("down")
        assert box.value == ""


@pytest.mark.asyncio
async def test_history_skips_a_repeated_line_and_restarts_after_sending():
    app = _Host()
    async with app.run_test() as pilot:
        box = app.query_one(PromptInput)
        await sent(pilot, "a", "b", "b")
        assert box.history == ["a", "b"]
        await pilot.press("up", "up")
        assert box.value == "a"
        await pilot.press("enter")  # sending a recalled line puts it last and starts from the end
        assert app.sent[-1] == "a" and box.history == ["a", "b", "a"]
        await pilot.press("up")
        assert box.value == "a"


def test_remember_ignores_an_empty_line():
    box = PromptInput()
    box.remember("")
    assert box.history == []


@pytest.mark.asyncio
async def test_escape_leaves_the_box_for_the_transcript():
    app = _Host()
    async with app.run_test() as pilot:
        app.query_one("#transcript").can_focus = True
        await pilot.press("escape")
        assert app.focused is app.query_one("#transcript")
