"""Conversations as trees of messages in SQLite: any message can be forked by adding a second child."""

import json
import os
import re
import sqlite3
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from uuid import uuid4

from localkv.errors import LocalkvError
from localkv.home import NotRegularFile, home, open_regular, private_dir

ROLES = ("system", "user", "assistant")
SHORT_LEN = 7  # like git: short ids grow past this only when needed to stay unique
MIN_PREFIX = 4  # shorter prefixes would match half the database and are surely typos
_MAGIC = b"SQLite format 3\x00"
_HEX = re.compile(r"[0-9a-f]+")

# MIGRATIONS[i] takes user_version i to i + 1. Append new entries; never edit a shipped one.
MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL DEFAULT '',
        created TEXT NOT NULL,
        updated TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id),
        parent_id TEXT REFERENCES messages(id),
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        created TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT '',
        sampling TEXT,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX messages_conversation ON messages(conversation_id, created);
    CREATE INDEX messages_parent ON messages(parent_id);
    CREATE INDEX conversations_updated ON conversations(updated)
    """,
    # a thinking model's thinking, kept apart from the reply's text (the answer)
    "ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''",
]
SCHEMA_VERSION = len(MIGRATIONS)


class NotFound(LocalkvError):
    """No conversation or message has that id."""


@dataclass(slots=True)
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    created: str  # ISO 8601, UTC
    model: str = ""
    sampling: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning: str = ""  # an assistant message's thinking (a thinking model's), apart from content


_COLS = [f.name for f in fields(Message)]
_MCOLS = ", ".join("m." + c for c in _COLS)


def _now() -> str:
    # fixed-width UTC with microseconds, so text order is time order
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def preview(text: str, width: int = 60) -> str:
    return _clip(" ".join(text.split()), width)


def title_from(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return _clip(line, 60)


def _message(row) -> Message:
    m = Message(*row)
    m.sampling = json.loads(m.sampling) if m.sampling else {}
    return m


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the schema up to SCHEMA_VERSION. Call inside a write transaction."""
    v = conn.execute("PRAGMA user_version").fetchone()[0]
    for i in range(v, SCHEMA_VERSION):
        # statements one by one: executescript would commit the caller's transaction
        for stmt in filter(str.strip, MIGRATIONS[i].split(";")):
            conn.execute(stmt)
        conn.execute(f"PRAGMA user_version = {i + 1}")


