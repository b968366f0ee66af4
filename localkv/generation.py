"""One reply's life, for one prompt and n branches: prefill once, fork, decode the live branches
as one batch, sample, stop, stream, write the prompt to the disk cache, free.

With n > 1 every branch is a fork of the prompt's sequence (same block table, ref_count + 1 per
block): full prompt blocks stay shared to the end, and a branch's first write into the shared,
partly filled last block copies it (copy-on-write). `advance` is the one place where a sampled
token is appended to a branch and a branch is declared finished.

Stop strings are matched on the streamed text: text that may be the start of one is held back
until it completes one (the branch finishes "stop"; the stop string and anything after it are
never shown) or cannot any more. The tokens that spelled the stop string were computed, so
their K/V was written; it is freed with the branch's sequence when the branch finishes.
A constrained reply (params.constraint) has one grammar matcher per branch, in its sampler.
"""

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.events import Delta, Finished, Usage
from localkv.model.tokenizer import TokenStreamer
from localkv.progress import PrefillProgress
from localkv.sampling import Sampler, SamplingParams, TokenLogprob
from localkv.scheduler import Scheduler
from localkv.sequence import Sequence
from localkv.stops import StopScanner


@dataclass(slots=True)
class Branch:
    """One reply: its sequence, sampler, streamed text and why it ended."""

    index: int
    seq: Sequence | None  # None once the branch is finished and freed (or while preempted)
    sampler: Sampler
    streamer: TokenStreamer
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop | length | context | kv_budget | interrupted
    stop_detail: str = ""
    peak_active_tokens: int = 0  # most tokens of K/V the branch attended to in one layer
    stored: int = 0  # tokens of K/V it held when it finished
    stops: StopScanner = field(default_factory=lambda: StopScanner(()))
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, with params.logprobs
    streamed: int = 0  # of its tokens, those already in a Delta


