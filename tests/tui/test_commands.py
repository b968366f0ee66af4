"""Slash commands without Textual: each command reads a plain chat state and returns what to do."""

from dataclasses import dataclass, field, replace

import pytest

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.tui.commands import (
    HELP,
    FocusPrompt,
    Goto,
    Quit,
    Rebuild,
    Regenerate,
    Say,
    ShowTree,
    UseParams,
    run,
)


@dataclass
class State:
    """The fields of the Chat protocol, as ChatApp holds them."""

    store: ConversationStore = field(default_factory=ConversationStore)
    cid: str | None = None
    at: str | None = None
    system: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    busy: bool = False
    config: EngineConfig = field(default_factory=lambda: EngineConfig(model="tiny.gguf", device="cpu"))
    picked: str | None = None


@dataclass
class Chat:
    """A saved conversation: system, question, two sibling replies, and a follow-up under the second."""

    state: State
    system: str
    user: str
    first: str
    second: str
    follow: str


@pytest.fixture
def chat() -> Chat:
    st = State()
    store = st.store
    cid = store.new_conversation("tiny-test")
    system = store.add_message(cid, None, "system", "Be terse.")
    user = store.add_message(cid, system, "user", "hello")
    first = store.add_message(cid, user, "assistant", "hi")
    second = store.add_message(cid, user, "assistant", "hey")
    follow = store.add_message(cid, second, "user", "more")
    st.cid, st.at, st.system = cid, second, "Be terse."
    return Chat(st, system, user, first, second, follow)


def error(effects) -> str:
    """The text of the one error notice the effects must be."""
    assert len(effects) == 1 and isinstance(effects[0], Say) and effects[0].error, effects
    assert "\n" not in effects[0].text
    return effects[0].text


# ------------------------------------------------------------ dispatch


def test_unknown_command_points_to_help():
    assert error(run(State(), "/frobnicate now")) == "unknown command /frobnicate: /help lists the commands"


@pytest.mark.parametrize("line", ["/help", "/?", "/HELP", "/help me"])
def test_help_and_its_alias_show_the_help(line):
    assert run(State(), line) == [Say(HELP)]


@pytest.mark.parametrize("line", ["/bye", "/exit", "/quit"])
def test_bye_and_its_aliases_quit(line):
    assert run(State(), line) == [Quit()]


@pytest.mark.parametrize("line", ["/branches", "/tree"])
def test_branches_shows_the_tree(line):
    assert run(State(), line) == [ShowTree()]


@pytest.mark.parametrize("line", ["/clear", "/system x", "/set top_k 3", "/fork", "/regen"])
def test_commands_that_change_the_branch_or_engine_wait_while_busy(line):
    name = line.split()[0]
    assert error(run(State(busy=True), line)) == f"busy: {name} must wait for the reply (Esc stops it)"


@pytest.mark.parametrize("line", ["/help", "/bye", "/branches", "/save"])
def test_commands_that_touch_neither_run_while_busy(line):
    assert not any(isinstance(e, Say) and e.error for e in run(State(busy=True), line))


@pytest.mark.parametrize(
    "line", ["/clear", "/system new", "/set temperature 0.1", "/set evict sliding", "/fork", "/regen", "/save"]
)
def test_commands_only_return_effects(chat, line):
    before = replace(chat.state)
    run(chat.state, line)
    assert chat.state == before


# ------------------------------------------------------------ /clear /save /system


def test_clear_starts_a_new_conversation_with_the_same_system_prompt(chat):
    assert run(chat.state, "/clear") == [Goto(None, None, "Be terse."), Say("new conversation (same system prompt)")]


def test_clear_without_a_system_prompt():
    assert run(State(), "/clear") == [Goto(None, None, None), Say("new conversation")]


def test_save_before_the_first_reply():
    assert run(State(), "/save") == [Say("nothing to save yet: each exchange is saved when its reply ends")]


def test_save_says_where_and_how_to_continue(chat):
    st = chat.state
    short = st.store.short_id(st.cid)
    [say] = run(st, "/save")
    assert say.text == (
        f"saved as conversation {short} (5 messages, 2 branches) in {st.store.db_path}: "
        f"`localkv chat --cid {short}` continues it"
    )


