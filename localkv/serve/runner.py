"""The engine's one thread: it loads the model, then steps the Scheduler while there is work and
sleeps when there is none. The HTTP side (an asyncio loop in another thread) hands it Jobs; after
each step the runner moves each job's new events (Delta, Finished; Failed when the step broke)
onto the job's queue, counting them for /metrics on the way, and wakes the job's handler through
its loop. The handler reads only that queue, never a Generation's state.

Everything that touches the engine or the pool runs here: requests are added and cancelled
through the Scheduler's thread-safe inbox, and anything else (a metrics snapshot, a test's pool
check) is a call() run between two steps.
"""

import asyncio
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from localkv import next_turn
from localkv.config import EngineConfig, ServeOptions
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.events import Delta, Event, Failed
from localkv.generation import Generation
from localkv.scheduler import Scheduler
from localkv.serve.kv_events import Publisher
from localkv.serve.metrics import Counters, Snapshot


class QueueFull(LocalkvError):
    """More requests in flight than the server takes (its seats and its queue)."""


class ShuttingDown(LocalkvError):
    """The server is stopping: it takes no new request."""


STOPPING = "the server is shutting down"
WARMS = 8  # finished chats whose next prefix waits for an idle moment


@dataclass(eq=False, slots=True)
class Job:
    """One HTTP request's generations (a completion request may hold several prompts), the
    events the engine's thread pushes for its handler, and the asyncio event the handler waits
    on. `done` is set (engine thread) once the last event is pushed."""

    gens: list[Generation]
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event
    events: deque[Event] = field(default_factory=deque)
    done: bool = False
    failed: bool = False  # a Failed event was pushed: nothing follows it
    stopped: bool = False  # failed because the server stopped, not because a step broke
    cancelled: bool = False
    after: Callable[[], list[int]] | None = None  # once answered: the tokens to warm while idle (next_turn.py)
    _waking: bool = False  # a wake is on its way to the loop: do not send another

    def take(self) -> list[Event]:
        """The events pushed since the last call (the HTTP side)."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events as they are pushed, a batch per wake, until the job is done."""
        while True:
            done = self.done  # read before taking: every event pushed before it is taken below
            if got := self.take():
                yield got
            if done:
                return
            await self.wake.wait()
            self.wake.clear()

    def fail(self, message: str, stopped: bool = False):
        """From the engine's thread: end the job with Failed (its events from now on are dropped)."""
        if not self.failed:
            self.failed, self.stopped = True, stopped
            self.events.append(Failed(message))

    def notify(self):
        """From the engine's thread: wake the handler (at most one wake in flight)."""
        notify_all([self])

    def _woken(self):
        self._waking = False
        self.wake.set()


