"""The message box."""

from textual.binding import Binding
from textual.widgets import Input


class PromptInput(Input):
    """The message box: up/down walk the lines sent before, like a shell."""

    BINDINGS = [
        Binding("up", "history(-1)", show=False),
        Binding("down", "history(1)", show=False),
        # out of the box, letters are commands (p panel, b tree, r regen, f fork; i comes back)
        Binding("escape", "app.focus('transcript')", show=False),
    ]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history: list[str] = []
        self._pos = 0  # == len(history): the line being typed

    def remember(self, line: str) -> None:
        if line and (not self.history or self.history[-1] != line):
            self.history.append(line)
        self._pos = len(self.history)

    def action_history(self, step: int) -> None:
        pos = min(max(self._pos + step, 0), len(self.history))
        if pos != self._pos:
            self._pos = pos
            self.value = self.history[pos] if pos < len(self.history) else ""
            self.cursor_position = len(self.value)
