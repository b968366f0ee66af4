"""The engine: a model, a block pool, and the steps that run sequences through them."""

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv import backends as backend
from localkv.backends import cpu as ops_numpy
from localkv.errors import BudgetReached, ContextOverflow, LocalkvError, PoolExhausted
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.kv.evict import EvictConfig, Evictor
from localkv.model.llama import Llama, Span
from localkv.model.loader import load_model
from localkv.sampling import Sampler, SamplingParams
from localkv.sequence import Sequence
from localkv.stats import Stats

DEFAULT_KV_MEM = "1GiB"
DEFAULT_PREFILL_CHUNK = 512
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """'512MiB', '1G', '2GB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise LocalkvError(f"invalid size {text!r}: use e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(slots=True)
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    load_s: float = 0.0
    ttft_s: float = 0.0
    prompt_s: float = 0.0
    eval_s: float = 0.0
    peak_blocks: int = 0
    peak_active_tokens: int = 0  # most tokens of K/V the sequence held at once
    stop_detail: str = ""

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    def timings(self) -> dict:
        computed = self.prompt_tokens - self.cached_tokens
        return {
            "load_s": round(self.load_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prompt_s": round(self.prompt_s, 4),
            "prompt_tps": round(computed / self.prompt_s, 2) if self.prompt_s else 0.0,
            "eval_s": round(self.eval_s, 4),
            "eval_tps": round((self.completion_tokens - 1) / self.eval_s, 2) if self.eval_s else 0.0,
        }


class Engine:
    def __init__(
        self,
        model: str | Path | None = None,
        block_size: int = 16,
        kv_mem: str | int = DEFAULT_KV_MEM,
        threads: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        progress: bool = True,
        prefix_caching: bool = True,
        disk_cache: bool = True,
        disk_cache_size: str | int = "2GiB",
        evict: EvictConfig | None = None,
        offload_dir: str | Path | None = None,
        device: str = "auto",
    ):
        from localkv.hub.catalog import resolve_model

        if block_size < 1 or block_size & (block_size - 1):
            raise LocalkvError(f"invalid block size {block_size}: use a power of two (16 is the default)")
        if prefill_chunk < 1:
            raise LocalkvError(f"invalid prefill chunk {prefill_chunk}: must be >= 1")
        if threads is not None:
            if threads < 1:
                raise LocalkvError(f"invalid thread count {threads}: must be >= 1")
            from threadpoolctl import threadpool_limits

            self._threads_limit = threadpool_limits(limits=threads)  # held for the engine's life
        self.threads = threads or _blas_threads()
        kv_bytes, disk_bytes = parse_size(kv_mem), parse_size(disk_cache_size)  # bad sizes fail before loading
        self.ops = backend.select(device)  # before the model loads: a missing GPU fails fast
        backend.tune_malloc()
        self.path = resolve_model(None if model is None else str(model), progress=progress)
        loaded = load_model(self.path, progress=progress)
        self.loaded = loaded
        self.cfg, self.tokenizer = loaded.config, loaded.tokenizer
        if self.ops is ops_numpy:  # the CPU kernels (numba), after the model: a bad model fails first
            ops_numpy.configure(self.threads, progress)
        weights = loaded.weights if self.ops is ops_numpy else self.ops.upload_weights(loaded.weights)
        self.model = Llama(self.cfg, weights, self.ops)
        cfg = self.cfg
        kv_item = np.dtype(self.ops.kv_dtype).itemsize
        per_block = 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * kv_item
        if kv_bytes < per_block:
            raise LocalkvError(f"--kv-mem {kv_mem} is smaller than one KV block ({per_block} bytes)")
        self.stats = Stats()
        self.pool = BlockPool(
            cfg.n_layers,
            kv_bytes // per_block,
            block_size,
            cfg.n_kv_heads,
            cfg.head_dim,
            dtype=self.ops.kv_dtype,
            xp=self.ops.xp,
            stats=self.stats,
        )
        self.evict = evict or EvictConfig()
        # validates the policy and opens the offload tier before any generation starts
        self.evictor = Evictor(self.evict, self.pool, self.stats, offload_dir)
        dtype = np.dtype(self.ops.kv_dtype).name  # fp16 GPU K/V must never be read as CPU fp32 K/V
        self.kv = KVManager(self.pool, salt=f"{cfg.fingerprint}:{block_size}:{dtype}".encode())
        self.prefill_chunk = prefill_chunk
        self.prefix_caching = prefix_caching
        self.disk = None
        if prefix_caching and disk_cache:
            from localkv.kv.disk_store import DiskStore

            # entries in the pool's own dtype: loading is a checked copy, no conversion (which
            # ran at 2.4 GB/s here and made up most of a warm start)
            self.disk = DiskStore(max_bytes=disk_bytes, dtype=dtype)

    @property
    def cpu_kernels(self) -> bool:
        """Whether decode steps run their matmuls on the compiled CPU kernels (cpu_kernels)."""
        return self.ops is ops_numpy and ops_numpy.uses_kernels(1)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def blocks_used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    # ------------------------------------------------------------ steps

    def step(self, seqs: list[Sequence], max_tokens: int | None = None, all_logits: bool = False) -> np.ndarray:
        """One forward pass over the pending tokens of seqs (at most max_tokens in all);
        returns logits [len(seqs), vocab] for each sequence's last processed token
        (with all_logits: [tokens processed, vocab], one row per token)."""
        tokens, positions, slots, spans, rows = [], [], [], [], []
        budget = max_tokens or sum(len(s.pending) for s in seqs)
        limit = self.evict.chunk_limit(self.block_size)
        counts, left = [], budget
        for seq in seqs:
            counts.append(min(len(seq.pending), left, limit or left))
            left -= counts[-1]
        self._enforce_budget(seqs, counts)
        need = sum(self.kv.need(s, n) for s, n in zip(seqs, counts) if n)
        if need > self.pool.num_free:  # before any sequence is touched: a failed step changes nothing
            raise PoolExhausted(
                f"KV pool exhausted: this step needs {need} blocks, {self.pool.num_free} are free (raise --kv-mem)"
            )
        for seq, n in zip(seqs, counts):
            if not n:
                raise LocalkvError("internal: step on a sequence with no pending tokens")
            chunk = seq.pending[:n]
            start = len(tokens)
            positions.extend(range(seq.num_computed, seq.num_computed + n))
            slots.append(self.kv.append_slots(seq, n))
            tokens.extend(chunk)
            spans.append(
                Span(
                    start,
                    n,
                    np.asarray(seq.block_table),
                    seq.num_stored,
                    self.evictor.mass_for(seq),
                    self.evictor.retriever(seq),
                )
            )
            rows.append(len(tokens) - 1)
        if all_logits:
            rows = list(range(len(tokens)))
        self.model.ensure_positions(max(positions) + 1)
        logits = self.model.forward(
            np.asarray(tokens), np.asarray(positions), np.concatenate(slots), spans, self.pool, rows
        )
        for seq, sp in zip(seqs, spans):
            self.evictor.observe(seq, sp.mass, sp.length)
            if self.evictor.tier is not None:
                self.evictor.recalled(seq, sp.retrieve)
            if self.prefix_caching:
                self.kv.register_full_blocks(seq)
        return logits

    def _enforce_budget(self, seqs: list[Sequence], counts: list[int]):
        """Make room under each sequence's KV budget before its tokens are appended."""
        ev = self.evict
        if ev.budget is None:
            return
        for seq, n in zip(seqs, counts):
            if ev.policy == "none":
                if seq.num_stored + n > ev.budget:
                    raise BudgetReached(
                        f"KV budget of {ev.budget} tokens is full (policy none; choose --evict "
                        "sliding, h2o or offload to keep going)"
                    )
            elif self.evictor.make_room(seq, n) > 0:
                raise BudgetReached(
                    f"KV budget of {ev.budget} tokens is full and the remaining blocks are shared with another sequence"
                )

    def fork(self, seq: Sequence) -> Sequence:
        child = self.kv.fork(seq)
        self.evictor.fork(seq, child)
        return child

    def free(self, seq: Sequence):
        self.evictor.free(seq)
        self.kv.free(seq)

    def prefill(self, seq: Sequence) -> np.ndarray:
        """Run all pending tokens of seq in chunks; logits of the last one."""
        while True:
            logits = self.step([seq], self.prefill_chunk)
            if not seq.pending:
                return logits[0]

    def score(self, tokens: list[int]) -> np.ndarray:
        """Logits at every position of tokens [n, vocab] (teacher forcing); frees its blocks after."""
        seq = Sequence(list(tokens))
        try:
            out = []
            while seq.pending:  # a KV budget can make steps shorter than prefill_chunk
                out.append(self.step([seq], self.prefill_chunk, all_logits=True))
            return np.concatenate(out)
        finally:
            self.free(seq)

    def decode(self, seqs: list[Sequence]) -> np.ndarray:
        """One token per sequence, all in one batched pass."""
        return self.step(seqs)

    # ------------------------------------------------------------ prefix cache

    def open_sequence(self, prompt_ids: list[int]) -> tuple[Sequence, int]:
        """A fresh sequence for a prompt, its leading blocks taken from the prefix cache
        (pool, then disk) when enabled. Returns it and the number of prompt tokens reused."""
        seq = Sequence(list(prompt_ids))
        if not self.prefix_caching:
            return seq, 0
        mem, disk = self.kv.match_prefix(
            seq, _DiskPrefix(self.disk, self.cfg.fingerprint, self.pool) if self.disk else None
        )
        if self.disk:
            self.disk.record(len(prompt_ids), mem + disk)
        return seq, mem + disk

    def persist_prompt(self, seq: Sequence, n_prompt: int, n_cached: int = 0):
        """Write the prompt's full blocks to the disk tier so a later process can skip their
        prefill. Generated tokens are not written: the next turn's prompt carries them anyway.
        Blocks past the cached prefix that the store already holds were never read back, so
        they are checked (a corrupt entry is dropped by read) before being trusted."""
        if not self.disk or not seq.hashable:
            return
        fp, name, bs = self.cfg.fingerprint, self.cfg.name, self.block_size
        for i in range(n_cached // bs, min(n_prompt // bs, len(seq.block_hashes))):
            h, toks = seq.block_hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs])
            if self.disk.contains(fp, h) and self.disk.read(fp, h, toks) is not None:
                continue
            bid = seq.block_table[i]
            if not self.disk.put(fp, name, h, toks, self.pool.k[:, bid], self.pool.v[:, bid]):
                break  # disabled (unwritable, full): the warning says why

    # ------------------------------------------------------------ requests

    def check_fits(self, n_prompt: int, max_tokens: int, n_seqs: int = 1):
        ctx, ev = self.cfg.ctx_len, self.evict
        if n_prompt == 0:
            raise LocalkvError("empty prompt: nothing to run")
        if n_prompt >= ctx:
            raise ContextOverflow(f"prompt is {n_prompt} tokens; the model's context holds {ctx} (shorten the prompt)")
        if ev.policy == "none" and ev.budget is not None and n_prompt > ev.budget:
            raise BudgetReached(
                f"prompt is {n_prompt} tokens, more than the KV budget of {ev.budget} "
                "(raise --kv-budget or choose an --evict policy)"
            )
        total = n_prompt + max_tokens if ev.policy != "none" else min(n_prompt + max_tokens, ctx)
        if ev.budget is not None:
            total = min(total, ev.budget + self.block_size)
        need = -(-total // self.block_size) * n_seqs
        if need > self.pool.num_free:
            raise PoolExhausted(
                f"request needs {need} KV blocks ({total} tokens), the pool has {self.pool.num_free} "
                f"free of {self.pool.num_blocks} (raise --kv-mem or lower --max-tokens)"
            )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        max_tokens: int = 512,
        ignore_eos: bool = False,
    ) -> "Generation":
        return Generation(self, prompt_ids, params or SamplingParams(), max_tokens, ignore_eos)


