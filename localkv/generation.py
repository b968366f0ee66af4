"""One reply's life, for one prompt and n branches: prefill once, fork, decode the live branches
as one batch, sample, stop, stream, write the prompt to the disk cache, free.

With n > 1 every branch is a fork of the prompt's sequence (same block table, ref_count + 1 per
block): full prompt blocks stay shared to the end, and a branch's first write into the shared,
partly filled last block copies it (copy-on-write). `advance` is the one place where a sampled
token is appended to a branch and a branch is declared finished.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from localkv.engine import Engine
from localkv.errors import BudgetReached, LocalkvError
from localkv.model.tokenizer import TokenStreamer
from localkv.sampling import Sampler, SamplingParams
from localkv.sequence import Sequence


@dataclass(slots=True)
class Branch:
    """One reply: its sequence, sampler, streamed text and why it ended."""

    index: int
    seq: Sequence
    sampler: Sampler
    streamer: TokenStreamer
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop | length | context | kv_budget | interrupted
    stop_detail: str = ""
    peak_active_tokens: int = 0  # most tokens of K/V the branch attended to in one layer


@dataclass(slots=True)
class Piece:
    """Text streamed by branch `branch`."""

    branch: int
    text: str


@dataclass(slots=True)
class Result:
    branches: list[Branch]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    load_s: float = 0.0
    ttft_s: float = 0.0  # from the request (its prefix lookup included) to the first sampled token
    prompt_s: float = 0.0  # from the request to the prompt's logits: prefix lookup and prefill
    eval_s: float = 0.0
    peak_blocks: int = 0
    unshared_blocks: int = 0  # what the branches would hold without sharing
    cow_copies: int = 0

    @property
    def text(self) -> str:
        return self.branches[0].text

    @property
    def tokens(self) -> list[int]:
        return self.branches[0].tokens

    @property
    def finish_reason(self) -> str:
        return self.branches[0].finish_reason

    @property
    def stop_detail(self) -> str:
        return self.branches[0].stop_detail

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
    """Iterate for Pieces as tokens are sampled; .result holds the record. Requests that cannot
    fit are refused when the Generation is made, before any work. Ctrl-C during iteration ends
    it cleanly (live branches finish 'interrupted') and is re-raised."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams | None = None, n: int = 1):
        self._t0 = time.perf_counter()  # TTFT counts the prefix lookup (memory and disk) too
        self.params = (params or SamplingParams()).validate()
        if n < 1:
            raise LocalkvError(f"invalid branch count {n}: must be >= 1")
        engine.check_fits(len(prompt_ids), self.params.max_tokens, n)
        self.engine, self.n = engine, n
        self.root, cached = engine.open_sequence(prompt_ids)
        self.result = Result([], len(prompt_ids), cached, load_s=engine.loaded.load_s)
        self.stop_ids = frozenset() if self.params.ignore_eos else frozenset(engine.tokenizer.stop_ids)

    def __iter__(self) -> Iterator[Piece]:
        eng, r = self.engine, self.result
        cow0 = eng.stats.cow_copies
        try:
            logits = eng.prefill(self.root)
            r.prompt_s = time.perf_counter() - self._t0
            self._fork()
            live, rows = list(r.branches), [logits] * self.n
            t1 = time.perf_counter()
            while live:
                yield from self.advance(live, rows)
                r.peak_blocks = max(r.peak_blocks, eng.blocks_used)
                live = [b for b in live if not b.finish_reason]
                if live:
                    rows = self._decode(live)
            r.eval_s = time.perf_counter() - t1
            yield from self._flush()
        except KeyboardInterrupt:
            for b in r.branches:
                b.finish_reason = b.finish_reason or "interrupted"
            list(self._flush())
            raise
        finally:
            self._finish(cow0)

    def _fork(self):
        eng, params = self.engine, self.params
        seqs = [self.root] + [eng.fork(self.root) for _ in range(self.n - 1)]
        for i, seq in enumerate(seqs):
            b = Branch(i, seq, Sampler(params.for_branch(i)), eng.tokenizer.streamer())
            b.peak_active_tokens = eng.policy.active_tokens(seq)
            self.result.branches.append(b)

    def advance(self, live: list[Branch], rows) -> Iterator[Piece]:
        """Sample each live branch's next token from its logits row, append it, stream its text,
        and finish the branch on a stop token, max_tokens or the context's end."""
        eng, p, r = self.engine, self.params, self.result
        for b, row in zip(live, rows):
            tok = b.sampler(row)
            if not r.ttft_s:
                r.ttft_s = time.perf_counter() - self._t0
            if tok in self.stop_ids:
                b.finish_reason = "stop"
                continue
            b.tokens.append(tok)
            b.seq.tokens.append(tok)
            piece = b.streamer.push(tok)
            b.text += piece
            if piece:
                yield Piece(b.index, piece)
            if len(b.tokens) >= p.max_tokens:
                b.finish_reason = "length"
            elif len(b.seq.tokens) >= eng.cfg.ctx_len and eng.policy.config.policy == "none":
                b.finish_reason = "context"

    def _decode(self, live: list[Branch]) -> list[np.ndarray]:
        eng = self.engine
        try:
            out = eng.decode([b.seq for b in live])
        except BudgetReached as e:
            for b in live:
                b.finish_reason, b.stop_detail = "kv_budget", str(e)
            return []
        for b in live:
            b.peak_active_tokens = max(b.peak_active_tokens, eng.policy.active_tokens(b.seq))
        return list(out)

    def _flush(self) -> Iterator[Piece]:
        for i, b in enumerate(self.result.branches):
            tail = b.streamer.flush()
            b.text += tail
            if tail:
                yield Piece(i, tail)

    def _finish(self, cow0: int):
        """Record what the branches held, write the prompt's blocks to the disk cache, free."""
        eng, r = self.engine, self.result
        r.peak_blocks = max(r.peak_blocks, eng.blocks_used)
        bs = eng.block_size
        r.unshared_blocks = sum(-(-b.seq.num_stored // bs) for b in r.branches)
        r.cow_copies = eng.stats.cow_copies - cow0
        eng.persist_prompt(self.root, r.prompt_tokens, r.cached_tokens)
        for b in r.branches:
            eng.free(b.seq)
        if not r.branches:
            eng.free(self.root)

    def run(self) -> Result:
        for _ in self:
            pass
        return self.result