def test_system_without_text_shows_it(chat):
    assert run(chat.state, "/system") == [Say("system prompt: Be terse.")]
    assert run(State(), "/system") == [Say("system prompt: (none)")]


def test_system_starts_a_new_root_branch(chat):
    assert run(chat.state, "/system Be kind.") == [
        Goto(chat.state.cid, None, "Be kind."),
        Say("system prompt set: the next message starts a new branch from the root"),
    ]


def test_system_before_any_conversation():
    assert run(State(), "/system Be kind.") == [Goto(None, None, "Be kind."), Say("system prompt set")]


# ------------------------------------------------------------ /fork


def test_fork_at_a_reply_continues_after_it(chat):
    st = chat.state
    short = st.store.short_id(chat.first)
    assert run(st, f"/fork {short}") == [
        Goto(st.cid, chat.first),
        Say(f"forked at {short}: your next message starts a new branch after it"),
        FocusPrompt(),
    ]


def test_fork_at_a_question_goes_beside_it(chat):
    st = chat.state
    effects = run(st, f"/fork {chat.follow}")
    assert effects[0] == Goto(st.cid, chat.second)
    assert effects[1].text.endswith("a new branch instead of that question")


def test_fork_without_id_uses_the_message_picked_in_the_tree(chat):
    chat.state.picked = chat.first
    assert run(chat.state, "/fork")[0] == Goto(chat.state.cid, chat.first)


def test_fork_without_id_or_pick_opens_the_tree(chat):
    assert run(chat.state, "/fork") == [
        ShowTree(),
        Say("pick the message to branch at in the tree and press f (or /fork ID)"),
    ]


def test_fork_at_an_unknown_id(chat):
    assert "no message matches 'zzzz'" in error(run(chat.state, "/fork zzzz"))


@pytest.mark.parametrize("line", ["/fork 3", "/fork -b 3", "/fork --branches 3"])
def test_fork_n_samples_n_alternatives_of_the_last_reply(chat, line):
    st = chat.state
    st.params = SamplingParams(seed=7)
    # two replies already: the three new ones take seeds 9, 10, 11 (branch i: seed + i)
    assert run(st, line) == [
        Goto(st.cid, chat.user),
        Regenerate(SamplingParams(seed=9), 3),
        Say("sampling 3 alternatives of the last reply (see the tree: b)"),
    ]


@pytest.mark.parametrize(
    ("line", "why"),
    [("/fork 0", "takes 1 to 16"), ("/fork -b 17", "takes 1 to 16"), ("/fork -b x", "expected a number")],
)
def test_fork_n_out_of_range(chat, line, why):
    assert why in error(run(chat.state, line))


def test_fork_n_needs_a_reply_to_resample(chat):
    assert "there is no reply here yet" in error(run(State(), "/fork 2"))
    chat.state.at = chat.follow  # a question waiting for its reply
    assert "there is no reply here yet" in error(run(chat.state, "/fork 2"))


# ------------------------------------------------------------ /regen


def test_regen_replies_again_to_the_question_with_the_next_seed(chat):
    st = chat.state
    st.params = SamplingParams(seed=7)
    # two replies already: seed + 2, so not the sibling already there
    assert run(st, "/regen") == [Goto(st.cid, chat.user), Regenerate(SamplingParams(seed=9))]


def test_regen_without_a_seed_keeps_the_params(chat):
    st = chat.state
    assert run(st, f"/regen {chat.first}") == [Goto(st.cid, chat.user), Regenerate(st.params)]


def test_regen_at_a_question_replies_to_it(chat):
    st = chat.state
    assert run(st, f"/regen {chat.follow}") == [Goto(st.cid, chat.follow), Regenerate(st.params)]


def test_regen_before_any_reply():
    assert error(run(State(), "/regen")) == "error: nothing to regenerate yet"


def test_regen_at_a_system_message(chat):
    short = chat.state.store.short_id(chat.system)
    assert error(run(chat.state, f"/regen {short}")) == (
        f"error: message {short} is a system message: nothing to regenerate"
    )


# ------------------------------------------------------------ /set


