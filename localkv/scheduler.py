"""Continuous batching: many requests through one engine and one block pool.

Every step takes the running sequences' next tokens (decodes first) plus chunks of waiting
prompts, up to a token budget, and runs them as one forward pass. The engine plans that batch
once (Engine.plan) and commits exactly that plan (Engine.step); the scheduler asks the engine,
never the KV policy or the pool. Requests join and leave between steps. A request is admitted
when seats (sequences) and free blocks allow (Engine.admits); one whose prompt starts with the
full blocks another request is still prefilling waits until they are computed, so a shared
system prompt is computed once and hit by the rest. When the plan finds the pool short, the
newest request is preempted: its blocks are freed, and it is recomputed later from its prompt
and what it generated so far (freed blocks keep their hashes, so most come back from the
prefix cache); it is never dropped.

Speculation (EngineConfig.spec): each decoding sequence may carry a draft after its pending
token (Request.draft), verified in the same pass. Drafted tokens count against the step's token
budget, and the more sequences decode, the less each drafts (spec.control.share); a draft is
dropped before a sequence is ended for its KV budget or a request is preempted for it.

The scheduler knows requests only through the small protocol below (Generation implements it).
add() and cancel() may be called from other threads; step() runs on the engine's one thread.
"""

import threading
import time
from collections import deque
from typing import Protocol

import numpy as np

from localkv.engine import Engine
from localkv.kv.step_plan import StepPlan
from localkv.sequence import Sequence
from localkv.spec.control import cost_of, k_max, share


class Request(Protocol):
    n: int  # sequences it decodes (branches)
    prompt: list[int]
    done: bool

    def admit(self) -> None: ...  # open the prompt's sequence (prefix cache lookup)

    def schedulable(self) -> list[Sequence]: ...  # its sequences with pending tokens

    def prefilling(self) -> bool: ...  # still computing its prompt

    def prompt_computed(self) -> int: ...  # prompt tokens whose K/V are computed (0 before admit)

    def draft(self, seq: Sequence, limit: int, decoding: int = 1) -> int: ...  # a new draft of <= limit tokens

    def on_logits(self, rows: dict[int, np.ndarray]) -> None: ...  # seq id -> logits (a drafted seq: one per token)

    def out_of_budget(self, seq: Sequence, reason: str) -> None: ...  # the KV policy cannot make room: end seq

    def preempt(self) -> None: ...  # free every block; resume later from scratch

    def cancel(self, reason: str) -> None: ...  # finish now and free every block


