"""The work that touches the engine off the UI thread: one reply (generate, save, free) and building
an engine. Each runs in a Textual thread worker and reports only by posting Messages (`post` is the
app's thread-safe post_message, which drops them once the app is closing); the app reacts in its
handlers on the UI thread. Only one such worker runs at a time (see the rule in app.py)."""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from textual.message import Message

from localkv import next_turn, reasoning
from localkv.config import EngineConfig
from localkv.conversations.turn import Turn
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.generation import Generation, Result
from localkv.progress import PrefillProgress
from localkv.sampling import SamplingParams
from localkv.tui.widgets.kv_panel import KVSnapshot

FLUSH_S = 0.05  # streamed text reaches the UI at most this often: one Markdown append per batch
RATE_S = 0.25  # tokens/s sample period; the worker also snapshots the pool for the panel this often

Post = Callable[[Message], object]


@dataclass
class ReplyStarted(Message):
    """The prefix lookup is done: how much of the prompt was cached, and the pool after it."""

    cached_tokens: int
    prompt_tokens: int
    snap: KVSnapshot


@dataclass
class ReplyChunk(Message):
    """Text streamed since the last chunk (a thinking model's thinking apart); every RATE_S also
    the decode rate and the pool."""

    text: str
    tps: float | None = None
    snap: KVSnapshot | None = None
    reasoning: str = ""


@dataclass
class ReplyProgress(Message):
    """A long prefill's progress (PrefillProgress.long), and once more when it is done."""

    progress: PrefillProgress


@dataclass
class ReplyDone(Message):
    """The reply ended (or was refused: result None, nothing ran). `tail` is the text not sent yet
    (the whole thinking is the result's); the ids are set when the exchange was saved."""

    result: Result | None
    snap: KVSnapshot
    tail: str = ""
    reason: str = ""  # the finish reason, or stopped / error
    error: str = ""  # one line for the transcript
    tps: float | None = None  # decode rate of the whole reply
    cid: str | None = None
    user_id: str | None = None
    reply_id: str | None = None
    next_prefix: list[int] = field(default_factory=list)  # the next turn's start, to warm (next_turn.py)


@dataclass
class Warmed(Message):
    """The warm after a reply ended (or was stopped: new input came); `error` if it failed."""

    error: str = ""


@dataclass
class EngineReady(Message):
    """A new engine (None if building it failed: `error` says why, and the old one stays)."""

    engine: Engine | None
    error: str = ""


def error_line(e: Exception) -> str:
    """One line, as the CLI prints errors: a user's error as is, a bug named as one."""
    return f"error: {e}" if isinstance(e, LocalkvError) else f"error: internal error: {type(e).__name__}: {e}"


def build_engine(config: EngineConfig, post: Post) -> None:
    try:
        post(EngineReady(Engine(config)))
    except Exception as e:  # the old engine stays
        post(EngineReady(None, error_line(e)))


def generate(
    engine: Engine,
    turn: Turn,
    prompt: str | None,
    params: SamplingParams,
    post: Post,
    stop: threading.Event,
    clock: Callable[[], float],
    n: int = 1,
) -> None:
    """One reply to `turn` plus `prompt` (None: a new reply to the turn's last question), streamed,
    saved with Turn.save (even when stopped or failed, if any token came) and freed. `stop` ends
    it between pieces. n > 1: the prompt forks into n branches that share its blocks, decoded
    as one batch; the first streams, all are saved as siblings."""
    try:
        tok = engine.tokenizer
        text, thinking = reasoning.chat(tok, turn.messages(prompt), params)
        gen = Generation(engine, tok.encode(text), params, n=n, on_progress=_progress_to(post), reasoning=thinking)
    except Exception as e:  # too long for the context, pool too small, ...: nothing ran
        post(ReplyDone(None, KVSnapshot.of(engine), error=error_line(e)))
        return
    r = gen.result
    gen.admit()  # the prefix lookup, now: its reuse shows before the prefill ends
    post(ReplyStarted(r.cached_tokens, r.prompt_tokens, KVSnapshot.of(engine)))
    tail, error, t_first, t_end = _stream(engine, gen, post, stop, clock)
    reason = r.finish_reason or ("error" if error else "stopped")
    done = ReplyDone(r, KVSnapshot.of(engine), tail, reason, error)
    if t_first is not None and t_end > t_first and len(r.tokens) > 1:
        done.tps = (len(r.tokens) - 1) / (t_end - t_first)
    if not error or r.tokens:
        try:
            replies = [(b.text, len(b.tokens), b.reasoning) for b in r.branches]
            done.user_id, ids = turn.save(engine.model_config.name, prompt, replies, r.prompt_tokens, params)
            done.cid, done.reply_id = turn.conversation_id, ids[0]
        except LocalkvError as e:
            done.error = f"error: not saved: {e}"
    if n == 1 and r.finish_reason is not None and not error and not stop.is_set() and engine.prefix_caching:
        done.next_prefix = next_turn.prefix_ids(tok, turn.messages(prompt), r.text, params)
    post(done)


def warm(engine: Engine, ids: list[int], post: Post, stop: threading.Event) -> None:
    """Prefill the next turn's start (ReplyDone.next_prefix) while the user reads and types;
    `stop` (set by new input) ends it between chunks."""
    try:
        next_turn.warm(engine, ids, stop.is_set)
        post(Warmed())
    except Exception as e:  # the chat goes on; the next turn prefills what is missing
        post(Warmed(error_line(e)))


def _progress_to(post: Post) -> Callable[[PrefillProgress], None]:
    """A Generation's on_progress: a long prefill's progress to the reply's frame; the end of
    one that was shown, so the frame goes back to the reply's own line."""
    shown = False

    def report(p: PrefillProgress):
        nonlocal shown
        if p.long or (shown and p.finished):
            shown = True
            post(ReplyProgress(p))

    return report


def _stream(
    engine: Engine, gen: Generation, post: Post, stop: threading.Event, clock: Callable[[], float]
) -> tuple[str, str, float | None, float]:
    """Run the generation to its end (or `stop`), posting text (and thinking) in batches; the
    sequence is freed here, in this thread. Returns (text not posted yet, error line, first
    piece's time, end time)."""
    it, buf, thought, r, error = iter(gen), [], [], gen.result, ""
    t_flush = t_rate = clock()
    t_first, n_rate = None, 0
    try:
        for piece in it:
            if piece.choice != 0:  # a fork's other branches show in the tree once saved
                if stop.is_set():
                    break
                continue
            buf.append(piece.text)
            thought.append(piece.reasoning)
            now = clock()
            if t_first is None:  # rates count decode only, not the prefill before the first piece
                t_first = t_rate = now
                n_rate = len(r.tokens)
            if now - t_flush >= FLUSH_S:
                chunk = ReplyChunk("".join(buf), reasoning="".join(thought))
                if now - t_rate >= RATE_S:
                    chunk.tps, t_rate, n_rate = (len(r.tokens) - n_rate) / (now - t_rate), now, len(r.tokens)
                    chunk.snap = KVSnapshot.of(engine)  # the panel's timer shows it
                post(chunk)
                buf.clear()
                thought.clear()
                t_flush = now
            if stop.is_set():
                break
    except Exception as e:  # keep the UI and what was generated
        error = error_line(e)
    finally:
        it.close()  # frees the sequence now, in this thread
    return "".join(buf), error, t_first, clock()
