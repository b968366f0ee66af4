"""The conversation tree store and `localkv log`: no model, a fresh database per test."""

import contextlib
import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from localkv.cli.log import log_command
from localkv.conversations.store import MIGRATIONS, SCHEMA_VERSION, ConversationStore
from localkv.errors import LocalkvError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def db(tmp_path):
    return tmp_path / "conversations.db"


@pytest.fixture()
def st(db):
    with ConversationStore(db) as s:
        yield s


def forked(st):
    """system -> user -> {assistant a1 -> user u2 -> assistant a3, assistant a2}: two branches."""
    cid = st.new_conversation("tiny")
    sys_ = st.add_message(cid, None, "system", "Be brief.")
    u1 = st.add_message(cid, sys_, "user", "What is KV caching?\nExplain.")
    a1 = st.add_message(
        cid,
        u1,
        "assistant",
        "Keys and values are kept.",
        model="tiny",
        sampling={"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1, "max_tokens": 64},
        prompt_tokens=12,
        completion_tokens=5,
    )
    u2 = st.add_message(cid, a1, "user", "More?")
    a3 = st.add_message(cid, u2, "assistant", "Pages of blocks.")
    a2 = st.add_message(cid, u1, "assistant", "It caches attention state.")
    return cid, dict(sys=sys_, u1=u1, a1=a1, u2=u2, a3=a3, a2=a2)


def ids(msgs):
    return [m.id for m in msgs]


def test_tree_path_children_leaves(st):
    cid, m = forked(st)
    assert ids(st.path(m["a3"])) == [m["sys"], m["u1"], m["a1"], m["u2"], m["a3"]]
    assert ids(st.path(m["sys"])) == [m["sys"]]
    assert ids(st.children(m["u1"])) == [m["a1"], m["a2"]]
    assert st.children(m["a3"]) == []
    assert ids(st.leaves(cid)) == [m["a3"], m["a2"]]
    got = st.get_message(m["a1"])
    assert (got.conversation_id, got.parent_id, got.role, got.content, got.model) == (
        cid,
        m["u1"],
        "assistant",
        "Keys and values are kept.",
        "tiny",
    )
    assert got.sampling == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1, "max_tokens": 64}
    assert (got.prompt_tokens, got.completion_tokens) == (12, 5)
    assert st.get_message(m["sys"]).sampling == {}


def test_bad_parent_role_and_unknown_ids_refused(st):
    cid, m = forked(st)
    other = st.new_conversation("tiny")
    with pytest.raises(LocalkvError, match="another conversation"):
        st.add_message(other, m["u1"], "assistant", "x")
    with pytest.raises(LocalkvError, match="no message"):
        st.add_message(cid, "f" * 32, "user", "x")
    with pytest.raises(LocalkvError, match="invalid role"):
        st.add_message(cid, m["a3"], "tool", "x")
    with pytest.raises(LocalkvError, match="no conversation"):
        st.add_message("0" * 32, None, "user", "x")
    with pytest.raises(LocalkvError, match="no message"):
        st.get_message("0" * 32)
    assert len(st.leaves(cid)) == 2 and st.leaves(other) == []  # refused writes left nothing behind


def test_latest_conversation_and_leaf(st):
    assert st.latest_conversation() is None
    first, m = forked(st)
    assert st.latest_leaf(first).id == m["a2"]  # newest leaf, though on the older branch
    second = st.new_conversation("tiny")
    assert st.latest_conversation() == second and st.latest_leaf(second) is None
    st.add_message(first, m["a2"], "user", "continue")
    assert st.latest_conversation() == first  # adding a message makes a conversation the latest


def test_title_from_first_user_message(st):
    cid = st.new_conversation("tiny")
    st.add_message(cid, None, "system", "System prompt is not a title")
    u = st.add_message(cid, None, "user", "\n  First line of the question  \nsecond line")
    st.add_message(cid, u, "user", "a later user message does not retitle")
    assert st.get_conversation(cid)["title"] == "First line of the question"
    long_ = st.new_conversation("tiny")
    st.add_message(long_, None, "user", "word " * 40)
    t = st.get_conversation(long_)["title"]
    assert len(t) <= 60 and t.endswith("…") and t.startswith("word word")
    named = st.new_conversation("tiny", title="Chosen")
    st.add_message(named, None, "user", "hello")
    assert st.get_conversation(named)["title"] == "Chosen"


