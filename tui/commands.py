"""The slash commands of `localkv chat`: a table from name to handler, and the /set parser.

A handler reads the chat's state (the `Chat` protocol: ChatApp, or any object with these fields)
and returns what should happen, in order, as plain values: notices to show (`Say`) and effects
for the app to carry out (`Goto`, `UseParams`, `Rebuild`, ...). Nothing here imports Textual, so
every command is testable without a running app."""

import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore
from localkv.errors import LocalkvError
from localkv.sampling import SamplingParams

HELP = """\
/system TEXT    set the system prompt (a new branch from the root)
/set KEY VALUE  temperature top_p top_k min_p repeat_penalty repeat_last_n
                presence_penalty frequency_penalty dry_multiplier dry_base
                dry_allowed_length dry_penalty_last_n max_tokens seed stop evict budget
                think (on/off) reasoning_budget (a thinking model's most thinking tokens)
                kv_dtype (f16 f32 q8_0 q4_0, or K:V as q8_0:q4_0: a new engine)
                (/set stop "###" "User:" sets stop strings; /set stop none clears them)
/fork [ID]      branch at the message picked in the tree (or ID)
/fork N         sample N alternatives of the last reply as sibling branches (also /fork -b N)
/branches       the tree: Enter switches branch, f forks, r regenerates
/regen [ID]     regenerate the last reply (or ID's) as a sibling
/clear          start a new conversation
/save           where this conversation is saved
/help  /bye
Esc stops a reply, else leaves the input for the keys: p panel, b tree, r regen, f fork, i input
F2 KV panel · F3 tree · ↑↓ history · Tab focus · Ctrl-Q quit"""
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "max_tokens",
    "seed",
    "stop",
    "think",
    "reasoning_budget",
)
ENGINE_KEYS = ("evict", "budget", "kv_dtype")  # settings of the engine: a new one is built
SETTINGS = (*SAMPLING_KEYS, *ENGINE_KEYS)
FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
)
_DEFAULTS = SamplingParams()
SHOWN = ("temperature", "top_p", "top_k", "max_tokens", "seed")  # always in /set's summary
ALIASES = {"?": "help", "exit": "bye", "quit": "bye", "tree": "branches"}


class Chat(Protocol):
    """What the commands read. `busy`: a reply streams or an engine is being built."""

    store: ConversationStore
    cid: str | None  # the conversation shown (None: a new one, created when the first reply is saved)
    at: str | None  # the message the next one goes under (None: a new root)
    system: str | None
    params: SamplingParams
    busy: bool

    @property
    def config(self) -> EngineConfig: ...  # the engine's settings (/set evict|budget|kv_dtype replace them)

    @property
    def picked(self) -> str | None: ...  # the message under the tree's cursor while the tree shows


# ------------------------------------------------------------ what a command returns


@dataclass(frozen=True, slots=True)
class Say:
    """A notice in the transcript."""

    text: str
    error: bool = False


@dataclass(frozen=True, slots=True)
class Goto:
    """Show the branch through `at` in conversation `cid`; `system` only for a new root (at None)."""

    cid: str | None
    at: str | None
    system: str | None = None


@dataclass(frozen=True, slots=True)
class UseParams:
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Build a new engine from `config` in the worker (the old one serves until it is ready)."""

    config: EngineConfig


@dataclass(frozen=True, slots=True)
class Regenerate:
    """New replies to the question the chat is now at, with these params: n of them, sampled as
    branches of one prompt (its blocks shared), the first shown."""

    params: SamplingParams
    n: int = 1


@dataclass(frozen=True, slots=True)
class ShowTree:
    """Show the branch tree and focus it."""


@dataclass(frozen=True, slots=True)
class FocusPrompt:
    pass


@dataclass(frozen=True, slots=True)
class Quit:
    pass


Effect = Say | Goto | UseParams | Rebuild | Regenerate | ShowTree | FocusPrompt | Quit
Handler = Callable[[Chat, str], list[Effect]]


def run(chat: Chat, line: str) -> list[Effect]:
    """The effects of one input line starting with '/'. A user's error is one error notice."""
    name, _, arg = line[1:].partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    command = COMMANDS.get(name)
    if command is None:
        return [Say(f"unknown command /{name}: /help lists the commands", error=True)]
    if chat.busy and not command.anytime:
        return [Say(f"busy: /{name} must wait for the reply (Esc stops it)", error=True)]
    try:
        return command.handler(chat, arg.strip())
    except LocalkvError as e:
        return [Say(f"error: {e}", error=True)]