def test_set_without_a_key_shows_the_settings():
    st = State(params=SamplingParams(temperature=0.5, seed=None))
    st.config = replace(st.config, evict=EvictConfig("sliding", 64))
    assert run(st, "/set") == [
        Say(
            "temperature 0.5 · top_p 0.95 · top_k 40 · max_tokens 512 · seed None · evict sliding · budget 64"
            " · kv_dtype auto"
        )
    ]


@pytest.mark.parametrize(
    "line, field_, value, shown",
    [
        ("/set temperature 0.5", "temperature", 0.5, "temperature = 0.5"),
        ("/set TOP-P 0.5", "top_p", 0.5, "top_p = 0.5"),
        ("/set top_k 7", "top_k", 7, "top_k = 7"),
        ("/set max_tokens 5", "max_tokens", 5, "max_tokens = 5"),
        ("/set seed 3", "seed", 3, "seed = 3"),
        ("/set seed none", "seed", None, "seed = None"),
        ("/set seed OFF", "seed", None, "seed = None"),
    ],
)
def test_set_a_sampling_param(line, field_, value, shown):
    st = State(params=SamplingParams(seed=1))
    assert run(st, line) == [UseParams(replace(st.params, **{field_: value})), Say(shown)]


@pytest.mark.parametrize(
    "line, evict",
    [
        ("/set evict sliding", EvictConfig("sliding", 64)),
        ("/set evict H2O", EvictConfig("h2o", 64)),
        ("/set budget 128", EvictConfig("none", 128)),
        ("/set budget off", EvictConfig("none", None)),
    ],
)
def test_set_evict_or_budget_rebuilds_the_engine_from_its_config(line, evict):
    st = State()
    st.config = replace(st.config, evict=EvictConfig("none", 64), kv_mem="8MiB")
    key, value = line.split()[1:]
    assert run(st, line) == [
        Say(f"{key} = {value}: building a new engine (the in-memory prefix cache starts empty)"),
        Rebuild(replace(st.config, evict=evict)),
    ]


@pytest.mark.parametrize(
    "line, kv_dtype",
    [("/set kv-dtype q8_0", "q8_0"), ("/set KV_DTYPE Q8_0:Q4_0", "q8_0:q4_0"), ("/set kv_dtype f16", "f16")],
)
def test_set_kv_dtype_rebuilds_the_engine_with_that_pool(line, kv_dtype):
    st = State()
    value = line.split()[2]
    assert run(st, line) == [
        Say(f"{line.split()[1].lower().replace('-', '_')} = {value}: building a new engine (the in-memory prefix "
            "cache starts empty)"),
        Rebuild(replace(st.config, kv_dtype=kv_dtype)),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "line, why",
    [
        (
            "/set bogus 1",
            "unknown setting 'bogus': use one of temperature, top_p, top_k, min_p, repeat_penalty, repeat_last_n, "
            "presence_penalty, frequency_penalty, dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, "
            "max_tokens, seed, stop, think, reasoning_budget, evict, budget, kv_dtype",
        ),
        ("/set temperature", "/set temperature needs a value"),
        ("/set top_k many", "invalid top_k 'many': expected a number"),
        ("/set top_k 1.5", "invalid top_k '1.5': expected a number"),
        ("/set temperature none", "invalid temperature 'none': expected a number"),
        ("/set temperature -1", "invalid temperature -1.0"),
        ("/set top_p 2", "invalid top-p 2.0"),
        ("/set max_tokens 0", "invalid max tokens 0"),
        ("/set seed -2", "invalid seed -2"),
        ("/set think maybe", "invalid think 'maybe': expected on or off"),
        ("/set reasoning_budget -2", "invalid reasoning budget -2"),
        ("/set evict lru", "unknown KV policy 'lru'"),
        ("/set evict h2o", "needs a budget"),
        ("/set budget -5", "invalid KV budget -5"),
        ("/set budget lots", "invalid budget 'lots': expected a number"),
        ("/set kv-dtype q4", "unknown --kv-dtype 'q4'"),
        ("/set kv_dtype q8_0:q4_0:f16", "unknown --kv-dtype 'q8_0:q4_0:f16'"),
    ],
)
def test_set_refuses_a_bad_value_with_one_line(line, why):
    text = error(run(State(), line))
    assert text.startswith("error: ") and why in text