@dataclass(slots=True)
class Result:
    branches: list[Branch]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    load_s: float = 0.0
    ttft_s: float = 0.0  # from the request (its prefix lookup included) to the first sampled token
    prompt_s: float = 0.0  # from the request to the prompt's logits: prefix lookup and prefill
    eval_s: float = 0.0
    peak_blocks: int = 0  # most distinct blocks this request's sequences held at once
    unshared_blocks: int = 0  # what the branches would hold without sharing
    cow_copies: int = 0  # shared blocks this request's sequences copied before writing

    @property
    def text(self) -> str:
        return self.branches[0].text if self.branches else ""

    @property
    def tokens(self) -> list[int]:
        return self.branches[0].tokens if self.branches else []

    @property
    def finish_reason(self) -> str:
        return self.branches[0].finish_reason if self.branches else ""

    @property
    def stop_detail(self) -> str:
        return self.branches[0].stop_detail if self.branches else ""

    @property
    def peak_active_tokens(self) -> int:
        return max((b.peak_active_tokens for b in self.branches), default=0)

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)

    def timings(self) -> dict:
        computed = self.prompt_tokens - self.cached_tokens
        decoded = self.completion_tokens - len(self.branches)  # the first token of each comes from the prefill
        return {
            "load_s": round(self.load_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prompt_s": round(self.prompt_s, 4),
            "prompt_tps": round(computed / self.prompt_s, 2) if self.prompt_s else 0.0,
            "eval_s": round(self.eval_s, 4),
            "eval_tps": round(decoded / self.eval_s, 2) if self.eval_s and decoded > 0 else 0.0,
        }


class Generation:
    """One request: a prompt, n branches, how they are sampled. Iterate for the Deltas that have
    text as tokens are sampled (it drives its own Scheduler), or hand it to a shared Scheduler
    (the server) and read .events(): Deltas and a Finished per branch. .result holds the record.
    A request that could never fit the context, the KV budget or the pool is refused when it is
    made, before any work. Ctrl-C during iteration ends it cleanly (live branches finish
    'interrupted') and is re-raised."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        n: int = 1,
        queued: bool = False,
        on_progress: Callable[[PrefillProgress], None] | None = None,
        first_choice: int = 0,
    ):
        """on_progress: called with the prefill's progress after each step that computed part of
        the prompt, and once when it is done (when this Generation drives its own scheduler).
        first_choice: the choice number of branch 0 in its events (a server request with several
        prompts numbers its choices across them)."""
        self._t0 = time.perf_counter()  # TTFT counts the wait, the prefix lookup and the prefill
        self.params = (params or SamplingParams()).validate()
        if n < 1:
            raise LocalkvError(f"invalid branch count {n}: must be >= 1")
        engine.check_fits(len(prompt_ids), self.params.max_tokens, n, queued)  # queued: for a shared scheduler
        c = self.params.constraint  # a bad grammar fails here, before any work
        self.grammar = _compile(c, engine.tokenizer) if c is not None else None
        self.on_progress = on_progress
        self.first_choice = first_choice
        self.engine, self.n, self.prompt = engine, n, list(prompt_ids)
        self.result = Result([], len(prompt_ids), load_s=engine.loaded.load_s)
        self.stop_ids = frozenset() if self.params.ignore_eos else frozenset(engine.tokenizer.stop_ids)
        self.root: Sequence | None = None  # the prompt's sequence until it forks into the branches
        self.done = False
        self._out: deque[Delta | Finished] = deque()  # appended on the engine's thread, read by the consumer
        self._t_prefilled = 0.0
        self._persisted = False
        self._admitted = False
        self._progress_done = False

    # ------------------------------------------------------------ for its consumer

    def __iter__(self) -> Iterator[Delta]:
        sched = Scheduler(self.engine, max_seqs=self.n)
        sched.add(self)
        try:
            while not self.done:
                sched.step()
                self._report_progress()
                yield from self._pieces()
            yield from self._pieces()
        except KeyboardInterrupt:
            self.cancel("interrupted")
            raise
        except GeneratorExit:  # the consumer stopped reading: free everything now
            self.cancel("stopped")
            raise
        except BaseException:
            self.cancel("error")
            raise

    def _report_progress(self):
        if self.on_progress is None or self._progress_done:
            return
        if self._t_prefilled:  # the prompt is computed: one last report, the bar goes away
            self._progress_done = True
            self.on_progress(self._progress(self.result.prompt_tokens))
        elif self.root is not None and self.root.num_computed > self.result.cached_tokens:
            self.on_progress(self._progress(self.root.num_computed))

    def _progress(self, done: int) -> PrefillProgress:
        r = self.result
        return PrefillProgress(done, r.prompt_tokens, r.cached_tokens, time.perf_counter() - self._t0)

    def events(self) -> Iterator[Delta | Finished]:
        """The events since the last call, in order (safe from another thread)."""
        while self._out:
            yield self._out.popleft()

    def _pieces(self) -> Iterator[Delta]:
        return (e for e in self.events() if isinstance(e, Delta) and e.text)

    def run(self) -> Result:
        for _ in self:
            pass
        return self.result

    # ------------------------------------------------------------ for the scheduler

    def admit(self) -> None:
        """Open the prompt's sequence, its leading blocks from the prefix cache (memory, disk).
        A lone request's consumer may call it first, to show the reuse before the prefill."""
        if self._admitted:
            return
        self._admitted = True
        self.root, cached = self.engine.open_sequence(self.prompt)
        if not self.result.branches:  # not a request resumed after a preemption
            self.result.cached_tokens = cached

    def prefilling(self) -> bool:
        return self.root is not None and bool(self.root.pending)

    def prompt_computed(self) -> int:
        return self.root.num_computed if self.root is not None else 0

    def schedulable(self) -> list[Sequence]:
        if self.root is not None:
            return [self.root]
        return [b.seq for b in self.result.branches if b.seq is not None and b.seq.pending]

    def on_logits(self, rows: dict[int, np.ndarray]) -> None:
        """Logits for this request's sequences whose pending tokens are all computed."""
        if self.root is not None:
            if self.root.id not in rows:
                return
            self._fork(rows[self.root.id])
            return
        live = [b for b in self.result.branches if b.seq is not None and b.seq.id in rows and not b.finish_reason]
        self.advance(live, [rows[b.seq.id] for b in live])
        self._after_advance()

    def out_of_budget(self, seq: Sequence, reason: str) -> None:
        for b in self.result.branches:
            if b.seq is seq:
                b.finish_reason, b.stop_detail = "kv_budget", reason
        if self.root is seq:  # the prompt itself does not fit the KV budget's policy
            self.cancel("kv_budget", reason)
            return
        self._after_advance()

    def preempt(self) -> None:
        """Free every block; admit() and the scheduler recompute the prompt and each live
        branch's tokens later (its sampler and text carry on)."""
        self._admitted = False
        if self.root is not None:
            self._free(self.root)
            self.root = None
        for b in self.result.branches:
            if b.seq is not None:
                self._free(b.seq)
                b.seq = None

    def cancel(self, reason: str, detail: str = "") -> None:
        for b in self.result.branches:
            if not b.finish_reason:
                b.finish_reason, b.stop_detail = reason, detail
        if not self.result.branches:
            self.result.branches = [
                Branch(
                    0,
                    None,
                    Sampler(self.params),
                    self.engine.tokenizer.streamer(),
                    finish_reason=reason,
                    stop_detail=detail,
                )
            ]
        self._after_advance()

    # ------------------------------------------------------------ one request's life

    def _fork(self, logits: np.ndarray):
        """The prompt is computed: fork it into the branches (or, after a preemption, back into
        the live ones, their generated tokens pending) and sample each branch's first token."""
        eng, r, root = self.engine, self.result, self.root
        self.root = None
        if not self._t_prefilled:
            self._t_prefilled = time.perf_counter()
            r.prompt_s = self._t_prefilled - self._t0
        if r.branches:  # resuming: each live branch recomputes what it generated
            holders = [b for b in r.branches if not b.finish_reason]
            seqs = [root] + [eng.fork(root) for _ in holders[1:]]
            for b, seq in zip(holders, seqs):
                seq.tokens.extend(b.tokens)
                b.seq = seq
            if not holders:
                self._free(root)
            self._after_advance()
            return
        seqs = [root] + [eng.fork(root) for _ in range(self.n - 1)]
        for i, seq in enumerate(seqs):
            matcher = self.grammar.matcher() if self.grammar is not None else None  # each branch its own
            b = Branch(i, seq, Sampler(self.params.for_branch(i), matcher), eng.tokenizer.streamer())
            b.stops = StopScanner(self.params.stop)
            b.peak_active_tokens = eng.policy.active_tokens(seq)
            r.branches.append(b)
        self.advance(list(r.branches), [logits] * self.n)
        self._after_advance()

    def advance(self, live: list[Branch], rows) -> None:
        """Sample each live branch's next token from its logits row (its tokens so far are the
        penalties' history), append it, stream its text, and finish the branch on a stop token,
        a stop string, max_tokens or the context's end."""
        eng, p, r = self.engine, self.params, self.result
        for b, row in zip(live, rows):
            tok = b.sampler(row, b.seq.tokens)
            if not r.ttft_s:
                r.ttft_s = time.perf_counter() - self._t0
            b.peak_active_tokens = max(b.peak_active_tokens, eng.policy.active_tokens(b.seq))
            if tok in self.stop_ids:
                b.finish_reason = "stop"
                continue
            b.tokens.append(tok)
            b.seq.tokens.append(tok)
            if b.sampler.last is not None:
                b.logprobs.append(b.sampler.last)
            self._emit(b, b.streamer.push(tok))
            if b.finish_reason:  # a stop string
                continue
            if len(b.tokens) >= p.max_tokens:
                b.finish_reason = "length"
            elif len(b.seq.tokens) >= eng.ctx and eng.policy.config.policy == "none":
                b.finish_reason = "context"

    def _emit(self, b: Branch, text: str, last: bool = False):
        """Stream a branch's text past its stop strings, with the tokens sampled since its last
        Delta (last: the branch ended, release what was held back and say why it ended)."""
        shown = b.stops.push(text)
        if b.stops.hit and not b.finish_reason:
            b.finish_reason, b.stop_detail = "stop", f"stop string {b.stops.hit!r}"
        elif last:
            shown += b.stops.flush()
        b.text += shown
        choice = self.first_choice + b.index
        if shown or last and b.streamed < len(b.tokens):
            ids, lps = tuple(b.tokens[b.streamed :]), tuple(b.logprobs[b.streamed :])
            b.streamed = len(b.tokens)
            self._out.append(Delta(choice, shown, ids, lps))
        if last:
            r, first = self.result, b.index == 0  # the prompt's figures come with the first choice
            used = Usage(r.prompt_tokens, r.cached_tokens, len(b.tokens)) if first else Usage(0, 0, len(b.tokens))
            self._out.append(Finished(choice, b.finish_reason, b.stop_detail, used, r.ttft_s if first else 0.0))

    def _after_advance(self):
        """Free the sequences of finished branches at once (their blocks go to other requests);
        when every branch is done, record, flush and finish."""
        eng, r = self.engine, self.result
        held = [self.root] if self.root is not None else [b.seq for b in r.branches if b.seq is not None]
        r.peak_blocks = max(r.peak_blocks, eng.kv.blocks_held(held))
        for b in r.branches:
            if b.finish_reason and b.seq is not None:
                self._persist(b.seq)
                b.stored = b.seq.num_stored
                self._free(b.seq)
                b.seq = None
        if self.done or any(not b.finish_reason for b in r.branches) or self.root is not None and not r.branches:
            return
        if self.root is not None:
            self._free(self.root)
            self.root = None
        r.eval_s = time.perf_counter() - (self._t_prefilled or time.perf_counter())
        bs = eng.block_size
        r.unshared_blocks = sum(-(-b.stored // bs) for b in r.branches)
        for b in r.branches:
            self._emit(b, b.streamer.flush(), last=True)
        self.done = True

    def _free(self, seq: Sequence):
        """Free one of this request's sequences, its copies-on-write counted as the request's."""
        self.result.cow_copies += seq.cow_copies
        self.engine.free(seq)

    def _persist(self, seq: Sequence):
        """Write the prompt's full blocks to the disk cache, once, before the first branch
        holding them is freed (not earlier: the write would delay the first token)."""
        if not self._persisted:
            self._persisted = True
            self.engine.persist_prompt(seq, self.result.prompt_tokens, self.result.cached_tokens)


def _compile(constraint, tokenizer):
    from localkv.grammar import Grammar  # llguidance loads only for a constrained reply

    return Grammar.compile(constraint, tokenizer)
