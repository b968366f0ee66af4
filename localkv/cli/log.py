"""`localkv log`: list conversations, show one, or draw its branch tree."""

import json
import shutil
import sys
from dataclasses import asdict
from datetime import datetime

import typer

from localkv.conversations.store import ConversationStore, NotFound, preview


def _local(iso: str) -> str:
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")


def _dump(obj, depth: int) -> None:
    # json nests one call per tree level, and a long chat is a chain deeper than the default limit.
    # Not indented: indentation grows with depth, so the output would grow with its square.
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * depth + 1000))
    try:
        print(json.dumps(obj, ensure_ascii=False))
    finally:
        sys.setrecursionlimit(old)


def _table(store: ConversationStore, as_json: bool) -> None:
    rows = store.list_conversations()
    if as_json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    if not rows:
        print("no conversations yet: `localkv run` starts one", file=sys.stderr)
        return
    w = max(7, *(len(r["id"]) for r in rows))
    print(f"{'ID':<{w}}  {'TITLE':<40}  {'BRANCHES':>8}  {'MESSAGES':>8}  UPDATED")
    for r in rows:
        title = preview(r["title"], 40) or "(untitled)"
        print(f"{r['id']:<{w}}  {title:<40}  {r['branches']:>8}  {r['messages']:>8}  {_local(r['updated'])}")


def _target(store: ConversationStore, ref: str) -> tuple[str, str | None]:
    """(conversation id, message id to show up to): a conversation means its latest branch."""
    try:
        cid = store.resolve_conversation(ref)
    except NotFound:
        try:
            mid = store.resolve_message(ref)
        except NotFound:
            raise NotFound(f"no conversation or message matches '{ref}'") from None
        return store.get_message(mid).conversation_id, mid
    leaf = store.latest_leaf(cid)
    return cid, leaf.id if leaf else None


def tree_lines(store: ConversationStore, cid: str) -> list[str]:
    t = store.tree(cid)
    latest = store.latest_leaf(cid)
    cols = shutil.get_terminal_size().columns
    lines = [f"conversation {t['id']}  {t['title'] or '(untitled)'}"]
    # an only child continues its parent's column; branches fan out with ├─ / └─.
    # An explicit stack, not recursion: chains can be thousands of messages deep.
    stack = [
        (n, "", "" if len(t["children"]) == 1 else ("└─ " if i == 0 else "├─ "))
        for i, n in enumerate(reversed(t["children"]))
    ]
    while stack:
        node, lead, conn = stack.pop()
        mark = " (latest)" if latest and node["full_id"] == latest.id else ""
        head = f"{lead}{conn}{node['id']} [{node['role']}] "
        lines.append(head + preview(node["preview"], max(20, cols - len(head) - len(mark) - 1)) + mark)
        body = lead + {"├─ ": "│  ", "└─ ": "   "}.get(conn, "")
        kids = node["children"]
        if len(kids) == 1:
            stack.append((kids[0], body, ""))
        else:
            stack.extend((k, body, "└─ " if i == 0 else "├─ ") for i, k in enumerate(reversed(kids)))
    return lines


def _show(store: ConversationStore, ref: str, tree: bool, as_json: bool) -> None:
    cid, mid = _target(store, ref)
    conv = store.get_conversation(cid)
    if tree:
        if as_json:
            _dump(store.tree(cid), conv["messages"])
        else:
            print("\n".join(tree_lines(store, cid)))
        return
    msgs = store.path(mid) if mid else []
    if as_json:
        print(
            json.dumps(
                [dict(asdict(m), id=store.short_id(m.id), full_id=m.id) for m in msgs], indent=2, ensure_ascii=False
            )
        )
        return
    print(f"conversation {conv['id']}  {conv['title'] or '(untitled)'}")
    for m in msgs:
        model = f"  {m.model}" if m.model else ""
        print(f"\n{store.short_id(m.id)} [{m.role}] {_local(m.created)}{model}\n{m.content}")
    if conv["branches"] > 1:
        print(
            f"(one of {conv['branches']} branches: `localkv log {conv['id']} --tree` shows them all)", file=sys.stderr
        )


def log_command(
    conversation: str | None = typer.Argument(
        None,
        metavar="ID",
        help="Conversation ID (or a unique prefix of it) to show; a message ID shows the branch ending there.",
    ),
    tree: bool = typer.Option(False, "--tree", help="Draw the branch tree, with the message IDs to pass to --from."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """List conversations, newest first; with an ID, show that conversation's latest branch (or --tree: all)."""
    with ConversationStore() as store:
        if conversation is None:
            _table(store, as_json)
        else:
            _show(store, conversation, tree, as_json)
