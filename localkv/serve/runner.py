"""The engine's one thread: it loads the model, then steps the Scheduler while there is work and
sleeps when there is none. The HTTP side (an asyncio loop in another thread) hands it Jobs and
is woken, through its loop, when a job has new text or is done.

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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.generation import Generation
from localkv.scheduler import Scheduler
from localkv.serve.metrics import Counters, Snapshot


class QueueFull(LocalkvError):
    """More requests in flight than the server takes (its seats and its queue)."""


@dataclass(eq=False, slots=True)
class Job:
    """One HTTP request's generations (a completion request may hold several prompts) and the
    event its handler waits on. `error` is set when a step failed under it."""

    gens: list[Generation]
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event
    error: str = ""
    cancelled: bool = False
    _counted: list[int] = field(default_factory=list)  # tokens already in the counters, per generation
    _timed: list[bool] = field(default_factory=list)  # first token already in the TTFT histogram
    _waking: bool = False  # a wake is on its way to the loop: do not send another

    @property
    def done(self) -> bool:
        return bool(self.error) or all(g.done for g in self.gens)

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

    def __init__(
        self, config: EngineConfig, max_seqs: int = 64, max_queue: int = 256, batch_tokens: int = 2048, log=None
    ):
        if max_seqs < 1 or max_queue < 0 or batch_tokens < 1:
            raise LocalkvError(
                f"invalid --max-seqs {max_seqs} / --max-queue {max_queue} / --batch-tokens {batch_tokens}: "
                "need >= 1, >= 0 and >= 1"
            )
        self.config, self.max_seqs, self.max_queue, self.batch_tokens = config, max_seqs, max_queue, batch_tokens
        self.state, self.error = "loading", ""
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.counters = Counters()
        self.load_s = 0.0
        self.created = time.time()
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._jobs: list[Job] = []  # the engine thread's list
        self._new: deque[Job] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.on_state: Callable[[str], None] | None = None  # called (engine thread) once ready or failed

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

    def submit(self, gens: list[Generation], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue the generations of one request; QueueFull when the server holds its limit."""
        with self._lock:
            if self._in_flight + len(gens) > self.max_seqs + self.max_queue:
                self.counters.count("refused")
                raise QueueFull(
                    f"the server is full: {self._in_flight} requests in flight (--max-seqs {self.max_seqs} "
                    f"+ --max-queue {self.max_queue}); retry later"
                )
            self._in_flight += len(gens)
        job = Job(gens, loop, asyncio.Event(), _counted=[0] * len(gens), _timed=[False] * len(gens))
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
            fut.set_exception(LocalkvError(self.error or "the server is shutting down"))
            return fut
        self._calls.append((fn, fut))
        self._wake.set()
        return fut

    def snapshot(self) -> Snapshot:
        """The pool and scheduler numbers (engine thread only: use call(runner.snapshot))."""
        return Snapshot.of(self.engine, self.scheduler)

    def close(self, timeout: float = 10.0):
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the engine's thread

    def _main(self):
        t0 = time.perf_counter()
        try:
            self.engine = self.make_engine(self.config)
            self.scheduler = Scheduler(self.engine, max_seqs=self.max_seqs, token_budget=self.batch_tokens)
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
            self._log(f"localkv serve: the engine thread stopped:\n{traceback.format_exc()}")
        finally:
            self._shutdown()

    def _loop(self):
        sched = self.scheduler
        while not self._stopping:
            self._wake.clear()
            self._run_calls()
            while self._new:
                self._jobs.append(self._new.popleft())
            if sched.busy:
                self._step()
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

    def _step(self):
        try:
            self.scheduler.step()
        except Exception as e:  # a bug: fail the requests in flight, free their blocks, keep serving
            self._log(
                f"localkv serve: a step failed, requests in flight are answered with an error:\n"
                f"{traceback.format_exc()}"
            )
            message = str(e) if isinstance(e, LocalkvError) else f"internal error: {type(e).__name__}: {e}"
            for job in [*self._jobs, *self._new]:
                job.error = message
            self.scheduler.abort_all("error")
        self._after_step()

    def _after_step(self):
        """Count new tokens, time first tokens, wake the handlers with news, drop finished jobs."""
        c, kept, woken = self.counters, [], []
        for job in self._jobs:
            news = False
            for i, g in enumerate(job.gens):
                r = g.result
                n = sum(len(b.tokens) for b in r.branches)
                if n != job._counted[i]:
                    c.generated_tokens += n - job._counted[i]
                    job._counted[i], news = n, True
                if r.ttft_s and not job._timed[i]:
                    job._timed[i] = True
                    c.ttft.observe(r.ttft_s)
            if job.done:
                self._finish(job)
                woken.append(job)
            else:
                kept.append(job)
                if news:
                    woken.append(job)
        self._jobs = kept
        notify_all(woken)

    def _finish(self, job: Job):
        c = self.counters
        for g in job.gens:
            c.prompt_tokens += g.result.prompt_tokens
            c.cached_tokens += g.result.cached_tokens
        with self._lock:  # submit() counts refusals from the HTTP thread
            c.count("error" if job.error else "cancelled" if job.cancelled else "completed")
            self._in_flight -= len(job.gens)

    def _shutdown(self):
        """Finish what is left (its handlers get an error) and answer pending calls."""
        if self.scheduler is not None:
            self.scheduler.abort_all("shutdown")
        for job in [*self._jobs, *self._new]:
            job.error = job.error or "the server is shutting down"
            job.notify()
        self._jobs.clear()
        while self._calls:
            _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(LocalkvError("the server is shutting down"))
