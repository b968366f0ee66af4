"""`localkv chat`: a Textual chat over the engine, with the conversation tree and a live KV panel.

Threading: the engine is not thread-safe, so everything that touches it while a reply streams
(generate, freeing the sequence, pool reads for the panel, building a new engine) runs in one
worker thread at a time (tui/worker.py, group "engine"); the UI thread reads the engine only
while `busy` is False. The worker reports through Messages, handled here on the UI thread.
Slash commands are in tui/commands.py; this module applies what they return."""

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container
from textual.reactive import reactive
from textual.widgets import Footer, Header, Tree

from localkv.config import EngineConfig
from localkv.conversations.store import ConversationStore, Message, preview
from localkv.conversations.turn import Turn
from localkv.engine import Engine
from localkv.hub.catalog import display_name
from localkv.sampling import SamplingParams
from localkv.tui import commands as cmd
from localkv.tui.reply import Reply
from localkv.tui.widgets.branch_tree import BranchTree
from localkv.tui.widgets.kv_panel import KVPanel, KVSnapshot
from localkv.tui.widgets.message import ChatMessage, Thinking
from localkv.tui.widgets.prompt import PromptInput
from localkv.tui.widgets.transcript import Transcript
from localkv.tui.worker import (
    RATE_S,
    EngineReady,
    ReplyChunk,
    ReplyDone,
    ReplyProgress,
    ReplyStarted,
    Warmed,
    build_engine,
    generate,
    warm,
)

WIDE = 100  # below this many columns only one side panel is shown at a time