class Scheduler:
    def __init__(self, engine: Engine, max_seqs: int = 64, token_budget: int | None = None):
        """token_budget: most tokens a step runs over all requests (default the engine's
        prefill_chunk); one prompt advances at most prefill_chunk tokens a step, so a budget
        above it lets several prompts share a step (vLLM's long-prefill threshold)."""
        if max_seqs < 1:
            raise RuntimeError(f"max_seqs {max_seqs} < 1: a bug in the caller's logic")
        self.engine, self.max_seqs = engine, max_seqs
        self.chunk = engine.config.prefill_chunk
        self.spec_max = k_max(engine.config.spec_max, engine.config.spec) if engine.config.spec != "off" else 0
        self.cost = cost_of(engine) if self.spec_max else None  # fed with the decode passes' times
        self.token_budget = max(token_budget or self.chunk, 1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.preemptions = 0
        self._inbox: deque[tuple[str, Request, str]] = deque()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ other threads

    def add(self, req: Request) -> None:
        with self._lock:
            self._inbox.append(("add", req, ""))

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Finish req at the next step and free its blocks (a client that went away)."""
        with self._lock:
            self._inbox.append(("cancel", req, reason))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._inbox)

    # ------------------------------------------------------------ the engine's thread

    def step(self) -> bool:
        """Admit, batch, plan, run one forward pass, hand out the logits. Returns whether a
        forward pass ran."""
        self._take_inbox()
        self._admit()
        plan, owners, drafts = self._plan()
        if not plan.seqs:
            self._reap()
            return False
        timed = self.cost is not None and all(n == 1 + d for n, d in zip(plan.counts, drafts))
        timed = timed and not any(r.prefilling() for r in owners)  # a pass whose sequences all decode
        t0 = time.perf_counter()
        logits = self.engine.step(plan, drafts=drafts) if any(drafts) else self.engine.step(plan)
        if timed:  # what a pass of so many rows costs, measured for the drafts
            self.cost.observe(sum(plan.counts), time.perf_counter() - t0)
        rows: dict[int, dict[int, np.ndarray]] = {}
        at = 0
        for seq, d, req in zip(plan.seqs, drafts, owners):
            if not seq.pending:  # its whole chunk is computed: the row is its next token's (a draft's: 1 + d)
                rows.setdefault(id(req), {})[seq.id] = logits[at : at + 1 + d] if d else logits[at]
            at += 1 + d
        for req in dict.fromkeys(owners):
            if id(req) in rows:
                req.on_logits(rows[id(req)])
        self._reap()
        return True

    def _plan(self) -> tuple[StepPlan, list[Request], list[int]]:
        """The batch and the engine's plan for it, made once. A sequence the KV policy cannot
        make room for is handed back to its request (which ends it) and the batch planned again
        without it; while the pool is short, the newest request is preempted and the smaller
        batch planned. Drafts go first: a sequence out of budget with a draft, or a pool short
        for a batch with drafts, is planned again without them. Returns the plan, the request of
        each of its sequences and the length of each one's draft."""
        told: set[int] = set()
        undrafted: set[int] = set()  # sequences that do not draft this step; -1: none do
        while True:
            seqs, counts, owners, drafts = self._batch(undrafted)
            plan = self.engine.plan(seqs, counts)
            if plan.out_of_budget:  # one at a time: ending it may unshare blocks another can then evict
                seq, why = plan.out_of_budget[0]
                i = next(i for i, s in enumerate(seqs) if s is seq)
                if drafts[i]:
                    undrafted.add(seq.id)
                    continue
                if seq.id in told:
                    raise RuntimeError(f"sequence {seq.id} ran on after out_of_budget: a bug in the request's logic")
                told.add(seq.id)
                owners[i].out_of_budget(seq, why)
            elif plan.fits:
                return plan, owners, drafts
            elif any(drafts):
                undrafted.add(-1)
            elif not self._preempt_newest(keep=self.running[0]):
                raise RuntimeError("a lone request outgrew the KV pool (check_fits should have refused it)")

    def abort_all(self, reason: str) -> list[Request]:
        """Finish every request, queued or running, and free its blocks: what a server does when
        a step failed (a bug), so that one bad step neither leaks blocks nor stops the others
        from being answered. Returns the requests it finished."""
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        reqs = list(dict.fromkeys([*self.running, *self.waiting, *(r for op, r, _ in items if op == "add")]))
        for req in reqs:
            if not req.done:
                req.cancel(reason)
        self.running, self.waiting = [], deque()
        return reqs

    def _take_inbox(self):
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        for op, req, reason in items:
            if op == "add":
                self.waiting.append(req)
            elif req in self.running or req in self.waiting:
                req.cancel(reason)
                self._reap()

    def _seats(self) -> int:
        return sum(r.n for r in self.running)

    def _admit(self):
        held = []
        while self.waiting:
            req = self.waiting[0]
            if self._seats() + req.n > self.max_seqs and self.running:
                break
            if not self.engine.admits(len(req.prompt), req.n) and self.running:
                break
            self.waiting.popleft()
            if self._shares_a_prefilling_prefix(req):
                held.append(req)  # admitted once those blocks are computed
                continue
            req.admit()
            self.running.append(req)
        self.waiting.extendleft(reversed(held))

    def _shares_a_prefilling_prefix(self, req: Request) -> bool:
        """Whether a running request is still computing full blocks that req's prompt begins
        with: req waits for them rather than computing them twice. Only those blocks: the
        other's own tail (a distinct question after the shared system prompt) is not waited for."""
        if not self.engine.prefix_caching:
            return False
        bs = self.engine.block_size
        return any(
            r.prefilling() and r.prompt_computed() < _common_blocks(req.prompt, r.prompt, bs) * bs for r in self.running
        )

    def _batch(self, undrafted: set[int]) -> tuple[list[Sequence], list[int], list[Request], list[int]]:
        """Decodes first, each with its draft (none for the sequences in undrafted, or for any if
        it holds -1), then prompt chunks, within the token budget and the KV policy's chunk
        limit. Returns the sequences, their token counts, requests and drafts' lengths."""
        decode, prefill = [], []
        for req in self.running:
            for seq in req.schedulable():
                if self.spec_max and not req.prefilling():
                    req.draft(seq, 0)  # a draft made for an earlier plan of this step goes first
                (decode if len(seq.pending) == 1 and not req.prefilling() else prefill).append((seq, req))
        left = max(self.token_budget, len(decode))
        limit = share(len(decode), left - len(decode), self.spec_max) if -1 not in undrafted else 0
        seqs, counts, owners, drafts = [], [], [], []
        for i, (seq, req) in enumerate(decode + prefill):
            if left <= 0:
                break
            drafting = limit and i < len(decode) and seq.id not in undrafted
            d = req.draft(seq, min(limit, left - 1), len(decode)) if drafting else 0
            n = self.engine.chunk_counts([seq], min(left, self.chunk if not d else 1 + d))[0]
            if d and n < 1 + d:  # the KV policy's chunk limit cut the draft
                d = req.draft(seq, n - 1, len(decode))
            if req.prefilling():
                n = min(n, self._until_waited_blocks(req) or n)
            seqs.append(seq)
            counts.append(n)
            owners.append(req)
            drafts.append(d)
            left -= n
        return seqs, counts, owners, drafts

    def _until_waited_blocks(self, req: Request) -> int:
        """Tokens req has left to compute of the leading blocks that waiting requests share with
        its prompt (0: none). Its chunk stops there, so the next step runs their own tails along
        with req's: they all start decoding in one step, not one request at a time."""
        if not self.engine.prefix_caching or not self.waiting:
            return 0
        bs = self.engine.block_size
        shared = max(_common_blocks(w.prompt, req.prompt, bs) for w in self.waiting) * bs
        return max(0, shared - req.prompt_computed())

    def _preempt_newest(self, keep: Request) -> bool:
        for req in reversed(self.running):
            if req is not keep:
                req.preempt()
                self.running.remove(req)
                self.waiting.appendleft(req)
                self.preemptions += 1
                return True
        return False

    def _reap(self):
        self.running = [r for r in self.running if not r.done]
        self.waiting = deque(r for r in self.waiting if not r.done)


def _common_blocks(a: list[int], b: list[int], bs: int) -> int:
    """Leading full blocks of bs tokens that a and b have in common."""
    n = min(len(a), len(b)) // bs * bs
    if n == 0 or a[:bs] != b[:bs]:  # most prompts differ in their first block: no array made
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return (int(diff[0]) if len(diff) else n) // bs