# ------------------------------------------------------------ the commands


def help_(chat: Chat, arg: str) -> list[Effect]:
    return [Say(HELP)]


def bye(chat: Chat, arg: str) -> list[Effect]:
    return [Quit()]


def clear(chat: Chat, arg: str) -> list[Effect]:
    return [Goto(None, None, chat.system), Say("new conversation" + (" (same system prompt)" if chat.system else ""))]


def save(chat: Chat, arg: str) -> list[Effect]:
    if chat.cid is None:
        return [Say("nothing to save yet: each exchange is saved when its reply ends")]
    c = chat.store.get_conversation(chat.cid)
    return [
        Say(
            f"saved as conversation {c['id']} ({c['messages']} messages, {c['branches']} branches) in "
            f"{chat.store.db_path}: `localkv chat --cid {c['id']}` continues it"
        )
    ]


def system(chat: Chat, arg: str) -> list[Effect]:
    if not arg:
        return [Say(f"system prompt: {chat.system or '(none)'}")]
    # the system prompt is the root of a branch: a new one starts a new branch from the root
    where = ": the next message starts a new branch from the root" if chat.cid else ""
    return [Goto(chat.cid, None, arg), Say("system prompt set" + where)]


def branches(chat: Chat, arg: str) -> list[Effect]:
    return [ShowTree()]


def fork(chat: Chat, arg: str) -> list[Effect]:
    if (n := _branch_count(arg)) is not None:
        return alternatives(chat, n)
    mid = chat.store.resolve_message(arg) if arg else chat.picked
    if mid is None:
        return [ShowTree(), Say("pick the message to branch at in the tree and press f (or /fork ID)")]
    msg = chat.store.get_message(mid)
    # the next message goes under the chosen one; at a question, beside it (an edited question)
    at = msg.parent_id if msg.role == "user" else msg.id
    what = "instead of that question" if msg.role == "user" else "after it"
    return [
        Goto(msg.conversation_id, at),
        Say(f"forked at {chat.store.short_id(mid)}: your next message starts a new branch {what}"),
        FocusPrompt(),
    ]


MAX_ALTERNATIVES = 16  # as the server's n: more would rarely fit the pool beside the prompt


def _branch_count(arg: str) -> int | None:
    """/fork's N (`N` or `-b N`), else None (a message id, or nothing). An id is hex of at least
    SHORT_LEN characters, so a number of at most two digits is never one."""
    words = arg.split()
    if len(words) == 2 and words[0] in ("-b", "--branches"):
        text = words[1]
    elif len(words) == 1 and words[0].isdigit() and len(words[0]) <= 2:
        text = words[0]
    else:
        return None
    n = number("branches", text)
    if not 1 <= n <= MAX_ALTERNATIVES:
        raise LocalkvError(f"invalid branch count {text}: /fork N takes 1 to {MAX_ALTERNATIVES}")
    return n


def regen(chat: Chat, arg: str) -> list[Effect]:
    return _resample(chat, chat.store.resolve_message(arg) if arg else chat.at, 1)


def alternatives(chat: Chat, n: int) -> list[Effect]:
    """/fork N: N new siblings of the last reply, one prompt forked N ways."""
    if chat.at is None or chat.store.get_message(chat.at).role != "assistant":
        raise LocalkvError("/fork N samples alternatives of the last reply: there is no reply here yet")
    return [*_resample(chat, chat.at, n), Say(f"sampling {n} alternatives of the last reply (see the tree: b)")]


