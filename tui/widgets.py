"""Small widgets of the chat screen: a message, a notice line, the prompt with history, the branch tree."""

from rich.text import Text
from textual.binding import Binding
from textual.message import Message as TMessage
from textual.reactive import var
from textual.widgets import Input, Markdown, Static, Tree

from localkv.conversations.store import preview

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

    def __init__(self, role: str, text: str = "", mid: str | None = None, short: str = ""):
        super().__init__(clean(text), classes=role)
        self.role, self.mid = role, mid
        self.set_id(short)

    def set_id(self, short: str) -> None:
        self.border_title = ROLE_TITLES[self.role] + (f" · {short}" if short else "")


class Notice(Static):
    """A one-line info or error line in the transcript (never saved)."""

    def __init__(self, text: str, error: bool = False):
        super().__init__(text, classes="error" if error else "info", markup=False)


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


class BranchTree(Tree[str]):
    """The conversation tree; node data is the full message id. Enter switches to a branch."""

    BINDINGS = [Binding("f", "fork", "Fork here"), Binding("r", "regen", "Regenerate")]
    auto_expand = var(False)  # Enter switches branches; it must not fold the node too

    class Picked(TMessage):
        def __init__(self, mid: str):
            super().__init__()
            self.mid = mid

    class Fork(Picked):
        """f: branch at this message."""

    class Regen(Picked):
        """r: a new sibling of this reply (or a reply to this question)."""

    def action_fork(self) -> None:
        if self.cursor_node is not None and self.cursor_node.data:
            self.post_message(self.Fork(self.cursor_node.data))

    def action_regen(self) -> None:
        if self.cursor_node is not None and self.cursor_node.data:
            self.post_message(self.Regen(self.cursor_node.data))

    def show(self, tree: dict, path: set[str], leaf: str | None) -> None:
        """Rebuild from ConversationStore.tree(). Like `localkv log --tree`, an only child continues
        its parent's column and only a fork nests, so depth grows with forks, not with turns:
        each child of a fork heads a branch, and the branch's later messages are its children.
        The current branch is bold, the message the next one goes under marked ●."""
        self.clear()
        self.root.set_label(Text(clean(tree["title"]) or "(untitled)"))
        cursor = None
        # (tree node to add to, message, heads a branch); an explicit stack: chains run thousands deep
        stack = [(self.root, n, len(tree["children"]) > 1) for n in reversed(tree["children"])]
        while stack:
            box, node, head = stack.pop()
            mid, kids = node["full_id"], node["children"]
            label = f"{ROLE_TITLES[node['role']]}: {preview(clean(node['preview']), 40)}"
            item = box.add(
                Text.assemble(
                    ("● " if mid == leaf else "", "bold"),
                    (node["id"], "dim"),
                    " ",
                    (label, "bold" if mid in path else ""),
                ),
                data=mid,
                expand=True,
            )
            if mid == leaf:
                cursor = item
            if len(kids) == 1:
                stack.append((item if head else box, kids[0], False))
            else:
                stack.extend((item, k, True) for k in reversed(kids))
        todo = list(self.root.children)
        while todo:  # a fold arrow only where there is something to fold
            node = todo.pop()
            node.allow_expand = bool(node.children)
            todo.extend(node.children)
        self.root.expand()
        if cursor is not None:
            self.call_after_refresh(self.move_cursor, cursor)
