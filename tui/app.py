"""`localkv chat`: a Textual chat over the engine, with the conversation tree and a live KV panel.

Threading: the engine is not thread-safe, so everything that touches it while a reply streams
(generate, freeing the sequence, pool reads for the panel, building a new engine) runs in one
worker thread at a time; the UI thread reads the engine only while `busy` is False."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Footer, Header, Tree

from localkv.conversations.store import ConversationStore, preview
from localkv.conversations.turn import Turn
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.generation import Generation, Result
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.tui.kv_panel import KVPanel, KVSnapshot
from localkv.tui.widgets import BranchTree, ChatMessage, Notice, PromptInput, clean

FLUSH_S = 0.05  # streamed text reaches the UI at most this often: one Markdown append per batch
RATE_S = 0.25  # tokens/s sample period; the worker also snapshots the pool for the panel this often
WIDE = 100  # below this many columns only one side panel is shown at a time
SETTINGS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "evict", "budget")
ALIASES = {"?": "help", "exit": "bye", "quit": "bye", "tree": "branches"}
HELP = """\
/system TEXT    set the system prompt (a new branch from the root)
/set KEY VALUE  temperature top_p top_k max_tokens seed evict budget
/fork [ID]      branch at the message picked in the tree (or ID)
/branches       the tree: Enter switches branch, f forks, r regenerates
/regen [ID]     regenerate the last reply (or ID's) as a sibling
/clear          start a new conversation
/save           where this conversation is saved
/help  /bye
Esc stops a reply, else leaves the input for the keys: p panel, b tree, r regen, f fork, i input
F2 KV panel · F3 tree · ↑↓ history · Tab focus · Ctrl-Q quit"""


@dataclass(slots=True)
class Outcome:
    """What a generation worker hands back to the UI thread."""

    view: ChatMessage
    user_view: ChatMessage | None
    prompt: str | None
    tail: str = ""
    result: Result | None = None
    reason: str = ""
    error: str = ""
    cid: str | None = None
    user_id: str | None = None
    reply_id: str | None = None
    tps: float | None = None
    snap: KVSnapshot | None = None


def default_factory(engine: Engine) -> Callable[[EvictConfig], Engine]:
    """Rebuild an engine like `engine` (its whole configuration) with another KV policy."""
    return lambda evict: Engine(replace(engine.config, evict=evict))


def _error_line(e: Exception) -> str:
    """One line, as the CLI prints errors: a user's error as is, a bug named as one."""
    return f"error: {e}" if isinstance(e, LocalkvError) else f"error: internal error: {type(e).__name__}: {e}"


def _number(key: str, value: str):
    text = value.strip().lower()
    if key in ("seed", "budget") and text in ("none", "off"):
        return None
    try:
        return float(text) if key in ("temperature", "top_p") else int(text)
    except ValueError:
        raise LocalkvError(f"invalid {key} {value!r}: expected a number") from None


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses elsewhere keep it
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop reply", priority=True),  # only while busy: see check_action
        Binding("ctrl+c", "stop", "Stop reply", show=False, priority=True),
        Binding("f2,p", "toggle_panel", "KV panel"),
        Binding("f3,b", "toggle_tree", "Branches"),
        Binding("r", "regen", "Regenerate", show=False),
        Binding("f", "fork", "Fork", show=False),
        Binding("i", "focus('prompt')", "Type", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]
    busy = reactive(False, bindings=True)
    show_panel = reactive(True, init=False)
    show_tree = reactive(False, init=False)

    def __init__(
        self,
        engine: Engine | Callable[[EvictConfig], Engine],
        store: ConversationStore | None = None,
        conversation: str | None = None,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        factory: Callable[[EvictConfig], Engine] | None = None,
        leaf: str | None = None,
        panel: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__()
        if isinstance(engine, Engine):
            self.engine, self.factory = engine, factory or default_factory(engine)
        else:  # a factory: the engine is built in a worker once the UI is up
            self.engine, self.factory = None, engine
        self.store = store or ConversationStore()
        self.params = sampling or SamplingParams()
        self.clock, self._want_panel = clock, panel
        self.cid, self.at, self.system = conversation, leaf, system
        if conversation and leaf is None:
            last = self.store.latest_leaf(conversation)
            self.at = last.id if last else None
        if self.at:
            self.system = self._branch_system(self.store.path(self.at))
        self._stop = threading.Event()  # set by Esc/Ctrl-C; the worker checks it between pieces
        self._quitting = False
        self._snap: KVSnapshot | None = None  # the worker's latest copy of the KV numbers

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Container(id="body"):  # the side panels dock inside it, between header and footer
            yield BranchTree("conversation", id="tree")
            yield KVPanel(id="panel")
            yield VerticalScroll(id="transcript")
            yield PromptInput(placeholder="Send a message (/help for commands)", id="prompt")
        yield Footer()

    @property
    def panel(self) -> KVPanel:
        return self.query_one(KVPanel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)

    async def on_mount(self) -> None:
        self.show_panel = self.size.width >= WIDE if self._want_panel is None else self._want_panel
        self._apply_sides()
        self.transcript.anchor()  # follow the reply as it grows, until the user scrolls up
        self.prompt.focus()
        self.set_interval(RATE_S, self._tick)
        await self._show_branch()
        if self.engine is None:
            self.busy = True
            await self._say("loading the model…")
            self._rebuild(EvictConfig())
        else:
            self._tick()

    def exit(self, *args, **kwargs) -> None:
        self._quitting = True  # from now on the worker stops and no longer calls into the UI
        self._stop.set()
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
        self._quitting = True
        self._stop.set()

    def watch_show_panel(self, show: bool) -> None:
        if show and self.show_tree and self.size.width < WIDE:
            self.show_tree = False
        self._apply_sides()

    def watch_show_tree(self, show: bool) -> None:
        if show and self.show_panel and self.size.width < WIDE:
            self.show_panel = False
        self._apply_sides()

    def _apply_sides(self) -> None:
        self.panel.display, self.query_one(BranchTree).display = self.show_panel, self.show_tree
        if self.focused is not None and not self.focused.display:
            self.prompt.focus()
        if self.show_panel:
            self._tick()

    def on_resize(self) -> None:
        if self.size.width < WIDE and self.show_panel and self.show_tree:
            self.show_panel = False

    def _update_header(self) -> None:
        eng = self.engine
        device = getattr(getattr(eng, "ops", None), "name", None) or (
            "CPU" if isinstance(eng.pool.k, np.ndarray) else "GPU"
        )
        self.title = eng.cfg.name
        self.sub_title = f"{device} · system: {preview(self.system, 48) if self.system else 'none'}"

    # ------------------------------------------------------------ transcript and tree

    async def _say(self, text: str, error: bool = False) -> None:
        await self.transcript.mount(Notice(text, error))
        self.transcript.scroll_end(animate=False)

    def _branch_system(self, path) -> str | None:
        return path[0].content if path and path[0].role == "system" else None

    async def _show_branch(self) -> None:
        """Re-render the transcript (the path to self.at) and the tree from the store."""
        path = self.store.path(self.at) if self.at else []
        short = self.store.short_id
        views = [ChatMessage(m.role, m.content, m.id, short(m.id)) for m in path]
        if not path and self.system:  # a system prompt not saved yet: it goes in with the next message
            views.insert(0, ChatMessage("system", self.system))
        await self.transcript.remove_children()
        await self.transcript.mount_all(views)
        self.transcript.scroll_end(animate=False)
        self._show_tree({m.id for m in path})
        if self.engine is not None:
            self._update_header()

    def _show_tree(self, path: set[str] | None = None) -> None:
        tree = self.query_one(BranchTree)
        if self.cid is None:
            tree.clear()
            tree.root.set_label("new conversation")
            return
        if path is None:
            path = {m.id for m in self.store.path(self.at)} if self.at else set()
        tree.show(self.store.tree(self.cid), path, self.at)

    async def _goto(self, cid: str, at: str | None, system: str | None = None) -> None:
        self.cid, self.at = cid, at
        self.system = self._branch_system(self.store.path(at)) if at else system
        await self._show_branch()

    # ------------------------------------------------------------ input

    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        self.prompt.remember(text)
        if text.startswith("/"):
            await self._command(text)
        elif self.busy:
            await self._say("busy: wait for the reply, or press Esc to stop it", error=True)
        else:
            await self._send(text)

    async def _command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        handler = getattr(self, f"_cmd_{name}", None) if name.isalpha() else None
        if handler is None:
            await self._say(f"unknown command /{name}: /help lists the commands", error=True)
        elif self.busy and name not in ("help", "bye", "branches", "save"):
            await self._say(f"busy: /{name} must wait for the reply (Esc stops it)", error=True)
        else:
            try:
                await handler(arg.strip())
            except LocalkvError as e:
                await self._say(f"error: {e}", error=True)

    async def _cmd_help(self, arg: str) -> None:
        await self._say(HELP)

    async def _cmd_bye(self, arg: str) -> None:
        self.exit()

    async def _cmd_clear(self, arg: str) -> None:
        await self._goto(None, None, self.system)
        await self._say("new conversation" + (" (same system prompt)" if self.system else ""))

    async def _cmd_save(self, arg: str) -> None:
        if self.cid is None:
            await self._say("nothing to save yet: each exchange is saved when its reply ends")
            return
        c = self.store.get_conversation(self.cid)
        await self._say(
            f"saved as conversation {c['id']} ({c['messages']} messages, {c['branches']} branches) in "
            f"{self.store.db_path}: `localkv chat --cid {c['id']}` continues it"
        )

    async def _cmd_system(self, arg: str) -> None:
        if not arg:
            await self._say(f"system prompt: {self.system or '(none)'}")
            return
        # the system prompt is the root of a branch: a new one starts a new branch from the root
        await self._goto(self.cid, None, arg)
        await self._say(
            "system prompt set" + (": the next message starts a new branch from the root" if self.cid else "")
        )

    async def _cmd_branches(self, arg: str) -> None:
        self.show_tree = True
        self.query_one(BranchTree).focus()

    async def _cmd_set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        key, value = key.lower().replace("-", "_"), value.strip()
        if not key:
            p, ev = self.params, self.engine.evict
            await self._say(
                f"temperature {p.temperature} · top_p {p.top_p} · top_k {p.top_k} · max_tokens "
                f"{p.max_tokens} · seed {p.seed} · evict {ev.policy} · budget {ev.budget}"
            )
            return
        if key not in SETTINGS:
            raise LocalkvError(f"unknown setting {key!r}: use one of {', '.join(SETTINGS)}")
        if not value:
            raise LocalkvError(f"/set {key} needs a value")
        if key in ("evict", "budget"):
            ev = (
                replace(self.engine.evict, policy=value.lower())
                if key == "evict"
                else replace(self.engine.evict, budget=_number(key, value))
            )
            ev.validate(self.engine.block_size)  # a bad policy fails here, before any rebuild
            self.busy = True
            await self._say(f"{key} = {value}: building a new engine (the in-memory prefix cache starts empty)")
            self._rebuild(ev)
        else:
            params = replace(self.params, **{key: _number(key, value)})
            params.validate()
            self.params = params
            await self._say(f"{key} = {getattr(params, key)}")

    async def _cmd_fork(self, arg: str) -> None:
        if arg:
            await self._fork(self.store.resolve_message(arg))
            return
        tree = self.query_one(BranchTree)
        node = tree.cursor_node if self.show_tree else None
        if node is None or not node.data:
            self.show_tree = True
            tree.focus()
            await self._say("pick the message to branch at in the tree and press f (or /fork ID)")
            return
        await self._fork(node.data)

    async def _fork(self, mid: str) -> None:
        msg = self.store.get_message(mid)
        # the next message goes under the chosen one; at a question, beside it (an edited question)
        at = msg.parent_id if msg.role == "user" else msg.id
        system = self._branch_system(self.store.path(mid))
        await self._goto(msg.conversation_id, at, system)
        what = "instead of that question" if msg.role == "user" else "after it"
        await self._say(f"forked at {self.store.short_id(mid)}: your next message starts a new branch {what}")
        self.prompt.focus()

    async def _cmd_regen(self, arg: str) -> None:
        mid = self.store.resolve_message(arg) if arg else self.at
        if mid is None:
            raise LocalkvError("nothing to regenerate yet")
        msg = self.store.get_message(mid)
        user = self.store.get_message(msg.parent_id) if msg.role == "assistant" and msg.parent_id else msg
        if user.role != "user":
            raise LocalkvError(f"message {self.store.short_id(mid)} is a {msg.role} message: nothing to regenerate")
        p = self.params
        if p.seed is not None:  # reproducible, yet not the sibling already there (`localkv fork` does seed + i)
            n = sum(1 for c in self.store.children(user.id) if c.role == "assistant")
            p = replace(p, seed=p.seed + n)
        await self._goto(user.conversation_id, user.id)
        view = ChatMessage("assistant")
        await self.transcript.mount(view)
        self._start(self._turn(), None, p, view, None)

    async def _send(self, text: str) -> None:
        turn = self._turn()
        user_view, view = ChatMessage("user", text), ChatMessage("assistant")
        await self.transcript.mount_all([user_view, view])
        self._start(turn, text, self.params, view, user_view)

    def _turn(self) -> Turn:
        """Where the next exchange attaches, as `localkv run` plans it (conversation.Turn)."""
        path = self.store.path(self.at) if self.at else []
        return Turn(
            self.store,
            self.cid,
            self.at,
            [{"role": m.role, "content": m.content} for m in path],
            system=None if path else self.system,
        )

    # ------------------------------------------------------------ actions (keys)

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "stop":
            return self.busy  # otherwise Esc/Ctrl-C fall through (Ctrl-C copies in the input)
        return True

    def action_stop(self) -> None:
        self._stop.set()

    def action_toggle_panel(self) -> None:
        self.show_panel = not self.show_panel

    def action_toggle_tree(self) -> None:
        self.show_tree = not self.show_tree
        if self.show_tree:
            self.query_one(BranchTree).focus()

    async def action_regen(self) -> None:
        await self._command("/regen")

    async def action_fork(self) -> None:
        await self._command("/fork")

    @on(BranchTree.Fork)
    async def _tree_fork(self, event: BranchTree.Fork) -> None:
        await self._command(f"/fork {event.mid}")

    @on(BranchTree.Regen)
    async def _tree_regen(self, event: BranchTree.Regen) -> None:
        await self._command(f"/regen {event.mid}")

    @on(Tree.NodeSelected)
    async def _switch(self, event: Tree.NodeSelected) -> None:
        """Switch to the branch through the chosen message: its newest descendant at each step."""
        mid = event.node.data
        if not mid:
            return
        if self.busy:
            await self._say("busy: switch branches when the reply ends (Esc stops it)", error=True)
            return
        while kids := self.store.children(mid):
            mid = kids[-1].id
        await self._goto(self.cid, mid)

    # ------------------------------------------------------------ generation (worker thread)

    def _start(
        self, turn: Turn, prompt: str | None, params: SamplingParams, view: ChatMessage, user_view: ChatMessage | None
    ) -> None:
        self.busy = True
        self._stop.clear()
        view.border_subtitle = "…"
        self.transcript.scroll_end(animate=False)
        self._generate(turn, prompt, params, view, user_view)

    def _ui(self, fn, *args) -> None:
        if self._quitting:
            return
        try:
            self.call_from_thread(fn, *args)
        except Exception:
            if not self._quitting:
                raise
            # closing: the widgets may be gone already, and nobody is left to show it to

    @work(thread=True, exclusive=True, group="engine")
    def _generate(
        self, turn: Turn, prompt: str | None, params: SamplingParams, view: ChatMessage, user_view: ChatMessage | None
    ) -> None:
        eng, clock = self.engine, self.clock
        out = Outcome(view, user_view, prompt)
        try:
            tok = eng.tokenizer
            gen = Generation(eng, tok.encode(tok.render_chat(turn.messages(prompt))), params)
        except Exception as e:  # too long for the context, pool too small, ...: nothing ran
            out.error, out.snap = _error_line(e), KVSnapshot.of(eng)
            self._ui(self._finish, out)
            return
        it, buf, r = iter(gen), [], gen.result
        self._snap = KVSnapshot.of(eng)  # the prefix lookup is done: its reuse shows before the prefill ends
        self._ui(self._started, view, r.cached_tokens, r.prompt_tokens)
        t_flush = t_rate = clock()
        t_first, n_rate = None, 0
        try:
            for piece in it:
                buf.append(piece.text)
                now = clock()
                if t_first is None:  # rates count decode only, not the prefill before the first piece
                    t_first = t_rate = now
                    n_rate = len(r.tokens)
                if now - t_flush >= FLUSH_S:
                    tps = None
                    if now - t_rate >= RATE_S:
                        tps, t_rate, n_rate = (len(r.tokens) - n_rate) / (now - t_rate), now, len(r.tokens)
                        self._snap = KVSnapshot.of(eng)  # the panel's timer shows it
                    self._ui(self._stream, view, "".join(buf), tps)
                    buf.clear()
                    t_flush = now
                if self._stop.is_set():
                    break
        except Exception as e:  # keep the UI and what was generated
            out.error = _error_line(e)
        finally:
            it.close()  # frees the sequence now, in this thread
        t_end = clock()
        out.tail, out.result = "".join(buf), r
        out.reason = r.finish_reason or ("error" if out.error else "stopped")
        if t_first is not None and t_end > t_first and len(r.tokens) > 1:
            out.tps = (len(r.tokens) - 1) / (t_end - t_first)
        if not out.error or r.tokens:
            try:
                out.user_id, ids = turn.save(
                    eng.cfg.name, prompt, [(r.text, r.completion_tokens)], r.prompt_tokens, params
                )
                out.cid, out.reply_id = turn.conversation_id, ids[0]
            except LocalkvError as e:
                out.error = f"error: not saved: {e}"
        out.snap = KVSnapshot.of(eng)
        self._ui(self._finish, out)

    def _started(self, view: ChatMessage, cached: int, prompt: int) -> None:
        view.border_subtitle = f"{cached}/{prompt} cached · …"
        self.panel.last_turn = (cached, prompt)
        self._tick()

    async def _stream(self, view: ChatMessage, text: str, tps: float | None) -> None:
        await view.append(clean(text))
        if tps is not None:
            self.panel.add_rate(tps)
            self.panel.set_rate(f"{tps:.1f} now")

    async def _finish(self, out: Outcome) -> None:
        r = out.result
        if r is None:  # refused before any work: nothing saved, the text goes back to the input to edit
            await out.view.remove()
            if out.user_view is not None:
                await out.user_view.remove()
                self.prompt.value = out.prompt or ""
        else:
            if out.tail:
                await out.view.append(clean(out.tail))
            out.view.border_subtitle = (
                f"{r.completion_tokens} tok · {r.cached_tokens}/{r.prompt_tokens} cached · {out.reason}"
            )
            self.panel.last_turn = (r.cached_tokens, r.prompt_tokens)
            if out.tps is not None:
                self.panel.add_rate(out.tps)
                self.panel.set_rate(f"{out.tps:.1f} last reply")
        if out.reply_id:
            short = self.store.short_id
            self.cid, self.at = out.cid, out.reply_id
            out.view.mid = out.reply_id
            out.view.set_id(short(out.reply_id))
            if out.user_view is not None:
                out.user_view.mid = out.user_id
                out.user_view.set_id(short(out.user_id))
            self._show_tree()
        if out.error:
            await self._say(out.error, error=True)
        self._snap = out.snap
        self.panel.snapshot = out.snap
        self.busy = False

    # ------------------------------------------------------------ engine (re)building

    @work(thread=True, exclusive=True, group="engine")
    def _rebuild(self, evict: EvictConfig) -> None:
        try:
            eng, err = self.factory(evict), ""
        except Exception as e:  # the old engine stays
            eng, err = None, _error_line(e)
        self._ui(self._rebuilt, eng, err)

    async def _rebuilt(self, engine: Engine | None, error: str) -> None:
        if engine is None:
            await self._say(error, error=True)
        else:
            self.engine = engine
            self._update_header()
            ev = engine.evict
            await self._say(
                f"ready: {engine.cfg.name}, KV policy {ev.policy}"
                + (f", budget {ev.budget} tokens" if ev.budget is not None else "")
            )
        self.busy = self.engine is None
        self._tick()

    def _tick(self) -> None:
        """Panel refresh: the worker's copy while it runs, else a fresh one (the engine is idle)."""
        if not self.show_panel or self._quitting or (self.engine is None and self._snap is None):
            return
        panels = self.query(KVPanel)
        if not panels:  # the interval timer can still fire while the app tears its widgets down
            return
        snap = self._snap if self.busy else KVSnapshot.of(self.engine)
        if snap is not None:
            panels.first().snapshot = snap