def test_short_ids_unique_and_resolvable(st):
    cid, m = forked(st)
    # 7 hex chars, unique among these: longer if needed
    for full in [cid, *m.values()]:
        s = st.short_id(full)
        assert len(s) >= 7 and full.startswith(s)
    assert st.resolve_conversation(st.short_id(cid)) == cid
    assert st.resolve_message(st.short_id(m["a1"])) == m["a1"]
    assert st.resolve_message(m["a1"]) == m["a1"]
    assert st.resolve_message(m["a1"][:7].upper() + "...") == m["a1"]  # pasted from an error message


def _insert_ids(db, conv_ids, msg_ids=()):
    # ids chosen to collide in their first characters; random uuids would not
    con = sqlite3.connect(db)
    with con:
        for c in conv_ids:
            con.execute(
                "INSERT INTO conversations VALUES (?, '', '2024-01-01T00:00:00.000000+00:00', "
                "'2024-01-01T00:00:00.000000+00:00', '')",
                (c,),
            )
        for i in msg_ids:
            con.execute(
                "INSERT INTO messages (id, conversation_id, role, content, created) VALUES "
                "(?, ?, 'user', 'x', '2024-01-01T00:00:00.000000+00:00')",
                (i, conv_ids[0]),
            )
    con.close()


def test_short_id_grows_past_seven_when_needed(st, db):
    a, b = "abcdef0123" + "0" * 22, "abcdef0129" + "0" * 22
    _insert_ids(db, [a, b], ["abcdef01ff" + "1" * 22])
    assert st.short_id(a) == "abcdef0123" and st.short_id(b) == "abcdef0129"
    assert st.short_id("abcdef01ff" + "1" * 22) == "abcdef01f"  # unique across both tables
    assert st.resolve_conversation("abcdef0123") == a


def test_ambiguous_unknown_and_short_prefixes(st, db):
    conv = ["ab12" + c * 28 for c in "123"]
    _insert_ids(db, conv, ["cd34" + c * 28 for c in "45"])
    with pytest.raises(LocalkvError) as e:
        st.resolve_conversation("ab12")
    assert str(e.value).startswith("'ab12' is ambiguous: matches 3 conversations (ab12111...")
    with pytest.raises(LocalkvError, match=r"'cd34' is ambiguous: matches 2 messages \(cd34444\.\.\., cd34555"):
        st.resolve_message("cd34")
    with pytest.raises(LocalkvError, match="no conversation matches 'beef'"):
        st.resolve_conversation("beef")
    with pytest.raises(LocalkvError, match="no message matches 'zzzz'"):
        st.resolve_message("zzzz")
    with pytest.raises(LocalkvError, match="no conversation matches 'cd34'"):
        st.resolve_conversation("cd34")  # a message prefix is not a conversation
    with pytest.raises(LocalkvError, match="too short"):
        st.resolve_conversation("ab1")


def test_schema_version_wal_and_reopen(db):
    with ConversationStore(db) as s:
        cid, m = forked(s)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    with ConversationStore(db) as s:  # reopening migrates nothing and keeps everything
        assert ids(s.path(m["a3"]))[-1] == m["a3"] and s.latest_conversation() == cid


