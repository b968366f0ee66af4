"""run/fork/log/cache from the command line: the conversation tree and the prefix cache."""

import json

import pytest
from test_cli import assert_one_line_error, localkv

from tiny_model import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("conv") / "tiny.gguf", ctx=256))


def run_json(*args):
    p = localkv(*args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_run_saves_and_continue_extends_the_same_conversation(tiny):
    first = run_json("run", "hello", "-m", tiny, "-n", "3", "--ignore-eos", "-s", "be brief")
    second = run_json("run", "-c", "again", "-m", tiny, "-n", "3", "--ignore-eos")
    assert second["conversation_id"] == first["conversation_id"]
    assert second["cached_tokens"] > 0  # the first turn's blocks are reused from the disk tier
    third = run_json("run", "--cid", first["conversation_id"], "more", "-m", tiny, "-n", "2", "--ignore-eos")
    rows = run_json("log")
    assert len(rows) == 1 and rows[0]["messages"] == 7 and third["conversation_id"] == rows[0]["id"]
    run_json("run", "unsaved", "-m", tiny, "-n", "2", "--no-save")
    assert len(run_json("log")) == 1


def test_fork_saves_sibling_branches_that_share_kv(tiny):
    out = run_json("fork", "pick one", "-b", "3", "-m", tiny, "-n", "20", "--ignore-eos", "-t", "50", "--seed", "4")
    assert len(out["branches"]) == 3 and all(b["completion_tokens"] == 20 for b in out["branches"])
    kv = out["kv"]
    assert kv["blocks_used"] < kv["blocks_unshared"] and kv["token_slots_used"] == 16 * kv["blocks_used"]
    tree = run_json("log", out["conversation_id"], "--tree")
    user = tree["children"][0]
    assert user["role"] == "user" and [c["id"] for c in user["children"]] == [b["id"] for b in out["branches"]]
    again = run_json("fork", "--from", out["branches"][0]["id"], "-b", "2", "-m", tiny, "-n", "5", "--ignore-eos")
    assert again["conversation_id"] == out["conversation_id"]
    user = run_json("log", out["conversation_id"], "--tree")["children"][0]
    assert len(user["children"]) == 5  # re-sampled replies are siblings of the first three


def test_fork_text_output_ends_with_the_memory_line(tiny):
    p = localkv("fork", "x", "-b", "2", "-m", tiny, "-n", "4", "--ignore-eos", "--no-save")
    assert p.returncode == 0 and "--- branch 2/2 ---" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("kv: ")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["fork", "x", "-b", "0"], "invalid --branches"),
        (["fork", "x", "-b", "500", "--kv-mem", "2MiB"], "500 branches"),
        (["run", "x", "--cid", "zzzzzzz"], "no conversation matches"),
        (["fork", "--from", "abcdef1", "-b", "2"], "no message matches"),
        (["run", "x", "-c"], "no saved conversation"),
        (["run", "x", "-c", "--cid", "abcd"], "only one of"),
    ],
)
def test_bad_conversation_input(tiny, args, needle):
    assert_one_line_error(localkv(*args, "-m", tiny), needle)


def test_corrupt_database_is_reported_and_left_alone(tiny, private_home):
    private_home.mkdir(parents=True, exist_ok=True)
    db = private_home / "conversations.db"
    db.write_bytes(b"definitely not sqlite" * 10)
    before = db.read_bytes()
    assert_one_line_error(localkv("run", "x", "-m", tiny), "corrupt")
    assert db.read_bytes() == before
    assert localkv("run", "x", "-m", tiny, "-n", "1", "--no-save").returncode == 0  # still usable without saving


def test_cache_commands_and_no_cache(tiny):
    run_json("run", "a prompt long enough to fill more than one block of sixteen tokens", "-m", tiny, "-n", "1")
    stats = run_json("cache", "stats")
    assert stats["entries"] > 0 and stats["bytes"] > 0
    again = run_json(
        "run", "a prompt long enough to fill more than one block of sixteen tokens", "-m", tiny, "-n", "1", "--no-cache"
    )
    assert again["cached_tokens"] == 0
    p = localkv("cache", "clear")
    assert p.returncode == 0 and "removed" in p.stdout
    assert run_json("cache", "stats")["entries"] == 0
