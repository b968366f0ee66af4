"""The conversation tree beside the transcript."""

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.reactive import var
from textual.widgets import Tree

from localkv.conversations.store import preview
from localkv.tui.widgets.message import ROLE_TITLES, clean


class BranchTree(Tree[str]):
    """The conversation tree; node data is the full message id. Enter switches to a branch."""

    DEFAULT_CSS = """
    BranchTree {
        dock: left;
        width: 40;
        border-right: vkey $primary 50%;
        background: $panel;
    }
    """
    BINDINGS = [Binding("f", "fork", "Fork here"), Binding("r", "regen", "Regenerate")]
    auto_expand = var(False)  # Enter switches branches; it must not fold the node too

    class Picked(Message):
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