def test_a_version_1_database_gains_the_reasoning_column_and_loses_nothing(db):
    con = sqlite3.connect(db)  # the schema as localkv wrote it before thinking models
    con.executescript(MIGRATIONS[0] + ";PRAGMA user_version = 1;")
    con.execute("INSERT INTO conversations VALUES ('c0ffee00', 'old', '2024', '2024', 'tiny')")
    row = ("abcdef01", "c0ffee00", None, "assistant", "Paris.", "2024", "tiny", '{"seed": 1}', 5, 2)
    con.execute("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
    con.commit()
    con.close()
    with ConversationStore(db) as s:
        old = s.get_message("abcdef01")
        assert (old.content, old.sampling, old.completion_tokens, old.reasoning) == ("Paris.", {"seed": 1}, 2, "")
        new = s.add_message("c0ffee00", old.id, "assistant", "Lyon.", reasoning="The second city.")
        assert s.get_message(new).reasoning == "The second city."
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 2
    con.close()


def test_newer_schema_refused_untouched(db):
    ConversationStore(db).close()
    con = sqlite3.connect(db)
    con.execute("PRAGMA user_version = 7")
    con.close()
    before = db.read_bytes()
    with pytest.raises(LocalkvError, match="schema version 7, newer"):
        ConversationStore(db)
    assert db.read_bytes() == before


def test_foreign_sqlite_file_refused(db):
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE notes (x)")
    con.close()
    before = db.read_bytes()
    with pytest.raises(LocalkvError, match="not a localkv conversation database"):
        ConversationStore(db)
    assert db.read_bytes() == before


def test_locked_database_gives_clear_error_and_loses_nothing(db):
    with ConversationStore(db) as s:
        cid, m = forked(s)
    s = ConversationStore(db, busy_timeout=0.1)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    other.execute(
        "INSERT INTO conversations VALUES ('e' || lower(hex(randomblob(15))), 'other', '2000-01-01', '2000-01-01', '')"
    )
    with pytest.raises(LocalkvError, match="^conversation database is locked by another localkv process; try again$"):
        s.add_message(cid, m["a3"], "user", "blocked")
    with pytest.raises(LocalkvError, match="locked"):
        s.new_conversation("tiny")
    assert len(s.list_conversations()) == 1  # reads go on under WAL
    other.execute("COMMIT")
    other.close()
    s.add_message(cid, m["a3"], "user", "after")
    assert [c["title"] for c in s.list_conversations()] == ["What is KV caching?", "other"]
    assert [x.content for x in s.path(s.latest_leaf(cid).id)][-2:] == ["Pages of blocks.", "after"]
    assert "blocked" not in [x.content for x in s.leaves(cid)]
    s.close()


def test_random_bytes_file_is_corrupt_and_untouched(db):
    junk = os.urandom(8192)
    db.write_bytes(junk)
    with pytest.raises(LocalkvError) as e:
        ConversationStore(db)
    assert str(e.value) == (
        f"conversation database {db} is corrupt: not an SQLite database (move it aside to start fresh)"
    )
    assert db.read_bytes() == junk
    assert sorted(p.name for p in db.parent.iterdir()) == ["conversations.db"]  # no -wal/-shm left


def test_damaged_sqlite_file_is_corrupt_and_untouched(db):
    with ConversationStore(db) as s:
        forked(s)
    data = bytearray(db.read_bytes())
    data[100:4096] = b"\xa5" * 3996  # page 1 past the header: the schema's b-tree
    db.write_bytes(bytes(data))
    with pytest.raises(LocalkvError, match=r"is corrupt: .*\(move it aside to start fresh\)"):
        ConversationStore(db).list_conversations()
    assert db.read_bytes() == bytes(data)


def test_concurrent_writers_threads(db):
    ConversationStore(db).close()
    errors = []

    def writer(tag):
        try:
            with ConversationStore(db) as s:
                cid = s.new_conversation("tiny")
                parent = None
                for i in range(40):
                    parent = s.add_message(cid, parent, "user", f"{tag} {i}")
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with ConversationStore(db) as s:
        rows = s.list_conversations()
        assert sorted(r["messages"] for r in rows) == [40, 40]
        assert sorted(r["title"] for r in rows) == ["a 0", "b 0"]
        assert all(len(s.path(s.latest_leaf(r["full_id"]).id)) == 40 for r in rows)


def test_shared_store_across_threads(st):
    cid = st.new_conversation("tiny")
    threads = [
        threading.Thread(target=lambda: [st.add_message(cid, None, "user", "x") for _ in range(25)]) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(st.leaves(cid)) == 75


def test_concurrent_writers_processes(db):
    with ConversationStore(db) as s:
        cid = s.new_conversation("tiny")
        root = s.add_message(cid, None, "user", "root")
    code = (
        "import sys; from localkv.conversations.store import ConversationStore as S; s = S(sys.argv[1]); "
        "[s.add_message(sys.argv[2], sys.argv[3], 'assistant', 'p%d' % i) for i in range(30)]"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(db), cid, root], env=env) for _ in range(2)]
    with ConversationStore(db) as s:
        for i in range(30):
            s.add_message(cid, root, "assistant", f"t{i}")
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        assert len(s.children(root)) == 90 and s.get_conversation(cid)["branches"] == 90