def _resample(chat: Chat, mid: str | None, n: int) -> list[Effect]:
    """Go to the question of message mid (the question itself or its reply) and answer it anew."""
    st = chat.store
    if mid is None:
        raise LocalkvError("nothing to regenerate yet")
    msg = st.get_message(mid)
    user = st.get_message(msg.parent_id) if msg.role == "assistant" and msg.parent_id else msg
    if user.role != "user":
        raise LocalkvError(f"message {st.short_id(mid)} is a {msg.role} message: nothing to regenerate")
    p = chat.params
    if p.seed is not None:  # reproducible, yet not the siblings already there (branch i then takes seed + i)
        siblings = sum(1 for c in st.children(user.id) if c.role == "assistant")
        p = replace(p, seed=p.seed + siblings)
    return [Goto(user.conversation_id, user.id), Regenerate(p, n)]


def set_(chat: Chat, arg: str) -> list[Effect]:
    key, _, value = arg.partition(" ")
    key, value = key.lower().replace("-", "_"), value.strip()
    if not key:
        p, ev = chat.params, chat.config.evict
        # the rest of the sampling keys only when they are on (differ from SamplingParams' defaults)
        on = [k for k in SAMPLING_KEYS if k not in SHOWN and getattr(p, k) != getattr(_DEFAULTS, k)]
        more = "".join(f" · {k} {_shown(getattr(p, k))}" for k in on)
        return [
            Say(
                f"temperature {p.temperature} · top_p {p.top_p} · top_k {p.top_k} · max_tokens "
                f"{p.max_tokens} · seed {p.seed}{more} · evict {ev.policy} · budget {ev.budget}"
                f" · kv_dtype {chat.config.kv_dtype}"
            )
        ]
    if key not in SETTINGS:
        raise LocalkvError(f"unknown setting {key!r}: use one of {', '.join(SETTINGS)}")
    if not value:
        raise LocalkvError(f"/set {key} needs a value")
    if key in ENGINE_KEYS:
        config = _engine_setting(chat.config, key, value).validate()  # a bad value fails here, before any rebuild
        return [
            Say(f"{key} = {value}: building a new engine (the in-memory prefix cache starts empty)"),
            Rebuild(config),
        ]
    parsed = stop_strings(value) if key == "stop" else switch(key, value) if key == "think" else number(key, value)
    params = replace(chat.params, **{key: parsed}).validate()
    return [UseParams(params), Say(f"{key} = {_shown(getattr(params, key))}")]


def _engine_setting(config: EngineConfig, key: str, value: str) -> EngineConfig:
    if key == "kv_dtype":
        return replace(config, kv_dtype=value.lower())
    ev = config.evict
    ev = replace(ev, policy=value.lower()) if key == "evict" else replace(ev, budget=number(key, value))
    return replace(config, evict=ev)


def stop_strings(value: str) -> tuple[str, ...]:
    """/set stop's value: shell-style words ("a b" is one string); none/off clears them."""
    if value.strip().lower() in ("none", "off"):
        return ()
    try:
        return tuple(shlex.split(value))
    except ValueError as e:
        raise LocalkvError(f"invalid stop strings {value!r}: {e}") from None


def switch(key: str, value: str) -> bool:
    """An on/off /set value."""
    text = value.strip().lower()
    if text not in ("on", "off", "true", "false", "yes", "no"):
        raise LocalkvError(f"invalid {key} {value!r}: expected on or off")
    return text in ("on", "true", "yes")


def _shown(v) -> str:
    if isinstance(v, tuple):  # stop strings, quoted as /set stop takes them
        return " ".join(shlex.quote(s) for s in v) or "(none)"
    return str(v)


def number(key: str, value: str) -> float | int | None:
    """A /set value: a float for FLOATS, else an int; none/off clears seed and budget."""
    text = value.strip().lower()
    if key in ("seed", "budget") and text in ("none", "off"):
        return None
    try:
        return float(text) if key in FLOATS else int(text)
    except ValueError:
        raise LocalkvError(f"invalid {key} {value!r}: expected a number") from None


@dataclass(frozen=True, slots=True)
class Command:
    handler: Handler
    anytime: bool = False  # also while a reply streams (it does not touch the engine or the branch)


COMMANDS: dict[str, Command] = {
    "help": Command(help_, anytime=True),
    "bye": Command(bye, anytime=True),
    "branches": Command(branches, anytime=True),
    "save": Command(save, anytime=True),
    "clear": Command(clear),
    "system": Command(system),
    "set": Command(set_),
    "fork": Command(fork),
    "regen": Command(regen),
}
