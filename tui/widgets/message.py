"""The transcript's widgets: a message (Markdown in a titled border), a thinking model's thinking
(folded above its reply) and a one-line notice."""

from textual.widgets import Collapsible, Markdown, Static

ROLE_TITLES = {"user": "you", "assistant": "assistant", "system": "system"}
# C0 controls (except tab/newline), DEL and C1 would move the terminal's cursor or be dropped
# silently; a random or confused model can emit them, so they are shown as visible symbols
_CONTROLS = (
    {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421} | dict.fromkeys(range(128, 160), 65533)
)


def clean(text: str) -> str:
    return text.translate(_CONTROLS)


class ChatMessage(Markdown):
    """One message of the transcript. mid is its id in the store (None until saved)."""

    DEFAULT_CSS = """
    ChatMessage {
        height: auto;
        margin: 1 0 0 0;
        padding: 0 1;
        border: round $primary;
        border-title-align: left;
        border-subtitle-align: right;
        border-subtitle-color: $text-muted;
        background: $surface;
    }
    ChatMessage.user {
        border: round $accent;
        margin-left: 4;
    }
    ChatMessage.system {
        border: round $warning 60%;
        color: $text-muted;
    }
    /* a reply has no trailing blank line inside its border */
    ChatMessage > MarkdownBlock:last-child {
        margin-bottom: 0;
    }
    """

    def __init__(self, role: str, text: str = "", mid: str | None = None, short: str = ""):
        super().__init__(clean(text), classes=role)
        self.role, self.mid = role, mid
        self.set_id(short)

    def set_id(self, short: str) -> None:
        self.border_title = ROLE_TITLES[self.role] + (f" · {short}" if short else "")


class Thinking(Collapsible):
    """A reply's thinking, above it: open while it streams, folded once the answer comes; its
    title gives its size in tokens (once known)."""

    DEFAULT_CSS = """
    Thinking {
        margin: 1 0 0 0;
        padding: 0;
        border: none;
        background: $surface;
        color: $text-muted;
    }
    Thinking > Contents {
        padding: 0 0 0 2;
    }
    """

    def __init__(self, text: str = "", tokens: int | None = None, collapsed: bool = True):
        self.text = text
        self.body = Static(clean(text), markup=False)
        super().__init__(self.body, title=self.caption(tokens), collapsed=collapsed)

    @staticmethod
    def caption(tokens: int | None) -> str:
        return "thinking" + (f" · {tokens} tok" if tokens is not None else " …")

    def append(self, text: str) -> None:
        self.text += text
        self.body.update(clean(self.text))

    def done(self, text: str, tokens: int) -> None:
        """The whole thinking (what was saved), folded, with its token count."""
        if text != self.text:
            self.text = ""
            self.append(text)
        self.title, self.collapsed = self.caption(tokens), True


class Notice(Static):
    """A one-line info or error line in the transcript (never saved)."""

    DEFAULT_CSS = """
    Notice {
        color: $text-muted;
        margin: 1 0 0 1;
    }
    Notice.error {
        color: $error;
    }
    """

    def __init__(self, text: str, error: bool = False):
        super().__init__(text, classes="error" if error else "info", markup=False)