class ConversationStore:
    def __init__(self, path: Path | None = None, busy_timeout: float = 5.0):
        self.db_path = Path(path) if path else home() / "conversations.db"
        self._lock = threading.RLock()  # one connection, shareable between threads
        try:
            private_dir(self.db_path.parent)
        except OSError as e:
            raise LocalkvError(
                f"cannot create {e.filename or self.db_path.parent}: {e.strerror or e}; "
                "set LOCALKV_HOME to a writable folder"
            ) from None
        self._check_files()
        try:
            self._conn = sqlite3.connect(
                self.db_path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise self._translate(e) from e
        try:
            self._open()
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- plumbing ---------------------------------------------------------------------------

    def _corrupt(self, detail: str) -> LocalkvError:
        return LocalkvError(f"conversation database {self.db_path} is corrupt: {detail} (move it aside to start fresh)")

    def _translate(self, e: sqlite3.Error) -> LocalkvError:
        code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF  # 3.11+; message text on 3.10
        msg = str(e)
        if code in (5, 6) or "locked" in msg:  # SQLITE_BUSY / SQLITE_LOCKED after the busy timeout
            return LocalkvError("conversation database is locked by another localkv process; try again")
        if code in (11, 26) or "malformed" in msg or "not a database" in msg:  # CORRUPT / NOTADB
            return self._corrupt(msg)
        return LocalkvError(f"conversation database {self.db_path}: {msg}")

    def _files(self) -> list[Path]:
        return [self.db_path, *(self.db_path.with_name(self.db_path.name + x) for x in ("-wal", "-shm"))]

    def _check_files(self) -> None:
        """Refuse foreign files before SQLite opens them, so nothing can ever write to them: the
        database must be an SQLite file (or absent), it and its -wal/-shm regular files (a FIFO
        would block). A symlink to a database is followed: where the history lives is the
        user's choice. A new database is made 0600, and SQLite gives -wal/-shm the database's
        mode; an existing one readable by others is made private: it holds every prompt."""
        for f in self._files():
            try:
                fd = open_regular(f, os.O_RDONLY | (os.O_CREAT if f == self.db_path else 0), follow=True)
            except NotRegularFile:
                raise LocalkvError(f"{f} is not a regular file: move it aside to start fresh") from None
            except OSError as e:
                raise LocalkvError(f"cannot read conversation database {f}: {e.strerror}") from e
            if fd is None:
                continue
            with open(fd, "rb") as fh:
                st = os.fstat(fd)
                if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                    with suppress(OSError):  # a read-only disk: still readable
                        os.fchmod(fd, 0o600)
                head = fh.read(len(_MAGIC)) if f == self.db_path else b""
            if head and head != _MAGIC:
                raise self._corrupt("not an SQLite database")

    @contextmanager
    def _guard(self):
        try:
            with self._lock:
                yield self._conn
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError):
            raise  # bugs in this module, not the user's database
        except sqlite3.DatabaseError as e:
            raise self._translate(e) from e

    @contextmanager
    def _write(self):
        # `with c`: commit on success, roll back on any error, so no half-written change survives
        with self._guard() as c, c:
            # take the write lock up front: a read that later upgrades can fail without waiting
            c.execute("BEGIN IMMEDIATE")
            yield c

    def _all(self, sql: str, args=()) -> list:
        with self._guard() as c:
            return c.execute(sql, args).fetchall()

    def _open(self) -> None:
        # one statement, one snapshot: a concurrent first-time migration is seen whole or not at all
        v, tables = self._all(
            "SELECT (SELECT user_version FROM pragma_user_version), (SELECT count(*) FROM sqlite_master)"
        )[0]
        if v > SCHEMA_VERSION:
            raise LocalkvError(
                f"conversation database {self.db_path} has schema version {v}, newer than this "
                f"localkv understands ({SCHEMA_VERSION}); upgrade localkv"
            )
        if v == 0 and tables:
            raise LocalkvError(f"{self.db_path} is not a localkv conversation database (move it aside to start fresh)")
        with self._guard() as c:
            c.execute("PRAGMA journal_mode = WAL")  # readers never block the writer, nor it them
            c.execute("PRAGMA foreign_keys = ON")
        if v < SCHEMA_VERSION:
            with self._write() as c:
                migrate(c)  # re-reads the version under the lock: another process may have migrated

    # --- ids ----------------------------------------------------------------------------------

    def short_id(self, id: str) -> str:
        # the shortest prefix (>= SHORT_LEN) that no other conversation or message id shares;
        # sorted neighbours are the only ids that can share the longest prefix
        n = 0
        with self._guard() as c:
            for table in ("conversations", "messages"):
                for op, order in (("<", "DESC"), (">", "ASC")):
                    row = c.execute(
                        f"SELECT id FROM {table} WHERE id {op} ? ORDER BY id {order} LIMIT 1", (id,)
                    ).fetchone()
                    if row:
                        n = max(n, len(os.path.commonprefix([id, row[0]])))
        return id[: max(SHORT_LEN, n + 1)]

    def _resolve(self, table: str, noun: str, prefix: str) -> str:
        p = prefix.strip().rstrip(".").lower()  # accept ids pasted from "ab12cd3..." error text
        if len(p) < MIN_PREFIX:
            raise LocalkvError(f"{noun} id '{prefix}' is too short: give at least {MIN_PREFIX} characters")
        ids = []
        if _HEX.fullmatch(p):  # ids are lowercase hex, so every match sorts in [p, p + "g")
            ids = [
                r[0] for r in self._all(f"SELECT id FROM {table} WHERE id >= ? AND id < ? ORDER BY id", (p, p + "g"))
            ]
        if not ids:
            raise NotFound(f"no {noun} matches '{prefix}'")
        if len(ids) > 1:
            shown = ", ".join(self.short_id(i) + "..." for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
            raise LocalkvError(f"'{prefix}' is ambiguous: matches {len(ids)} {noun}s ({shown})")
        return ids[0]

    def resolve_conversation(self, prefix: str) -> str:
        return self._resolve("conversations", "conversation", prefix)

    def resolve_message(self, prefix: str) -> str:
        return self._resolve("messages", "message", prefix)

    # --- writes -------------------------------------------------------------------------------

    def new_conversation(self, model: str, title: str = "") -> str:
        cid = uuid4().hex
        with self._write() as c:
            now = _now()
            c.execute(
                "INSERT INTO conversations (id, title, created, updated, model) VALUES (?, ?, ?, ?, ?)",
                (cid, title, now, now, model),
            )
        return cid

    def add_message(
        self,
        conversation_id: str,
        parent_id: str | None,
        role: str,
        content: str,
        model: str = "",
        sampling: dict | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        reasoning: str = "",
    ) -> str:
        if role not in ROLES:
            raise LocalkvError(f"invalid role {role!r}: must be one of {', '.join(ROLES)}")
        mid = uuid4().hex
        with self._write() as c:
            if not c.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone():
                raise NotFound(f"no conversation {conversation_id}")
            if parent_id is not None:
                row = c.execute("SELECT conversation_id FROM messages WHERE id = ?", (parent_id,)).fetchone()
                if row is None:
                    raise NotFound(f"no message {parent_id}")
                if row[0] != conversation_id:
                    raise LocalkvError(f"message {parent_id[:SHORT_LEN]} belongs to another conversation")
            now = _now()  # under the write lock, so creation order matches commit order
            c.execute(
                f"INSERT INTO messages ({', '.join(_COLS)}) VALUES ({', '.join('?' * len(_COLS))})",
                (
                    mid,
                    conversation_id,
                    parent_id,
                    role,
                    content,
                    now,
                    model,
                    json.dumps(sampling, sort_keys=True) if sampling else None,
                    prompt_tokens,
                    completion_tokens,
                    reasoning,
                ),
            )
            c.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            if role == "user":
                c.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title = ''",
                    (title_from(content), conversation_id),
                )
        return mid

    # --- reads --------------------------------------------------------------------------------

    def get_message(self, id: str) -> Message:
        rows = self._all(f"SELECT {_MCOLS} FROM messages m WHERE m.id = ?", (id,))
        if not rows:
            raise NotFound(f"no message {id}")
        return _message(rows[0])

    def path(self, message_id: str) -> list[Message]:
        rows = self._all(
            f"""
            WITH RECURSIVE up(id, depth) AS (
                SELECT id, 0 FROM messages WHERE id = ?
                UNION ALL
                SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
                WHERE m.parent_id IS NOT NULL)
            SELECT {_MCOLS} FROM messages m JOIN up ON m.id = up.id ORDER BY up.depth DESC""",
            (message_id,),
        )
        if not rows:
            raise NotFound(f"no message {message_id}")
        return [_message(r) for r in rows]

    def children(self, message_id: str) -> list[Message]:
        rows = self._all(
            f"SELECT {_MCOLS} FROM messages m WHERE m.parent_id = ? ORDER BY m.created, m.rowid", (message_id,)
        )
        return [_message(r) for r in rows]

    def leaves(self, conversation_id: str) -> list[Message]:
        rows = self._all(
            f"""SELECT {_MCOLS} FROM messages m WHERE m.conversation_id = ?
                             AND NOT EXISTS (SELECT 1 FROM messages k WHERE k.parent_id = m.id)
                             ORDER BY m.created, m.rowid""",
            (conversation_id,),
        )
        return [_message(r) for r in rows]

    def latest_leaf(self, conversation_id: str) -> Message | None:
        leaves = self.leaves(conversation_id)
        return leaves[-1] if leaves else None

    def latest_conversation(self) -> str | None:
        rows = self._all("SELECT id FROM conversations ORDER BY updated DESC, rowid DESC LIMIT 1")
        return rows[0][0] if rows else None

    def _conversations(self, where: str = "", args=()) -> list[dict]:
        rows = self._all(
            f"""
            SELECT c.id, c.title, c.updated, c.model,
                (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id),
                (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id
                    AND NOT EXISTS (SELECT 1 FROM messages k WHERE k.parent_id = m.id))
            FROM conversations c {where} ORDER BY c.updated DESC, c.rowid DESC""",
            args,
        )
        return [
            {
                "id": self.short_id(cid),
                "full_id": cid,
                "title": title,
                "messages": n,
                "branches": b,
                "updated": updated,
                "model": model,
            }
            for cid, title, updated, model, n, b in rows
        ]

    def list_conversations(self) -> list[dict]:
        return self._conversations()

    def get_conversation(self, conversation_id: str) -> dict:
        rows = self._conversations("WHERE c.id = ?", (conversation_id,))
        if not rows:
            raise NotFound(f"no conversation {conversation_id}")
        return rows[0]

    def tree(self, conversation_id: str) -> dict:
        conv = self.get_conversation(conversation_id)
        top = {
            "id": conv["id"],
            "full_id": conversation_id,
            "title": conv["title"],
            "model": conv["model"],
            "children": [],
        }
        rows = self._all(
            f"SELECT {_MCOLS} FROM messages m WHERE m.conversation_id = ? ORDER BY m.created, m.rowid",
            (conversation_id,),
        )
        msgs = [_message(r) for r in rows]
        # built without recursion: a long chat is a chain thousands of messages deep
        nodes = {
            m.id: {
                "id": self.short_id(m.id),
                "full_id": m.id,
                "role": m.role,
                "preview": preview(m.content),
                "children": [],
            }
            for m in msgs
        }
        for m in msgs:
            (nodes[m.parent_id] if m.parent_id else top)["children"].append(nodes[m.id])
        return top
