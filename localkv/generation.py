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

A thinking model's reply (`reasoning`, a reasoning.Plan) splits into its thinking and its
answer as it streams: stop strings, the grammar and tool calls' triggers see the answer only,
and the thinking's budget forces its closing tag (each branch's reasoning.Gate, its matcher).

Speculation (EngineConfig.spec): the scheduler asks a decoding branch for a draft (draft()),
which goes after its pending token in its sequence; the step computes them all and hands back
a logits row per token, and advance() verifies them in order, as if they were decoded one by
one: each position's token is sampled (every transform, the grammar matcher, the penalties'
history of the tokens accepted so far) with the drafted one as the candidate, up to the first
token that is not the draft's or that ends the branch; the engine then rolls the rest back
(Engine.settle). The matcher, the n-gram index and the text only ever see accepted tokens.
"""

import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.events import Delta, Finished, Usage
from localkv.progress import PrefillProgress
from localkv.reasoning import Plan as Thinking
from localkv.result import Branch, Result
from localkv.sampling import Sampler, SamplingParams, TokenLogprob
from localkv.scheduler import Scheduler
from localkv.sequence import Sequence
from localkv.spec import control as speculation
from localkv.stops import StopScanner

__all__ = ["Branch", "Generation", "Result"]  # Branch and Result live in result.py; callers import them here too


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
        reasoning: Thinking | None = None,
    ):
        """on_progress: called with the prefill's progress after each step that computed part of
        the prompt, and once when it is done (when this Generation drives its own scheduler).
        first_choice: the choice number of branch 0 in its events (a server request with several
        prompts numbers its choices across them). reasoning: a thinking model's chat reply
        (reasoning.plan), split into thinking and answer."""
        self._t0 = time.perf_counter()  # TTFT counts the wait, the prefix lookup and the prefill
        self.params = (params or SamplingParams()).validate()
        if n < 1:
            raise LocalkvError(f"invalid branch count {n}: must be >= 1")
        engine.check_fits(len(prompt_ids), self.params.max_tokens, n, queued)  # queued: for a shared scheduler
        c = self.params.constraint  # a bad grammar fails here, before any work
        self.grammar = _compile(c, engine.tokenizer) if c is not None else None
        self.breakers = engine.tokenizer.breaker_mask(self.params.dry_sequence_breakers) if self.params.dry else None
        self.on_progress = on_progress
        self.first_choice = first_choice
        self.reasoning = reasoning
        self.engine, self.n, self.prompt = engine, n, list(prompt_ids)
        self.result = Result([], len(prompt_ids), load_s=engine.loaded.load_s)
        cfg = engine.config
        if cfg.spec != "off":
            self.result.spec, self.result.spec_note = cfg.spec, speculation.unavailable(engine)
            if self.result.spec_note:
                self.result.spec = "off"
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
        return (e for e in self.events() if isinstance(e, Delta) and (e.text or e.reasoning))

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

    def draft(self, seq: Sequence, limit: int, decoding: int = 1) -> int:
        """Replace the draft after seq's pending token with a new one of at most `limit` tokens
        (0: none), bounded so that verifying it never passes max_tokens or the context, for a
        pass of `decoding` decoding sequences; returns its length. Only the tokens of a draft
        are pending past the one the branch sampled."""
        b = next((b for b in self.result.branches if b.seq is seq), None)
        if b is None or b.spec is None:
            return 0
        if b.drafted:
            del seq.tokens[-b.drafted :]
            b.drafted = 0
        room = min(limit, self.params.max_tokens - len(b.tokens) - 1, self.engine.ctx - len(seq.tokens) - 1)
        if room <= 0 or b.finish_reason:
            return 0
        siblings = tuple(o.spec for o in self.result.branches if o is not b and o.spec is not None)
        proposal = b.spec.propose(seq.tokens, room, siblings, decoding)
        m = b.sampler.matcher
        if m is not None and b.spec.model is None:  # a grammar's forced tokens, or a draft it takes
            proposal = m.guide(proposal, room)
        seq.tokens.extend(proposal)
        b.drafted = len(proposal)
        return b.drafted

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
            if b.spec is not None:
                b.spec.close()
            b.drafted = 0  # the draft went with the sequence; the branch's tokens are all verified

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
            gate = self.reasoning.gate(eng.tokenizer, matcher) if self.reasoning is not None else None
            sampler = Sampler(self.params.for_branch(i), gate or matcher, 0, self.breakers)
            b = Branch(i, seq, sampler, eng.tokenizer.streamer(), gate=gate)
            b.split = self.reasoning.splitter() if self.reasoning is not None else None
            b.spec = speculation.for_branch(self.result.spec, eng, b.sampler, self.stop_ids, len(self.prompt))
            b.stops = StopScanner(self.params.stop)
            b.peak_active_tokens = eng.policy.active_tokens(seq)
            r.branches.append(b)
        self.advance(list(r.branches), [logits] * self.n)
        self._after_advance()

    def advance(self, live: list[Branch], rows) -> None:
        """Sample each live branch's next tokens from its logits rows (one row, or 1 + its draft's
        length: one per verified position), append them, stream their text, and finish the
        branch on a stop token, a stop string, max_tokens or the context's end."""
        for b, row in zip(live, rows):
            b.passes += 1
            picks = self._verify(b, row if b.drafted else row[None])
            base = len(b.seq.tokens) - b.drafted
            if b.drafted:  # the draft's tokens up to the first one not picked stay, the rest go
                n = min(b.drafted, len(picks))
                accepted = next((i for i in range(n) if picks[i][0] != b.seq.tokens[base + i]), n)
                self.engine.settle(b.seq, b.drafted, accepted)
                b.spec.record(b.drafted, accepted)
                b.drafted = 0
            for i, (tok, lp) in enumerate(picks):
                if not self._take(b, tok, lp, base + i):
                    break

    def _verify(self, b: Branch, rows: np.ndarray) -> list[tuple[int, TokenLogprob | None]]:
        """The tokens a one-by-one decode would sample at the branch's verified positions, and
        their log-probabilities: position i samples from rows[i] with the draft's token i as
        the candidate, on the history of the tokens picked before it, until a pick is not the
        draft's token (the draft's continuation is void past it), ends the branch, or the rows
        end (the last one is the bonus: the token after a draft accepted whole)."""
        seq, d, p = b.seq, b.drafted, self.params
        base, picks = len(seq.tokens) - d, []
        for i in range(d + 1):
            draft = seq.tokens[base + i] if i < d else None
            tok = b.sampler(rows[i], _history(seq.tokens, base + i, p), draft, b.spec.law(i) if i < d else None)
            picks.append((tok, b.sampler.last))
            if not self.result.ttft_s:
                self.result.ttft_s = time.perf_counter() - self._t0
            ends = tok in self.stop_ids or len(b.tokens) + len(picks) >= p.max_tokens
            if tok != draft or ends or self._ends_context(base + i + 1):
                break
        return picks

    def _take(self, b: Branch, tok: int, lp: TokenLogprob | None, at: int) -> bool:
        """Append the branch's token at position `at` (it may be there already: an accepted
        draft's), stream it, finish the branch if it ends it; returns whether it goes on."""
        eng = self.engine
        b.peak_active_tokens = max(b.peak_active_tokens, eng.policy.active_tokens(b.seq))
        if tok in self.stop_ids:
            b.finish_reason = "stop"
            return False
        b.tokens.append(tok)
        if len(b.seq.tokens) == at:
            b.seq.tokens.append(tok)
        if lp is not None:
            b.logprobs.append(lp)
        self._emit(b, b.streamer.push(tok))
        if b.finish_reason:  # a stop string
            return False
        if len(b.tokens) >= self.params.max_tokens:
            b.finish_reason = "length"
        elif self._ends_context(at + 1):
            b.finish_reason = "context"
        return not b.finish_reason

    def _ends_context(self, length: int) -> bool:
        return length >= self.engine.ctx and self.engine.policy.bounded_context

    def _emit(self, b: Branch, text: str, last: bool = False):
        """Stream a branch's text, its thinking apart, its answer past its stop strings, with the
        tokens sampled since its last Delta (last: the branch ended, release what was held back
        and say why it ended)."""
        thought, text = b.split.push(text) if b.split is not None else ("", text)
        if last and b.split is not None:
            more, rest = b.split.flush()
            thought, text = thought + more, text + rest
        shown = b.stops.push(text)
        if b.stops.hit and not b.finish_reason:
            b.finish_reason, b.stop_detail = "stop", f"stop string {b.stops.hit!r}"
        elif last:
            shown += b.stops.flush()
        b.text += shown
        b.reasoning += thought
        choice = self.first_choice + b.index
        if shown or thought or last and b.streamed < len(b.tokens):
            ids, lps = tuple(b.tokens[b.streamed :]), tuple(b.logprobs[b.streamed :])
            b.streamed = len(b.tokens)
            self._out.append(Delta(choice, shown, ids, lps, thought))
        if last:
            r, first = self.result, b.index == 0  # the prompt's figures come with the first choice
            drafted, accepted = (b.spec.drafted, b.spec.accepted) if b.spec is not None else (0, 0)
            prompt = (r.prompt_tokens, r.cached_tokens) if first else (0, 0)
            used = Usage(*prompt, len(b.tokens), drafted, accepted, b.reasoning_tokens)
            self._out.append(Finished(choice, b.finish_reason, b.stop_detail, used, r.ttft_s if first else 0.0))

    def _after_advance(self):
        """Free the sequences of finished branches at once (their blocks go to other requests);
        when every branch is done, record, flush and finish."""
        eng, r = self.engine, self.result
        held = [self.root] if self.root is not None else [b.seq for b in r.branches if b.seq is not None]
        r.peak_blocks = max(r.peak_blocks, eng.kv.blocks_held(held))
        for b in r.branches:
            if b.finish_reason and b.seq is not None:
                if b.spec is not None:  # its last verified tokens, for the requests after it
                    b.spec.learn(b.seq.tokens)
                self._persist(b.seq)
                b.stored = b.seq.num_stored
                self._free(b.seq)
                b.seq = None
                if b.spec is not None:
                    b.spec.close()
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


def _history(tokens: list[int], end: int, p: SamplingParams):
    """The penalties' history for the token at position `end`: tokens[:end], copied only as far
    as the penalties look (the list itself when end is its length)."""
    if end == len(tokens):
        return tokens
    n = p.lookback
    return tokens[0 if n < 0 else max(0, end - n) : end] if n else ()


def _compile(constraint, tokenizer):
    from localkv.grammar import Grammar  # llguidance loads only for a constrained reply

    return Grammar.compile(constraint, tokenizer)
