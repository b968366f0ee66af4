"""Best-of-N: N branches of one prompt that share the prompt's KV blocks and decode together.

The prompt is prefilled once; every branch is a fork of that sequence (same block table,
ref_count + 1 per block). A branch's first write into the shared, partly filled last
block copies it (copy-on-write); full prompt blocks stay shared until the end. Each decode
step runs all live branches as one batch: one matmul per weight for all of them.
"""

import time
from dataclasses import dataclass, field

from localkv.errors import LocalkvError, PoolExhausted
from localkv.sampling import Sampler, SamplingParams
from localkv.sequence import Sequence


@dataclass(slots=True)
class Branch:
    seq: Sequence
    sampler: Sampler
    streamer: object
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


@dataclass(slots=True)
class BranchesResult:
    branches: list[Branch]
    prompt_tokens: int
    cached_tokens: int
    peak_blocks: int = 0
    unshared_blocks: int = 0  # what the same sequences would hold without sharing
    cow_copies: int = 0
    prompt_s: float = 0.0
    eval_s: float = 0.0

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def generate_branches(
    engine,
    prompt_ids: list[int],
    n: int,
    params: SamplingParams,
    max_tokens: int,
    ignore_eos: bool = False,
    on_token=None,
) -> BranchesResult:
    """Sample n replies to one prompt. on_token(branch_index, text_piece) streams pieces."""
    if n < 1:
        raise LocalkvError(f"invalid branch count {n}: must be >= 1")
    bs = engine.block_size
    engine.check_fits(len(prompt_ids), max_tokens)
    total = min(len(prompt_ids) + max_tokens, engine.cfg.ctx_len)
    need = blocks_for(len(prompt_ids), bs) + n * (blocks_for(total, bs) - len(prompt_ids) // bs)
    if need > engine.pool.num_free:
        raise PoolExhausted(
            f"{n} branches of up to {max_tokens} tokens need {need} KV blocks with sharing; the pool "
            f"has {engine.pool.num_free} free (raise --kv-mem, or lower --branches or --max-tokens)"
        )
    root, cached = engine.open_sequence(prompt_ids)
    cow0 = engine.stats.cow_copies
    result = BranchesResult([], len(prompt_ids), cached)
    stop = set() if ignore_eos else engine.tokenizer.stop_ids
    t0 = time.perf_counter()
    try:
        logits = engine.prefill(root)
        result.prompt_s = time.perf_counter() - t0
        engine.persist_prompt(root, len(prompt_ids), cached)
        seqs = [root] + [engine.fork(root) for _ in range(n - 1)]
        for i, seq in enumerate(seqs):
            seed = None if params.seed is None else params.seed + i
            p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
            result.branches.append(Branch(seq, Sampler(p), engine.tokenizer.streamer()))
        rows = [logits] * n  # one logits row per live branch, in order
        t1 = time.perf_counter()
        live = list(result.branches)
        while live:
            for b, row in zip(live, rows):
                tok = b.sampler(row)
                if tok in stop:
                    b.finish_reason = "stop"
                    continue
                b.tokens.append(tok)
                b.seq.tokens.append(tok)
                piece = b.streamer.push(tok)
                b.text += piece
                if piece and on_token:
                    on_token(result.branches.index(b), piece)
                if len(b.tokens) >= max_tokens:
                    b.finish_reason = "length"
                elif len(b.seq.tokens) >= engine.cfg.ctx_len:
                    b.finish_reason = "context"
            live = [b for b in live if not b.finish_reason]
            if live:
                out = engine.decode([b.seq for b in live])
                rows = list(out)
            result.peak_blocks = max(result.peak_blocks, engine.blocks_used)
        result.eval_s = time.perf_counter() - t1
        for b in result.branches:
            tail = b.streamer.flush()
            b.text += tail
        result.peak_blocks = max(result.peak_blocks, engine.blocks_used)
        result.unshared_blocks = sum(blocks_for(b.seq.num_stored, bs) for b in result.branches)
        result.cow_copies = engine.stats.cow_copies - cow0
        return result
    finally:
        for b in result.branches:
            engine.free(b.seq)
        if not result.branches:
            engine.free(root)