def notify_all(jobs: list[Job]):
    """From the engine's thread: wake the handlers of jobs, with one call into each event loop
    (one wake-up of the HTTP thread a step, not one per request streaming)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
    for job in jobs:
        if not job._waking:
            job._waking = True
            by_loop.setdefault(job.loop, []).append(job)
    for loop, woken in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake_jobs, woken)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


def _wake_jobs(jobs: list[Job]):
    for job in jobs:
        job._woken()


class Runner:
    """Owns the engine and its scheduler. state: loading -> ready, or failed (error says why)."""

    make_engine = Engine  # what builds the engine from the config (a subclass may wrap it)

    def __init__(self, config: EngineConfig, opts: ServeOptions | None = None, log=None):
        self.config, self.opts = config, (opts or ServeOptions()).validate()
        self.state, self.error = "loading", ""
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.counters = Counters()
        self.load_s = 0.0
        self.created = time.time()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))  # the server's stderr
        self._jobs: list[Job] = []  # the engine thread's list
        self._new: deque[Job] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._warms: deque[Callable[[], list[int]]] = deque(maxlen=WARMS)  # newest kept: the likeliest next
        self._in_flight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.draining = False  # drain() was called: no new request, those in flight until the deadline
        self._deadline = 0.0  # time.monotonic() past which the requests in flight are ended
        self._thread: threading.Thread | None = None
        self.on_state: Callable[[str], None] | None = None  # called (engine thread) once ready or failed
        o = self.opts  # bound now: a busy endpoint is an error before the model loads
        self.events = Publisher(o.kv_events, o.kv_events_replay, o.kv_events_topic) if o.kv_events else None

    # ------------------------------------------------------------ the HTTP side

    def start(self):
        """Load the model and serve, in the engine's thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="localkv-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Generations submitted and not yet finished."""
        return self._in_flight

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def submit(
        self, gens: list[Generation], loop: asyncio.AbstractEventLoop, after: Callable[[], list[int]] | None = None
    ) -> Job:
        """Queue the generations of one request; QueueFull when the server holds its limit.
        `after`: once they are answered, the token ids to prefill while the server is idle (a
        chat's next prefix, next_turn.py), computed then in the engine's thread."""
        with self._lock:
            o = self.opts
            if self.draining:
                raise ShuttingDown(f"{STOPPING}; retry on another server or once it is back")
            if self._in_flight + len(gens) > o.max_seqs + o.max_queue:
                self.counters.count("refused")
                raise QueueFull(
                    f"the server is full: {self._in_flight} requests in flight (--max-seqs {o.max_seqs} "
                    f"+ --max-queue {o.max_queue}); retry later"
                )
            self._in_flight += len(gens)
        job = Job(gens, loop, asyncio.Event(), after=after)
        self._new.append(job)
        for g in gens:
            self.scheduler.add(g)
        self._wake.set()
        return job

    def cancel(self, job: Job):
        """The client went away: finish the job's generations and free their blocks at the next step."""
        if job.done or job.cancelled:
            return
        job.cancelled = True
        for g in job.gens:
            self.scheduler.cancel(g, "cancelled")
        self._wake.set()

    def call(self, fn: Callable) -> Future:
        """Run fn() on the engine's thread between two steps; its result comes in the Future."""
        fut: Future = Future()
        if self.state == "failed" or self._stopping:
            fut.set_exception(LocalkvError(self.error or STOPPING))
            return fut
        self._calls.append((fn, fut))
        self._wake.set()
        return fut

    def snapshot(self) -> Snapshot:
        """The pool and scheduler numbers (engine thread only: use call(runner.snapshot))."""
        return Snapshot.of(self.engine, self.scheduler)

    def drain(self, timeout: float | None = None):
        """Take no new request; let those in flight finish for timeout seconds (default: the
        options' shutdown_timeout), then end them with an error. Not from a signal handler: it
        takes a lock the interrupted thread may hold."""
        if self.draining:
            return
        self._deadline = time.monotonic() + (self.opts.shutdown_timeout if timeout is None else timeout)
        self.draining = True
        self._wake.set()

    def close(self, timeout: float = 10.0):
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.events is not None:
            self.events.close()

    # ------------------------------------------------------------ the engine's thread

    def _main(self):
        t0 = time.perf_counter()
        try:
            self.engine = self.make_engine(self.config)
            self.scheduler = Scheduler(self.engine, max_seqs=self.opts.max_seqs, token_budget=self.opts.batch_tokens)
            if self.events is not None:
                self.events.watch(self.engine)
        except BaseException as e:  # any failure to load is reported, not raised in a thread
            self.error = str(e) if isinstance(e, LocalkvError) else f"internal error: {type(e).__name__}: {e}"
            self.state = "failed"
            if self.on_state:
                self.on_state("failed")
            return
        self.load_s = time.perf_counter() - t0
        self.state = "ready"
        if self.on_state:
            self.on_state("ready")
        try:
            self._loop()
        except BaseException as e:  # a bug outside a step: refuse from now on rather than hang
            self.error, self.state = f"internal error: {type(e).__name__}: {e}", "failed"
            self.log(f"localkv serve: the engine thread stopped:\n{traceback.format_exc()}")
        finally:
            self._shutdown()

    def _loop(self):
        sched = self.scheduler
        while not self._stopping:
            self._wake.clear()
            self._run_calls()
            while self._new:
                self._jobs.append(self._new.popleft())
            if self.draining and self._jobs and time.monotonic() >= self._deadline:
                self._cut()
            elif sched.busy:
                self._step()
            elif self._warms and not self.draining and not self._calls and not self._new:
                self._warm(self._warms.pop())
            elif not self._calls and not self._new:
                self._wake.wait()

    def _run_calls(self):
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)

    def _warm(self, prefix: Callable[[], list[int]]):
        """Nothing to run: prefill a finished chat's next prefix, until new work comes (a
        submit or call sets the wake). A warm only saves time later: a failure is logged."""
        try:
            self.counters.warmed_tokens += next_turn.warm(self.engine, prefix(), stop=self._wake.is_set)
        except Exception:
            self.log(f"localkv serve: warming a chat's next prompt failed:\n{traceback.format_exc()}")

    def _step(self):
        try:
            self.scheduler.step()
        except Exception as e:  # a bug: fail the requests in flight, free their blocks, keep serving
            self.log(
                f"localkv serve: a step failed, requests in flight are answered with an error:\n"
                f"{traceback.format_exc()}"
            )
            message = str(e) if isinstance(e, LocalkvError) else f"internal error: {type(e).__name__}: {e}"
            while self._new:  # submitted during the step: their generations are aborted too
                self._jobs.append(self._new.popleft())
            for job in self._jobs:
                job.fail(message)
            self.scheduler.abort_all("error")
        self._after_step()

    def _cut(self):
        """The drain's deadline passed: end every request still in flight with an error, so each
        stream still gets its last event; their prompts' blocks are written to disk as they are freed."""
        self.log(
            f"localkv serve: {len(self._jobs)} requests still running after --shutdown-timeout "
            f"{self.opts.shutdown_timeout:g}s: ended with an error"
        )
        for job in self._jobs:
            job.fail(STOPPING, stopped=True)
        self.scheduler.abort_all("shutdown")
        self._after_step()

    def _after_step(self):
        """Hand each job its new events, wake the handlers with news, drop finished jobs."""
        kept, woken = [], []
        for job in self._jobs:
            news = self._forward(job)
            if job.failed or all(g.done for g in job.gens):
                self._finish(job)
                woken.append(job)
            else:
                kept.append(job)
                if news:
                    woken.append(job)
        self._jobs = kept
        notify_all(woken)

    def _forward(self, job: Job) -> bool:
        """Move the events of the job's generations to its queue, counting tokens, prompts and
        first-token times from them (a failed job's are counted, not sent). True if any was sent."""
        c, sent = self.counters, False
        for g in job.gens:
            for ev in g.events():
                if isinstance(ev, Delta):
                    c.generated_tokens += len(ev.token_ids)
                else:
                    c.prompt_tokens += ev.usage.prompt_tokens
                    c.cached_tokens += ev.usage.cached_tokens
                    if ev.ttft_s:
                        c.ttft.observe(ev.ttft_s)
                if not job.failed:
                    job.events.append(ev)
                    sent = True
        return sent

    def _finish(self, job: Job):
        job.done = True
        if job.after is not None and not (job.failed or job.cancelled):
            self._warms.append(job.after)
        with self._lock:  # submit() counts refusals from the HTTP thread
            self.counters.count("error" if job.failed else "cancelled" if job.cancelled else "completed")
            self._in_flight -= len(job.gens)

    def _shutdown(self):
        """Finish what is left (its handlers get an error) and answer pending calls."""
        if self.scheduler is not None:
            self.scheduler.abort_all("shutdown")
        for job in [*self._jobs, *self._new]:
            job.fail(STOPPING, stopped=True)
            job.done = True
            job.notify()
        self._jobs.clear()
        while self._calls:
            _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(LocalkvError(STOPPING))
