"""The conversation tree in a bare host app, over a real ConversationStore."""

import pytest
from textual.app import App, ComposeResult

from localkv.conversations.store import ConversationStore
from localkv.tui.widgets.branch_tree import BranchTree


class _Host(App):
    def __init__(self):
        super().__init__()
        self.picked: list[tuple[str, str]] = []

    def compose(self) -> ComposeResult:
        yield BranchTree("conversation")

    def on_branch_tree_fork(self, event: BranchTree.Fork) -> None:
        self.picked.append(("fork", event.mid))

    def on_branch_tree_regen(self, event: BranchTree.Regen) -> None:
        self.picked.append(("regen", event.mid))


@pytest.fixture
def convo():
    """hello -> (hi, hey -> more -> ok): two replies to one question, and a chain under the second."""
    st = ConversationStore()
    cid = st.new_conversation("tiny-test")
    ids = {"hello": st.add_message(cid, None, "user", "hello")}
    ids["hi"] = st.add_message(cid, ids["hello"], "assistant", "hi")
    ids["hey"] = st.add_message(cid, ids["hello"], "assistant", "hey\x1b[2J")
    ids["more"] = st.add_message(cid, ids["hey"], "user", "more")
    ids["ok"] = st.add_message(cid, ids["more"], "assistant", "ok")
    return st, cid, ids


def outline(node, depth=0):
    """(depth, label) of every node under `node`, in order."""
    out = []
    for child in node.children:
        out.append((depth, str(child.label)))
        out.extend(outline(child, depth + 1))
    return out


async def shown(pilot, convo, leaf="ok"):
    st, cid, ids = convo
    tree = pilot.app.query_one(BranchTree)
    path = {m.id for m in st.path(ids[leaf])}
    tree.show(st.tree(cid), path, ids[leaf])
    await pilot.pause()
    return tree, ids, st.short_id


@pytest.mark.asyncio
async def test_only_forks_nest_and_the_leaf_is_marked(convo):
    async with _Host().run_test(size=(80, 20)) as pilot:
        tree, ids, short = await shown(pilot, convo)
        assert str(tree.root.label) == "hello"
        assert outline(tree.root) == [
            (0, f"{short(ids['hello'])} you: hello"),
            (1, f"{short(ids['hi'])} assistant: hi"),
            (1, f"{short(ids['hey'])} assistant: hey␛[2J"),  # a control character is shown, not sent
            (2, f"{short(ids['more'])} you: more"),  # a chain continues its branch's column
            (2, f"● {short(ids['ok'])} assistant: ok"),
        ]


@pytest.mark.asyncio
async def test_the_current_branch_is_bold_and_the_cursor_on_the_leaf(convo):
    async with _Host().run_test(size=(80, 20)) as pilot:
        tree, ids, _ = await shown(pilot, convo, leaf="hi")
        await pilot.pause()
        bold = {n.data for n in _all(tree.root) if n.data and _is_bold(n.label)}
        assert bold == {ids["hello"], ids["hi"]}
        assert tree.cursor_node.data == ids["hi"]


@pytest.mark.asyncio
async def test_fold_arrows_only_where_there_is_something_to_fold(convo):
    async with _Host().run_test(size=(80, 20)) as pilot:
        tree, ids, _ = await shown(pilot, convo)
        folds = {n.data for n in _all(tree.root) if n.data and n.allow_expand}
        assert folds == {ids["hello"], ids["hey"]}


@pytest.mark.asyncio
async def test_f_and_r_post_the_message_under_the_cursor(convo):
    app = _Host()
    async with app.run_test(size=(80, 20)) as pilot:
        tree, ids, _ = await shown(pilot, convo, leaf="hi")
        tree.focus()
        await pilot.press("f", "r")
        tree.move_cursor(tree.root)
        await pilot.press("f", "r")  # the root is no message: nothing to pick
        assert app.picked == [("fork", ids["hi"]), ("regen", ids["hi"])]


@pytest.mark.asyncio
async def test_enter_selects_without_folding(convo):
    app = _Host()
    async with app.run_test(size=(80, 20)) as pilot:
        tree, ids, _ = await shown(pilot, convo)
        node = next(n for n in _all(tree.root) if n.data == ids["hey"])
        tree.focus()
        tree.move_cursor(node)
        await pilot.press("enter")
        assert node.is_expanded


def _all(node):
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


def _is_bold(label) -> bool:
    """Whether the message's text (the label's last part) is bold."""
    return label.spans[-1].style == "bold"
