"""`localkv chat`: the whole ChatApp driven by Pilot on a tiny random model (fixtures in conftest.py).
Each command's own cases are in test_commands.py, the worker's messages in test_worker.py, and
each widget in its own test module."""

import asyncio
import re
import time
from dataclasses import replace

import pytest

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.engine import Engine
from localkv.sampling import SamplingParams
from localkv.tui.app import ChatApp
from localkv.tui.widgets.branch_tree import BranchTree
from localkv.tui.widgets.kv_panel import KVPanel
from localkv.tui.widgets.message import ChatMessage, Notice, clean
from localkv.units import format_size

GREEDY = SamplingParams(temperature=0, seed=0)
SIZE = (100, 30)


def make_app(engine, sampling=GREEDY, max_tokens=24, ignore_eos=False, **kw):
    sampling = replace(sampling, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return ChatApp(engine, ConversationStore(), sampling=sampling, **kw)


async def idle(pilot, timeout=20.0):
    """Wait until no reply is streaming and no engine is being built."""
    for _ in range(int(timeout / 0.02)):
        await pilot.pause(0.02)
        if not pilot.app.busy:
            await pilot.pause()
            return
    raise AssertionError("the app stayed busy")


async def send(pilot, text):
    pilot.app.prompt.focus()
    pilot.app.prompt.value = text
    await pilot.press("enter")
    await idle(pilot)


def messages(app):
    return [(w.role, w.source) for w in app.transcript.query(ChatMessage)]


def notices(app):
    return [(str(n.content), n.has_class("error")) for n in app.transcript.query(Notice)]


@pytest.mark.asyncio
async def test_reply_streams_into_transcript_and_is_saved(engine, reference):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"hello", "enter")
        await idle(pilot)
        want = reference([{"role": "user", "content": "hello"}])
        assert want.text and messages(app) == [("user", "hello"), ("assistant", clean(want.text))]
        path = app.store.path(app.at)
        assert [(m.role, m.content) for m in path] == [("user", "hello"), ("assistant", want.text)]
        assert path[1].completion_tokens == len(want.tokens) and path[1].sampling["temperature"] == 0
        user_view, view = app.transcript.query(ChatMessage)
        assert view.border_subtitle.endswith(want.finish_reason) and app.store.short_id(app.at) in view.border_title
        assert (user_view.mid, view.mid) == (path[0].id, path[1].id)
        assert app.title == "tiny-test" and app.sub_title.startswith("CPU")
        # the second turn continues the same conversation and reuses the first prompt's blocks
        await send(pilot, "again")
        path = app.store.path(app.at)
        assert [m.role for m in path] == ["user", "assistant", "user", "assistant"]
        assert app.panel.last_turn[0] >= engine.block_size
        # input history: up brings back the last lines sent
        await pilot.press("up")
        assert app.prompt.value == "again"
        await pilot.press("up", "down", "down")
        assert app.prompt.value == ""


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
async def test_stop_keeps_the_partial_reply(engine, key):
    app = make_app(engine, max_tokens=3000, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        app.prompt.value = "tell me everything"
        await app.prompt.action_submit()  # not pilot.press: it waits for the UI to go idle, i.e. the reply's end
        for _ in range(3000):  # until the first batch is on screen (a busy machine takes seconds)
            await pilot.pause(0.01)
            views = app.transcript.query(ChatMessage)
            if len(views) == 2 and views.last().source:
                break
        view = views.last()
        assert app.busy and view.source
        await pilot.press(key)
        await idle(pilot)
        reply = app.store.get_message(app.at)
        assert reply.role == "assistant" and 0 < reply.completion_tokens < 3000
        assert view.source == clean(reply.content) and view.border_subtitle.endswith("stopped")
        assert engine.pool.usage()["used"] == 0  # the sequence was freed
        await send(pilot, "/help")  # still responsive
        assert "/regen" in notices(app)[-1][0]


@pytest.mark.asyncio
async def test_quitting_mid_reply_stops_it_and_saves_it(engine):
    app = make_app(engine, max_tokens=3000, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        app.prompt.value = "tell me everything"
        await app.prompt.action_submit()
        for _ in range(3000):  # until the first batch is on screen (a busy machine takes seconds)
            await pilot.pause(0.01)
            if app.transcript.query(ChatMessage).last().source:
                break
        await pilot.press("ctrl+q")
    for _ in range(1000):  # the worker ends on its own thread, after the app: until it saved both messages
        if [c["messages"] for c in app.store.list_conversations()] == [2]:
            break
        await asyncio.sleep(0.01)
    [conv] = app.store.list_conversations()
    reply = app.store.latest_leaf(conv["full_id"])
    assert reply.role == "assistant" and 0 < reply.completion_tokens < 3000 and app.return_code == 0


@pytest.mark.asyncio
async def test_fork_n_samples_sibling_replies_that_share_the_prompt_blocks(engine):
    app = make_app(engine, sampling=SamplingParams(temperature=1.0, seed=3), max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one " * 40)  # a prompt of several full blocks
        first = app.at
        user = app.store.get_message(first).parent_id
        await send(pilot, "/fork 3")
        kids = app.store.children(user)
        assert [k.role for k in kids] == ["assistant"] * 4 and kids[0].id == first
        assert len({k.content for k in kids}) > 1  # seeds 4, 5, 6 beside the first reply's 3
        # the first alternative is shown; every sibling is in the tree
        assert app.at == kids[1].id and messages(app)[-1] == ("assistant", clean(kids[1].content))
        tree = app.query_one(BranchTree)
        assert {k.id for k in kids} <= {n.data for n in _nodes(tree.root)}
        # the three branches held the prompt's blocks once
        view = app.transcript.query(ChatMessage).last()
        branches, used, unshared = re.search(
            r"(\d+) branches in (\d+) blocks, (\d+) unshared", view.border_subtitle
        ).groups()
        assert branches == "3" and int(used) < int(unshared), view.border_subtitle


@pytest.mark.asyncio
async def test_regen_fork_and_switch_branches(engine, model_path):
    app = make_app(engine, sampling=SamplingParams(temperature=1.0, seed=3))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one")
        first = app.at
        user = app.store.get_message(first).parent_id
        await send(pilot, "/regen")  # a sibling reply, seed + 1
        second = app.at
        kids = app.store.children(user)
        assert [k.id for k in kids] == [first, second]
        assert kids[0].content != kids[1].content
        assert messages(app) == [("user", "one"), ("assistant", clean(kids[1].content))]

        await send(pilot, "/branches")
        tree = app.query_one(BranchTree)
        assert app.show_tree and app.focused is tree
        nodes = {n.data: n for n in _nodes(tree.root)}
        assert set(nodes) >= {user, first, second}

        # switch: Enter on the first reply shows its branch
        tree.move_cursor(nodes[first])
        await pilot.press("enter")
        await pilot.pause()
        assert app.at == first
        assert messages(app) == [("user", "one"), ("assistant", clean(kids[0].content))]

        # fork at the question: the next message is a new root, beside "one"
        tree.move_cursor(nodes[user])
        await pilot.press("f")
        await pilot.pause()
        assert app.at is None and messages(app) == [] and app.focused is app.prompt
        await send(pilot, "two")
        assert [c["preview"] for c in app.store.tree(app.cid)["children"]] == ["one", "two"]
        assert [m for m, _ in messages(app)] == ["user", "assistant"] and messages(app)[0][1] == "two"

        # back to the first branch and one more turn: its prompt starts with the cached blocks
        nodes = {n.data: n for n in _nodes(tree.root)}
        tree.focus()
        tree.move_cursor(nodes[first])
        await pilot.press("enter")
        await pilot.pause()
        await send(pilot, "three")
        path = app.store.path(app.at)
        assert [m.content for m in path[:3]] == ["one", kids[0].content, "three"]
        cached, prompt = app.panel.last_turn
        assert cached >= engine.block_size and app.panel.shown["reuse last"] == f"{cached}/{prompt} tok"

        # r in the tree regenerates the reply under the cursor
        nodes = {n.data: n for n in _nodes(tree.root)}
        tree.focus()
        tree.move_cursor(nodes[second])
        await pilot.press("r")
        await idle(pilot)
        assert len(app.store.children(user)) == 3 and app.store.get_message(app.at).parent_id == user


def _nodes(node):
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


@pytest.mark.asyncio
async def test_system_prompt_starts_the_next_exchange(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "/system Be terse.")
        assert app.system == "Be terse." and "Be terse." in app.sub_title
        assert messages(app) == [("system", "Be terse.")]
        await send(pilot, "hi")
        path = app.store.path(app.at)
        assert [(m.role, m.content) for m in path][:2] == [("system", "Be terse."), ("user", "hi")]
        await send(pilot, "/save")
        assert app.store.short_id(app.cid) in notices(app)[-1][0]
        await send(pilot, "/clear")  # a new conversation keeps the system prompt, not saved yet
        assert app.cid is None and app.at is None and messages(app) == [("system", "Be terse.")]


@pytest.mark.asyncio
async def test_set_applies_params_and_rebuilds_the_engine(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        cid = app.cid
        await send(pilot, "/set temperature 0.5")
        assert app.params.temperature == 0.5 and notices(app)[-1] == ("temperature = 0.5", False)
        await send(pilot, "/set budget 64")
        await send(pilot, "/set evict sliding")
        ev = app.engine.config.evict
        assert app.engine is not engine and (ev.policy, ev.budget) == ("sliding", 64)
        assert notices(app)[-1] == ("ready: tiny-test, KV policy sliding, budget 64 tokens", False)
        assert app.cid == cid and app.panel.shown["policy"] == "sliding"  # the store and the conversation stay
        await send(pilot, "more")
        assert [m.role for m in app.store.path(app.at)] == ["user", "assistant"] * 2
        await send(pilot, "/set kv-dtype q8_0")  # this model's heads (16 values) do not split into q8_0 blocks
        text, error = notices(app)[-1]
        assert error and "divisible by 32, not 16" in text and app.engine.kv_dtype == "f16"
        await send(pilot, "/set kv-dtype f32")
        assert app.engine.kv_dtype == "f32" and app.engine.config.evict.policy == "sliding"
        await send(pilot, "again")
        assert app.panel.shown["kv/token"].endswith(" f32") and len(app.store.path(app.at)) == 6


@pytest.mark.asyncio
async def test_a_bad_command_is_one_error_line_and_changes_nothing(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        for bad in ("/set evict lru", "/set top_p 2", "/frobnicate", "/regen"):
            await send(pilot, bad)
            text, error = notices(app)[-1]
            assert error and text and "\n" not in text, bad
        assert app.params == make_app(engine).params and app.engine is engine and app.cid is None
        await send(pilot, "/help")
        assert "/fork" in notices(app)[-1][0]
        await pilot.press(*"/bye", "enter")
        await pilot.pause()
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_panel_shows_the_engine_numbers(engine):
    app = make_app(engine, max_tokens=120, ignore_eos=True)
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.show_panel  # wide: shown by default
        await send(pilot, "first")
        await send(pilot, "/regen")
        await send(pilot, "/set budget 64")
        await send(pilot, "/set evict h2o")
        await send(pilot, "a long one")
        await pilot.pause(0.3)  # one panel tick
        eng, panel = app.engine, app.query_one(KVPanel)
        u, s = eng.pool.usage(), eng.stats
        assert s.evictions > 0  # the budget was hit: the log has events
        shown = panel.shown
        assert shown["blocks"] == f"{u['blocks']} × {u['block_size']} tok"
        assert [shown[k] for k in ("used", "shared", "cached", "free")] == [
            str(u[k]) for k in ("used", "shared", "cached_free", "free")
        ]
        assert shown["kv bytes"] == format_size(u["used"] * u["bytes_per_block"])
        assert shown["cow copies"] == str(s.cow_copies)
        assert shown["reuse total"].startswith(f"{s.prefix_hits}/{s.prefix_queries}")
        assert [shown[k] for k in ("evictions", "offloads", "recalls")] == [
            str(s.evictions),
            str(s.offloads),
            str(s.recalls),
        ]
        assert (shown["policy"], shown["budget"]) == ("h2o", "64 tok")
        r = app.store.get_message(app.at)
        assert shown["reuse last"].endswith(f"/{r.prompt_tokens} tok")
        stats_text = str(panel.query_one("#kv-stats").content)
        assert all(v in stats_text for v in shown.values())
        events_text = str(panel.query_one("#kv-events").content)
        assert events_text.count("\n") + 1 == min(6, len(s.events)) and "evict" in events_text
        assert panel.query_one("Sparkline").data  # tokens/s samples

        await pilot.press("f2")  # toggles: the layout keeps the transcript
        assert not panel.display
        await pilot.press("f2")
        assert panel.display


@pytest.mark.asyncio
async def test_narrow_terminal_shows_one_side_panel(engine):
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        assert not app.show_panel  # hidden by default when narrow
        await pilot.press("f2")
        assert app.show_panel
        await pilot.press("f3")  # the tree replaces it: both would leave the chat too narrow
        assert app.show_tree and not app.show_panel
        assert app.focused is app.query_one(BranchTree)
        app.prompt.focus()
        await pilot.press(*"pbrf")  # typing letters in the input never toggles anything
        assert app.prompt.value == "pbrf" and app.show_tree and not app.busy


@pytest.mark.asyncio
async def test_refused_prompt_goes_back_to_the_input(model_path):
    eng = Engine(EngineConfig(model=model_path, kv_mem="4MiB", device="cpu"))
    app = make_app(eng, max_tokens=10)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "x" * 5000)  # longer than the context: refused before any work
        text, error = notices(app)[-1]
        assert error and "context" in text and app.cid is None
        assert messages(app) == [] and app.prompt.value == "x" * 5000


@pytest.mark.asyncio
async def test_app_from_a_config_loads_the_engine_in_the_background(config):
    app = ChatApp(replace(config, kv_mem="1MiB"), ConversationStore(), sampling=replace(GREEDY, max_tokens=5))
    assert app.engine is None and app.config.kv_mem == 1 << 20
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot)
        assert app.engine is not None and app.engine.config.kv_mem == 1 << 20 and app.title == "tiny-test"
        assert notices(app)[-1] == ("ready: tiny-test, KV policy none", False)
        await send(pilot, "hi")
        assert app.at is not None


@pytest.mark.asyncio
async def test_an_engine_that_fails_to_build_is_an_error_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model")
    app = ChatApp(EngineConfig(model=bad, device="cpu"), ConversationStore())
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(200):
            await pilot.pause(0.02)
            if notices(app)[-1][1]:
                break
        text, error = notices(app)[-1]
        assert error and text.startswith("error: ") and "internal error" not in text
        assert app.engine is None and app.busy  # nothing can run; /bye still works
        await pilot.press(*"/bye", "enter")
        await pilot.pause()
    assert app.return_code == 0


def test_chat_command_checks_ids_before_the_ui(monkeypatch, capsys):
    from localkv.cli import main

    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the ids were checked")

    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("localkv.engine.Engine.__init__", no_engine)
    for args, msg in (
        (["--cid", "abcdef"], "no conversation matches 'abcdef'"),
        (["-c"], "no saved conversation"),
        (["-t", "-1"], "invalid temperature"),
    ):
        assert main(["chat", "--device", "cpu", *args]) == 1
        assert msg in capsys.readouterr().err


@pytest.fixture
def snapshot_app(engine, fake_clock):
    return make_app(engine, system="You are a tiny test model.", clock=fake_clock())


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_snapshot_main_screen(snapshot_app, ids, snap_compare, size):
    async def chat(pilot):
        pilot.app.prompt.cursor_blink = False  # a blinking cursor is a coin flip in the screenshot
        await send(pilot, "Hello! What can you do?")
        await send(pilot, "/regen")
        await pilot.pause(0.3)

    assert snap_compare(snapshot_app, terminal_size=size, run_before=chat)


def test_snapshot_branch_tree(snapshot_app, ids, snap_compare):
    async def chat(pilot):
        pilot.app.prompt.cursor_blink = False
        await send(pilot, "Hello!")
        await send(pilot, "/regen")
        await send(pilot, "More?")  # continues the second branch: no deeper nesting
        await send(pilot, "/branches")

    assert snap_compare(snapshot_app, terminal_size=(80, 24), run_before=chat)


@pytest.mark.asyncio
async def test_escape_leaves_the_input_for_single_key_commands(engine):
    app = make_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.show_panel and app.focused is app.prompt
        await pilot.press("p")  # typing: a letter, not a command
        assert app.prompt.value == "p" and app.show_panel
        await pilot.press("escape", "p", "b")
        assert not app.show_panel and app.show_tree
        await pilot.press("escape", "i")
        assert app.focused is app.prompt


@pytest.mark.asyncio
async def test_panel_shows_drafted_and_accepted_tokens(config):
    """--spec ngram: the panel's drafted / accepted and tokens per verify pass are engine.stats'."""
    eng = Engine(replace(config, spec="ngram"))
    app = make_app(eng, max_tokens=60, ignore_eos=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "abc abc abc abc abc abc")
        await pilot.pause(0.3)  # one panel tick
        s, shown = eng.stats, app.query_one(KVPanel).shown
        assert s.drafted > 0 and shown["spec"] == "ngram" and shown["drafted"] == str(s.drafted)
        assert shown["accepted"].startswith(f"{s.accepted} (")
        assert shown["tok/verify"] == f"{(s.accepted + s.verify_passes) / s.verify_passes:.2f}"


@pytest.mark.model
@pytest.mark.asyncio
async def test_title_and_ready_line_name_the_model_as_the_catalog_does(real_model_path):
    # the GGUF's own general.name is "Smollm2 135M 8k Lc100K Mix1 Ep2", a training-run label
    config = EngineConfig(model=str(real_model_path), kv_mem="4MiB", device="cpu")
    app = ChatApp(config, ConversationStore(), sampling=replace(GREEDY, max_tokens=2))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, timeout=300)  # the real model's kernels may compile first
        assert app.engine.model_config.name != "smollm2-135m"
        assert app.title == "smollm2-135m"
        assert notices(app)[-1] == ("ready: smollm2-135m, KV policy none", False)


@pytest.mark.asyncio
async def test_a_question_sent_while_the_next_turn_warms_stops_the_warm_and_is_answered(engine, monkeypatch):
    """After a reply the worker prefills the next turn's start (busy meanwhile); a question sent
    then ends that warm at once and is asked when it has stopped."""
    stopped = []

    def slow_warm(eng, ids, stop):
        deadline = time.monotonic() + (20 if not stopped else 0)  # the first: until new input asks it to stop
        while not stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(stop())
        return 0

    monkeypatch.setattr("localkv.tui.worker.next_turn.warm", slow_warm)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"hello", "enter")
        for _ in range(1000):
            await pilot.pause(0.02)
            if app._warming:
                break
        assert app._warming and app.busy
        await pilot.press(*"again", "enter")
        await idle(pilot)
        assert stopped[0] is True  # ended by the question, not by its timeout
        assert [m for m in messages(app) if m[0] == "user"] == [("user", "hello"), ("user", "again")]
        assert not app._warming and app._queued is None