# --- files that are not what they seem, privacy, leftovers ---------------------------------------


def within(seconds: float, fn, fifo: Path):
    """fn() on a thread: the test fails, instead of hanging, if it blocks on the FIFO."""
    out = {}

    def call():
        try:
            out["v"] = fn()
        except Exception as e:  # handed to the test below
            out["e"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        with contextlib.suppress(OSError):  # let the blocked open() go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("blocked on a FIFO")
    if "e" in out:
        raise out["e"]
    return out.get("v")


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_database_and_its_folder_are_private(tmp_path):
    home = tmp_path / "new" / "home"
    with ConversationStore(home / "conversations.db") as s:
        forked(s)
        for name in ("conversations.db", "conversations.db-wal", "conversations.db-shm"):
            assert mode(home / name) == 0o600, name
    assert mode(home) == mode(tmp_path / "new") == 0o700


def test_world_readable_database_is_made_private(db):
    ConversationStore(db).close()
    os.chmod(db, 0o644)
    other = sqlite3.connect(db, isolation_level=None)  # an open writer: -wal and -shm exist, 0644 like the db
    other.execute("INSERT INTO conversations VALUES ('ab', 't', '2000-01-01', '2000-01-01', '')")
    assert mode(Path(f"{db}-wal")) == 0o644
    with ConversationStore(db) as s:
        assert [mode(Path(f"{db}{x}")) for x in ("", "-wal", "-shm")] == [0o600] * 3
        assert [c["full_id"] for c in s.list_conversations()] == ["ab"]
    other.close()


@pytest.mark.parametrize("which", ["", "-wal", "-shm"])
def test_fifo_in_place_of_the_database_is_refused_at_once(db, which):
    if which:
        ConversationStore(db).close()
    os.mkfifo(f"{db}{which}")
    with pytest.raises(LocalkvError) as e:
        within(5, lambda: ConversationStore(db), Path(f"{db}{which}"))
    assert str(e.value) == f"{db}{which} is not a regular file: move it aside to start fresh"


def test_symlinked_database_is_followed(db, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    real = tmp_path / "elsewhere" / "conversations.db"
    with ConversationStore(real) as s:
        cid = s.new_conversation("tiny")
    db.symlink_to(real)  # the user's choice: their history kept on another disk
    with ConversationStore(db) as s:
        assert s.latest_conversation() == cid


def test_unwritable_folder_is_one_clear_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(LocalkvError) as e:
        ConversationStore(tmp_path / "afile" / "home" / "conversations.db")
    home = tmp_path / "afile" / "home"
    assert str(e.value) == f"cannot create {home}: Not a directory; set LOCALKV_HOME to a writable folder"


def test_a_killed_writer_leaves_nothing_behind(db):
    # SQLite's -wal and -shm are the only files the store writes beside the database; a writer
    # killed mid-way leaves them, and the next open replays and then removes them
    code = (
        "import os, sys; from localkv.conversations.store import ConversationStore as S; s = S(sys.argv[1]); "
        "c = s.new_conversation('tiny'); s.add_message(c, None, 'user', 'kept'); os._exit(9)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", code, str(db)], env=env, timeout=60).returncode == 9
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name, f"{db.name}-shm", f"{db.name}-wal"]
    with ConversationStore(db) as s:
        assert [m.content for m in s.leaves(s.latest_conversation())] == ["kept"]
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]


# --- localkv log ---------------------------------------------------------------------------------


@pytest.fixture()
def cli(db, monkeypatch):
    monkeypatch.setenv("LOCALKV_HOME", str(db.parent))
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("log")(log_command)
    app.command("other")(lambda: None)  # two commands, so "log" is a real subcommand as in localkv

    def invoke(*args):
        r = CliRunner().invoke(app, ["log", *args])
        if r.exception and not isinstance(r.exception, SystemExit):
            raise r.exception
        return r

    return invoke