class Generation:
    """Iterate for text pieces as tokens are sampled; .result holds the record.
    Ctrl-C during iteration ends it cleanly with finish_reason 'interrupted'."""

    def __init__(
        self, engine: Engine, prompt_ids: list[int], params: SamplingParams, max_tokens: int, ignore_eos: bool
    ):
        if max_tokens < 1:
            raise LocalkvError(f"invalid max tokens {max_tokens}: must be >= 1")
        self.sampler = Sampler(params)
        engine.check_fits(len(prompt_ids), max_tokens)
        self.engine, self.max_tokens, self.ignore_eos = engine, max_tokens, ignore_eos
        self.seq, cached = engine.open_sequence(prompt_ids)
        self.result = Result(prompt_tokens=len(prompt_ids), cached_tokens=cached, load_s=engine.loaded.load_s)

    def __iter__(self):
        eng, r = self.engine, self.result
        streamer = eng.tokenizer.streamer()
        stop = set() if self.ignore_eos else eng.tokenizer.stop_ids
        t0 = time.perf_counter()
        try:
            logits = eng.prefill(self.seq)
            r.peak_active_tokens = eng.evictor.active_tokens(self.seq)
            r.prompt_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            while True:
                tok = self.sampler(logits)
                if not r.tokens:
                    r.ttft_s = time.perf_counter() - t0
                r.peak_blocks = max(r.peak_blocks, eng.blocks_used)
                if tok in stop:
                    r.finish_reason = "stop"
                    break
                r.tokens.append(tok)
                self.seq.tokens.append(tok)
                piece = streamer.push(tok)
                r.text += piece
                if piece:
                    yield piece
                if len(r.tokens) >= self.max_tokens:
                    r.finish_reason = "length"
                    break
                if len(self.seq.tokens) >= eng.cfg.ctx_len and eng.evict.policy == "none":
                    r.finish_reason = "context"
                    break
                try:
                    logits = eng.decode([self.seq])[0]
                except BudgetReached as e:
                    r.finish_reason, r.stop_detail = "kv_budget", str(e)
                    break
                r.peak_active_tokens = max(r.peak_active_tokens, eng.evictor.active_tokens(self.seq))
            r.eval_s = time.perf_counter() - t1
            tail = streamer.flush()
            r.text += tail
            if tail:
                yield tail
        except KeyboardInterrupt:
            r.finish_reason = "interrupted"
            r.text += streamer.flush()
            raise
        finally:
            r.peak_blocks = max(r.peak_blocks, eng.blocks_used)
            eng.persist_prompt(self.seq, r.prompt_tokens, r.cached_tokens)
            eng.free(self.seq)

    def run(self) -> Result:
        for _ in self:
            pass
        return self.result


class _DiskPrefix:
    """The disk tier as KVManager.match_prefix reads it: one model's entries, loaded straight
    into pool blocks (through host memory when the pool lives on a GPU)."""

    def __init__(self, disk, fingerprint: str, pool: BlockPool):
        self.disk, self.fp, self.pool = disk, fingerprint, pool

    def contains(self, h: int) -> bool:
        return self.disk.contains(self.fp, h)

    def load(self, h: int, tokens, bid: int) -> bool:
        pool = self.pool
        if pool.xp is np:
            return self.disk.load_into(self.fp, h, tokens, pool.k[:, bid], pool.v[:, bid])
        kv = self.disk.read(self.fp, h, tokens)  # stored in the pool's dtype: no conversion
        if kv is None:
            return False
        pool.k[:, bid], pool.v[:, bid] = (pool.xp.asarray(a, dtype=pool.k.dtype) for a in kv)
        return True


def _blas_threads() -> int:
    try:
        from threadpoolctl import threadpool_info

        return max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"), default=1)
    except ImportError:
        import os

        return os.cpu_count() or 1