def _branch_system(path: list[Message]) -> str | None:
    return path[0].content if path and path[0].role == "system" else None


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
        engine: Engine | EngineConfig,
        store: ConversationStore | None = None,
        conversation: str | None = None,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        leaf: str | None = None,
        panel: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`engine` may be a config: the engine is then built in a worker once the UI is up."""
        super().__init__()
        self.engine, self._config = (engine, engine.config) if isinstance(engine, Engine) else (None, engine)
        self.store = store or ConversationStore()
        self.params = sampling or SamplingParams()
        self.clock, self._want_panel = clock, panel
        self.cid, self.at, self.system = conversation, leaf, system
        if conversation and leaf is None:
            last = self.store.latest_leaf(conversation)
            self.at = last.id if last else None
        if self.at:
            self.system = _branch_system(self.store.path(self.at))
        self._stop = threading.Event()  # set by Esc/Ctrl-C and on exit; the worker checks it between pieces
        self._warming = False  # a worker prefills the next turn's start (busy is True meanwhile)
        self._queued: str | None = None  # a question sent while it did: asked once the warm stops
        self._reply: Reply | None = None
        self._snap: KVSnapshot | None = None  # the worker's latest copy of the KV numbers

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Container(id="body"):  # the side panels dock inside it, between header and footer
            yield BranchTree("conversation", id="tree")
            yield KVPanel(id="panel")
            yield Transcript(id="transcript")
            yield PromptInput(placeholder="Send a message (/help for commands)", id="prompt")
        yield Footer()

    @property
    def model_name(self) -> str:
        return display_name(self.engine.path, self.engine.model_config.name)

    @property
    def panel(self) -> KVPanel:
        return self.query_one(KVPanel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def branch_tree(self) -> BranchTree:
        return self.query_one(BranchTree)

    @property
    def config(self) -> EngineConfig:
        """The settings of the engine in use (or being built)."""
        return self.engine.config if self.engine is not None else self._config

    @property
    def picked(self) -> str | None:
        node = self.branch_tree.cursor_node if self.show_tree else None
        return node.data if node is not None else None

    async def on_mount(self) -> None:
        self.show_panel = self.size.width >= WIDE if self._want_panel is None else self._want_panel
        self._apply_sides()
        self.prompt.focus()
        self.set_interval(RATE_S, self._tick)
        await self._show_branch()
        if self.engine is None:
            self.busy = True
            await self.transcript.say("loading the model…")
            self._build(self._config)
        else:
            self._tick()

    def exit(self, *args, **kwargs) -> None:
        self._stop.set()  # a streaming reply ends (and is saved) instead of running on unseen
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
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
        self.panel.display, self.branch_tree.display = self.show_panel, self.show_tree
        if self.focused is not None and not self.focused.display:
            self.prompt.focus()
        if self.show_panel:
            self._tick()

    def on_resize(self) -> None:
        if self.size.width < WIDE and self.show_panel and self.show_tree:
            self.show_panel = False

    def _update_header(self) -> None:
        system = preview(self.system, 48) if self.system else "none"
        self.title, self.sub_title = self.model_name, f"{self.engine.backend.name} · system: {system}"

    def _tick(self) -> None:
        """Panel refresh: the worker's copy while it runs, else a fresh one (the engine is idle)."""
        if not self.show_panel or (self.engine is None and self._snap is None):
            return
        panels = self.query(KVPanel)
        if not panels:  # the interval timer can still fire while the app tears its widgets down
            return
        snap = self._snap if self.busy else KVSnapshot.of(self.engine)
        if snap is not None:
            panels.first().snapshot = snap

    # ------------------------------------------------------------ transcript and tree

    async def _show_branch(self) -> None:
        """Re-render the transcript (the path to self.at) and the tree from the store."""
        path = self.store.path(self.at) if self.at else []
        short = self.store.short_id
        views = []
        for m in path:
            if m.reasoning:
                views.append(Thinking(m.reasoning, self._tokens(m.reasoning)))
            views.append(ChatMessage(m.role, m.content, m.id, short(m.id)))
        if not path and self.system:  # a system prompt not saved yet: it goes in with the next message
            views.insert(0, ChatMessage("system", self.system))
        await self.transcript.show(views)
        self._show_tree({m.id for m in path})
        if self.engine is not None:
            self._update_header()

    def _tokens(self, text: str) -> int | None:
        """A saved thinking's size in tokens (the store keeps its text; its tags are not counted)."""
        return len(self.engine.tokenizer.encode(text, add_bos=False)) if self.engine is not None else None

    def _show_tree(self, path: set[str] | None = None) -> None:
        if self.cid is None:
            self.branch_tree.clear()
            self.branch_tree.root.set_label("new conversation")
            return
        if path is None:
            path = {m.id for m in self.store.path(self.at)} if self.at else set()
        self.branch_tree.show(self.store.tree(self.cid), path, self.at)

    async def _goto(self, cid: str | None, at: str | None, system: str | None = None) -> None:
        self.cid, self.at = cid, at
        self.system = _branch_system(self.store.path(at)) if at else system
        await self._show_branch()

    # ------------------------------------------------------------ input and commands

    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        self.prompt.remember(text)
        if text.startswith("/"):
            await self._command(text)
        elif self._warming:  # the warm ends at its next chunk; this question follows
            self._stop.set()
            self._queued = text
        elif self.busy:
            await self.transcript.say("busy: wait for the reply, or press Esc to stop it", error=True)
        else:
            await self._ask(text)

    async def _ask(self, text: str) -> None:
        user_view, view = ChatMessage("user", text), ChatMessage("assistant")
        await self.transcript.add(user_view, view)
        self._start(Reply(view, user_view, text), self.params)

    async def _command(self, line: str) -> None:
        for effect in cmd.run(self, line):
            await self._apply(effect)

    async def _apply(self, effect: cmd.Effect) -> None:
        match effect:
            case cmd.Say(text, error):
                await self.transcript.say(text, error)
            case cmd.Goto(cid, at, system):
                await self._goto(cid, at, system)
            case cmd.UseParams(params):
                self.params = params
            case cmd.Rebuild(config):
                self._build(config)
            case cmd.Regenerate(params, n):
                view = ChatMessage("assistant")
                await self.transcript.add(view)
                self._start(Reply(view, None, None), params, n)
            case cmd.ShowTree():
                self.show_tree = True
                self.branch_tree.focus()
            case cmd.FocusPrompt():
                self.prompt.focus()
            case cmd.Quit():
                self.exit()

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
            self.branch_tree.focus()

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
            await self.transcript.say("busy: switch branches when the reply ends (Esc stops it)", error=True)
            return
        while kids := self.store.children(mid):
            mid = kids[-1].id
        await self._goto(self.cid, mid)

    # ------------------------------------------------------------ the engine's worker and its messages

    def _start(self, reply: Reply, params: SamplingParams, n: int = 1) -> None:
        """Generate a reply to the branch shown (plus reply.prompt, a new question) into reply.view;
        n > 1: n sibling replies of one prompt, the first shown, all saved."""
        path = self.store.path(self.at) if self.at else []
        history = [{"role": m.role, "content": m.content} for m in path]
        turn = Turn(self.store, self.cid, self.at, history, system=None if path else self.system)
        self.busy, self._reply = True, reply
        self._stop.clear()
        reply.view.border_subtitle = "…"
        post, stop = self.post_message, self._stop
        work = partial(generate, self.engine, turn, reply.prompt, params, post, stop, self.clock, n)
        self.run_worker(work, name="reply", group="engine", exclusive=True, thread=True)

    def _build(self, config: EngineConfig) -> None:
        self.busy = True
        work = partial(build_engine, config, self.post_message)
        self.run_worker(work, name="engine", group="engine", exclusive=True, thread=True)

    @on(EngineReady)
    async def _engine_ready(self, event: EngineReady) -> None:
        if event.engine is None:
            await self.transcript.say(event.error, error=True)
        else:
            self.engine = event.engine
            self._update_header()
            ev = self.engine.config.evict
            budget = f", budget {ev.budget} tokens" if ev.budget is not None else ""
            await self.transcript.say(f"ready: {self.model_name}, KV policy {ev.policy}{budget}")
        self.busy = self.engine is None
        self._tick()

    @on(ReplyStarted)
    def _reply_started(self, event: ReplyStarted) -> None:
        self._reply.view.border_subtitle = f"{event.cached_tokens}/{event.prompt_tokens} cached · …"
        self.panel.last_turn = (event.cached_tokens, event.prompt_tokens)
        self._snap = event.snap
        self._tick()

    @on(ReplyProgress)
    def _reply_progress(self, event: ReplyProgress) -> None:
        """A long prefill's progress in the reply's frame (the CLI draws the same on stderr)."""
        p = event.progress
        self._reply.view.border_subtitle = f"{p.cached}/{p.total} cached · …" if p.finished else p.summary()

    @on(ReplyChunk)
    async def _reply_chunk(self, event: ReplyChunk) -> None:
        await self._reply.chunk(self.transcript, event.reasoning, event.text)
        self._snap = event.snap or self._snap
        if event.tps is not None:
            self.panel.add_rate(event.tps, "now")

    @on(ReplyDone)
    async def _reply_done(self, event: ReplyDone) -> None:
        reply, r = self._reply, event.result
        if r is None:  # refused before any work: nothing saved, the text goes back to the input to edit
            text = await reply.withdraw()
            if reply.user_view is not None:
                self.prompt.value = text
        else:
            await reply.finish(self.transcript, r, event.tail, event.reason)
            self.panel.last_turn = (r.cached_tokens, r.prompt_tokens)
            if event.tps is not None:
                self.panel.add_rate(event.tps, "last reply")
        if event.reply_id:
            self.cid, self.at = event.cid, event.reply_id
            for view, mid in ((reply.view, event.reply_id), (reply.user_view, event.user_id)):
                if view is not None:
                    view.mid = mid
                    view.set_id(self.store.short_id(mid))
            self._show_tree()
        if event.error:
            await self.transcript.say(event.error, error=True)
        self._snap = self.panel.snapshot = event.snap
        self._reply, self._warming = None, bool(event.next_prefix)
        self.busy = self._warming  # busy until the warm ends
        if self._warming:
            work = partial(warm, self.engine, event.next_prefix, self.post_message, self._stop)
            self.run_worker(work, name="warm", group="engine", exclusive=True, thread=True)

    @on(Warmed)
    async def _warmed(self, event: Warmed) -> None:
        self._warming = self.busy = False
        if event.error:
            await self.transcript.say(event.error, error=True)
        if (text := self._queued) is not None:
            self._queued = None
            await self._ask(text)