def test_log_table_and_json(cli, db):
    with ConversationStore(db) as s:
        old, m = forked(s)
        new = s.new_conversation("other-model", title="Second chat")
        s.add_message(new, None, "user", "hi")
        short_old, short_new = s.short_id(old), s.short_id(new)
    out = cli().stdout.splitlines()
    assert out[0].split() == ["ID", "TITLE", "BRANCHES", "MESSAGES", "UPDATED"]
    assert out[1].split()[:5] == [short_new, "Second", "chat", "1", "1"]  # newest first
    assert out[2].startswith(short_old) and "What is KV caching?" in out[2]
    assert out[2].split()[-4:-2] == ["2", "6"]  # branches, messages
    rows = json.loads(cli("--json").stdout)
    assert [r["full_id"] for r in rows] == [new, old]
    assert set(rows[0]) == {"id", "full_id", "title", "messages", "branches", "updated", "model"}
    assert (rows[1]["id"], rows[1]["branches"], rows[1]["messages"], rows[1]["model"]) == (short_old, 2, 6, "tiny")


def test_log_empty(cli):
    r = cli()
    assert r.exit_code == 0 and r.stdout == "" and "no conversations yet" in r.stderr
    assert json.loads(cli("--json").stdout) == []


def test_log_tree_text(cli, db):
    with ConversationStore(db) as s:
        cid, m = forked(s)
        sid = {k: s.short_id(v) for k, v in m.items()}
    out = cli(cid[:7], "--tree").stdout.splitlines()
    assert out[1:] == [
        f"{sid['sys']} [system] Be brief.",
        f"{sid['u1']} [user] What is KV caching? Explain.",
        f"├─ {sid['a1']} [assistant] Keys and values are kept.",
        f"│  {sid['u2']} [user] More?",
        f"│  {sid['a3']} [assistant] Pages of blocks.",
        f"└─ {sid['a2']} [assistant] It caches attention state. (latest)",
    ]
    assert out[0].startswith("conversation ") and "What is KV caching?" in out[0]


def test_log_tree_json_nested(cli, db):
    with ConversationStore(db) as s:
        cid, m = forked(s)
    t = json.loads(cli(cid[:8], "--tree", "--json").stdout)
    assert t["full_id"] == cid and len(t["children"]) == 1
    u1 = t["children"][0]["children"][0]
    assert (u1["full_id"], u1["role"], u1["preview"]) == (m["u1"], "user", "What is KV caching? Explain.")
    assert [c["full_id"] for c in u1["children"]] == [m["a1"], m["a2"]]
    assert set(u1) == {"id", "full_id", "role", "preview", "children"}
    assert u1["children"][0]["children"][0]["children"][0]["full_id"] == m["a3"]


def test_log_shows_latest_branch_or_the_branch_of_a_message(cli, db):
    with ConversationStore(db) as s:
        cid, m = forked(s)
        a3 = s.short_id(m["a3"])
    r = cli(cid[:7])
    assert "It caches attention state." in r.stdout and "Pages of blocks." not in r.stdout
    assert "one of 2 branches" in r.stderr
    r = cli(a3)  # a message id shows the branch that ends there
    assert "Pages of blocks." in r.stdout and "It caches attention state." not in r.stdout
    msgs = json.loads(cli(a3, "--json").stdout)
    assert [x["full_id"] for x in msgs] == [m["sys"], m["u1"], m["a1"], m["u2"], m["a3"]]
    assert msgs[2]["sampling"]["top_k"] == 40 and msgs[2]["parent_id"] == m["u1"]


def test_log_unknown_id_is_one_line_error(cli, db):
    ConversationStore(db).close()
    with pytest.raises(LocalkvError, match="no conversation or message matches 'beef'"):
        cli("beef")


def test_log_deep_chain(cli, db):
    # a long chat is one chain: no recursion limit, no indentation creep
    with ConversationStore(db) as s:
        cid, parent = s.new_conversation("tiny"), None
        for i in range(1500):
            parent = s.add_message(cid, parent, "user" if i % 2 == 0 else "assistant", f"m{i}")
    lines = cli(cid[:8], "--tree").stdout.splitlines()
    assert len(lines) == 1501 and lines[-1].split()[1:] == ["[assistant]", "m1499", "(latest)"]
    out = cli(cid[:8], "--tree", "--json").stdout
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # json.loads nests a Python call per level too
    try:
        t = json.loads(out)
    finally:
        sys.setrecursionlimit(old)
    depth = 0
    while t["children"]:
        t, depth = t["children"][0], depth + 1
    assert depth == 1500 and t["preview"] == "m1499"


def test_log_help_has_docstring(cli):
    r = cli("--help")
    assert "List conversations" in r.stdout and "--tree" in r.stdout
