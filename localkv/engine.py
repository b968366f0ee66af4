"""The engine: a model, a block pool, and the steps that run sequences through them."""

from dataclasses import replace

import numpy as np

from localkv import backends, kv_format
from localkv.backends import Backend, vm
from localkv.config import EngineConfig
from localkv.disk_prefix import DiskPrefix
from localkv.errors import BudgetReached, ContextOverflow, LocalkvError, PoolExhausted
from localkv.hub.fit import check_fits
from localkv.hub.resolve import resolve_model
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.kv.disk_store import DiskStore
from localkv.kv.evict import make_policy
from localkv.kv.rotation import Rotation
from localkv.kv.step_plan import StepPlan, commit, plan_step, rollback
from localkv.model.llama import Llama, Span, check_backend
from localkv.model.loader import load_model
from localkv.model.weights import dense_weights
from localkv.sequence import Sequence
from localkv.spec.draft import check_vocabulary
from localkv.stats import Stats
from localkv.units import format_size

# 2: K rows in the model's own RoPE order (llama GGUFs: pairwise), no longer un-permuted; 3: the
# CPU's one-scale step for the 32-value block types (matmul_few.group_step): other K/V bits; 4:
# the CPU's RoPE with each float op as written (one kernel with the rotation and the K/V write)
KV_FORMAT = "kv4"


class Engine:
    """One model, one block pool and the steps that run sequences through them. Not thread-safe:
    one thread drives an engine at a time."""

    @vm.gc_paused()
    def __init__(self, config: EngineConfig | None = None, progress: bool = False, partner: int = 0):
        """partner: K/V bytes per token of an engine that shares --kv-mem with this one (a
        draft model's and its target's: each pool holds the same number of tokens)."""
        self.config = cfg = (config or EngineConfig()).validate()  # bad values fail before loading
        if cfg.threads is not None:
            from threadpoolctl import threadpool_limits

            self._threads_limit = threadpool_limits(limits=cfg.threads)  # held for the engine's life
        self.threads = cfg.threads or _blas_threads()
        self.backend = backends.select(cfg.device, self.threads)  # before the model loads: a missing GPU fails fast
        backends.tune_malloc()
        self.path = resolve_model(cfg.model, progress=progress, before_pull=self.backend.prefetch)
        check_fits(self.path, cfg.kv_mem, kv_on_host=self.backend.xp is np)  # before mapping anything
        self.loaded = loaded = load_model(self.path, progress=progress)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        check_backend(self.model_config, self.backend)  # an architecture it cannot run: one line, before the device
        _kv_formats(cfg.kv_dtype, self.backend, self.model_config.head_dim)  # one a backend cannot take: one line, now
        self.backend.start(progress)  # kernels, after the model: a bad model fails first
        weights, run_cfg = loaded.weights, self.model_config  # run_cfg: as the model computes (dense: NEOX RoPE)
        if not self.backend.caps.quant_weights:  # a backend without kernels on quantized weights
            weights, run_cfg = dense_weights(weights, self.model_config, np.dtype(self.backend.act_dtype))
        self.kv_formats = _kv_formats(cfg.kv_dtype, self.backend, self.model_config.head_dim)
        self.backend.prepare_kv(kv_format.pair_name(*self.kv_formats))  # first: its kernels compile with the weights'
        prepared = self.backend.prepare_weights(weights, self.model_config.fingerprint)
        self.model = Llama(run_cfg, prepared, self.backend, n_ctx=cfg.ctx)
        self.stats = Stats()
        self.draft = self._draft_engine(progress) if cfg.spec == "draft" else None
        self.pool = self._new_pool(self.draft.kv_bytes_per_token if self.draft is not None else partner)
        # validates the policy and opens the offload tier before any generation starts
        self.policy = make_policy(cfg.evict, self.pool, self.stats, cfg.offload_dir)
        self.ctx = self._context()  # tokens one sequence may hold: --ctx, checked against the model and the pool
        # K/V of another dtype, RoPE order or format must never be read as these: all in the key
        k_fmt, v_fmt = self.kv_formats
        dtype = kv_format.pair_stored(k_fmt, v_fmt)
        rope = f"rope-{run_cfg.rope_style}{self.model.rope_variant}"
        salt = f"{self.model_config.fingerprint}:{cfg.block_size}:{dtype}:{rope}:{KV_FORMAT}"
        if k_fmt.quantized or v_fmt.quantized:  # rows another encoder wrote are other bytes
            salt += f":{kv_format.ENCODER}"
        rot = Rotation.for_formats(k_fmt.quantized, v_fmt.quantized, run_cfg.head_dim, cfg.kv_rotate)
        self.model.rotation = rot
        if rot is not None:  # rows turned otherwise are another format
            salt += f":{rot.tag}"
        self.kv = KVManager(self.pool, salt=salt.encode())
        self.prefix_caching = cfg.prefix_cache
        # entries in the pool's own dtype: loading is a checked copy, no conversion
        self.disk = None
        if cfg.prefix_cache and cfg.disk_cache:
            self.disk = DiskStore(max_bytes=cfg.disk_cache_size, dtype=dtype)

    def _draft_engine(self, progress: bool) -> "Engine":
        """--spec draft: the draft model's engine, its pool sized beside this one's; refused in
        one line unless its vocabulary is this model's."""
        cfg = self.config
        draft_cfg = replace(cfg, model=cfg.draft_model, spec="off", draft_model=None)
        draft = Engine(draft_cfg, progress, partner=self.kv_bytes_per_token)
        check_vocabulary(self.tokenizer, draft.tokenizer, cfg.draft_model)
        return draft

    def _new_pool(self, partner: int) -> BlockPool:
        """The pool in this engine's share of --kv-mem (all of it unless a partner shares it)."""
        m, own = self.model_config, self.kv_bytes_per_token
        mem = self.config.kv_mem * own // (own + partner)
        per_block = own * self.config.block_size
        if mem < per_block:
            raise LocalkvError(f"--kv-mem {self.config.kv_mem} bytes is smaller than one KV block ({per_block} bytes)")
        pool = BlockPool(
            m.n_layers,
            mem // per_block,
            self.config.block_size,
            m.n_kv_heads,
            m.head_dim,
            dtype=self.kv_formats,
            xp=self.backend.xp,
            stats=self.stats,
        )
        if pool.xp is np:
            _small_pages(pool.k, pool.v)
        return pool

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the pool's formats."""
        m = self.model_config
        return m.n_layers * m.n_kv_heads * sum(f.row_bytes(m.head_dim) for f in self.kv_formats)

    @property
    def kv_dtype(self) -> str:
        """The pool's K/V formats as --kv-dtype says them (f16, q8_0, q8_0:q4_0...)."""
        return kv_format.pair_name(*self.kv_formats)

    @property
    def cpu_kernels(self) -> bool:
        """Whether decode steps run their matmuls on compiled few-row kernels."""
        return self.backend.uses_kernels(1)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # ------------------------------------------------------------ steps

    def plan(self, seqs: list[Sequence], counts: list[int]) -> StepPlan:
        """The KV work of a step of counts[i] pending tokens of seqs[i] (a StepPlan: the room each
        policy makes, the sequences out of budget, the blocks needed and the pool's shortfall),
        made once per step for step to commit. Changes nothing."""
        return plan_step(self.policy, self.kv, seqs, counts)

    def step(self, plan: StepPlan, all_logits: bool = False, drafts: list[int] | None = None) -> np.ndarray:
        """Commit a plan and run its one forward pass; returns logits [len(plan.seqs), vocab] for
        each sequence's last new token (with all_logits: [tokens run, vocab], one row per token;
        with drafts: rows for the last 1 + drafts[i] tokens of each seqs[i], in order, where its
        last drafts[i] tokens are a speculative draft that settle() resolves after the pass).
        A plan that cannot be committed (sequences out of budget: BudgetReached; a pool short of
        blocks: PoolExhausted; a stale plan: RuntimeError) raises before anything changes."""
        slots = commit(self.policy, self.kv, plan)
        drafts = drafts or [0] * len(plan.seqs)
        tokens, positions, spans, rows = [], [], [], []
        for seq, n, d in zip(plan.seqs, plan.counts, drafts):
            start, first = len(tokens), seq.num_computed - n  # committed: the new tokens count as computed
            positions.extend(range(first, first + n))
            tokens.extend(seq.tokens[first : first + n])
            spans.append(Span(start, n, np.asarray(seq.block_table), seq.num_stored, self.policy.extras(seq)))
            rows.extend(range(len(tokens) - 1 - d, len(tokens)))
        if all_logits:
            rows = list(range(len(tokens)))
        self.model.ensure_positions(max(positions) + 1)
        logits = self.model.forward(
            np.asarray(tokens), np.asarray(positions), np.concatenate(slots), spans, self.pool, rows
        )
        for seq, sp, d in zip(plan.seqs, spans, drafts):
            self.policy.after_forward(seq, sp.extras, sp.length)
            # a block holding an unverified draft token is never registered (nor, so, ever
            # written to the disk tier, which writes registered prompt blocks only): settle()
            # registers once the draft's rejected tail is rolled back
            if self.prefix_caching and not d:
                self.kv.register_full_blocks(seq)
        return logits

    def settle(self, seq: Sequence, drafted: int, accepted: int):
        """After a step that verified seq's last `drafted` tokens (a draft): keep the first
        `accepted`, roll back the rest, register the blocks now full of verified tokens, count."""
        if not 0 <= accepted <= drafted:
            raise RuntimeError(f"{accepted} of {drafted} drafted tokens accepted: a bug in the caller's logic")
        if accepted < drafted:
            self.rollback(seq, drafted - accepted)
        if self.prefix_caching:
            self.kv.register_full_blocks(seq)
        self.stats.count_draft(drafted, accepted)

    def forward(
        self,
        seqs: list[Sequence],
        max_tokens: int | None = None,
        counts: list[int] | None = None,
        all_logits: bool = False,
    ) -> np.ndarray:
        """Plan and commit one step at once, for a caller that owns its sequences (prefill, score,
        decode, benches): counts[i] pending tokens of seqs[i] when given, else as many as fit
        max_tokens in order. A sequence out of its KV budget raises BudgetReached."""
        if counts is None:
            counts = self.chunk_counts(seqs, max_tokens)
        return self.step(self.plan(seqs, counts), all_logits)

    def chunk_counts(self, seqs: list[Sequence], max_tokens: int | None = None) -> list[int]:
        """Pending tokens each sequence gets in one step of at most max_tokens (in order), within
        the KV policy's chunk limit."""
        left = max_tokens or sum(len(s.pending) for s in seqs)
        limit = self.policy.chunk_limit()
        counts = []
        for seq in seqs:
            counts.append(min(len(seq.pending), left, limit or left))
            left -= counts[-1]
        return counts

    def rollback(self, seq: Sequence, n: int):
        """Drop seq's last n tokens, all computed (a rejected speculative draft); StepPlan says
        what this may touch. Under a policy that cannot roll back: LocalkvError, nothing changed."""
        rollback(self.policy, self.kv, seq, n)

    def fork(self, seq: Sequence) -> Sequence:
        child = self.kv.fork(seq)
        self.policy.fork(seq, child)
        return child

    def free(self, seq: Sequence):
        self.policy.free(seq)
        self.kv.free(seq)

    def prefill(self, seq: Sequence) -> np.ndarray:
        """Run all pending tokens of seq in chunks; logits of the last one."""
        while True:
            logits = self.forward([seq], self.config.prefill_chunk)
            if not seq.pending:
                return logits[0]

    def score(self, tokens: list[int]) -> np.ndarray:
        """Logits at every position of tokens [n, vocab] (teacher forcing); frees its blocks after."""
        seq = Sequence(list(tokens))
        try:
            out = []
            while seq.pending:  # a KV budget can make steps shorter than prefill_chunk
                out.append(self.forward([seq], self.config.prefill_chunk, all_logits=True))
            return np.concatenate(out)
        finally:
            self.free(seq)

    def decode(self, seqs: list[Sequence]) -> np.ndarray:
        """One token per sequence, all in one batched pass."""
        return self.forward(seqs)

    # ------------------------------------------------------------ prefix cache

    def open_sequence(self, prompt_ids: list[int], record: bool = True) -> tuple[Sequence, int]:
        """A fresh sequence for a prompt, its leading blocks taken from the prefix cache
        (pool, then disk) when enabled. Returns it and the number of prompt tokens reused;
        `record`: count the lookup in the disk tier's hit rate (a request's, not a warm's)."""
        seq = Sequence(list(prompt_ids))
        if not self.prefix_caching:
            return seq, 0
        mem, disk = self.kv.match_prefix(
            seq, DiskPrefix(self.disk, self.model_config.fingerprint, self.pool) if self.disk else None
        )
        if self.disk and record:
            self.disk.record(len(prompt_ids), mem + disk)
        return seq, mem + disk

    def persist_prompt(self, seq: Sequence, n_prompt: int, n_cached: int = 0):
        """Write the prompt's full blocks to the disk tier so a later process can skip their
        prefill. Generated tokens are not written: the next turn's prompt carries them anyway,
        and writes them here (a reply's blocks are a memory hit then, and not on disk yet: a hit
        is written unless the store holds it). Blocks past the cached prefix that the store
        already holds were never read back, so they are checked (a corrupt entry is dropped by
        read) before being trusted."""
        if not self.disk or not seq.hashable:
            return
        fp, name, bs, disk = self.model_config.fingerprint, self.model_config.name, self.block_size, self.disk
        blocks = min(n_prompt // bs, len(seq.block_hashes))
        with disk.prefix():
            for i in range(blocks):
                h, toks = seq.block_hashes[i], tuple(seq.tokens[i * bs : (i + 1) * bs])
                if disk.contains(fp, h) and (i < n_cached // bs or disk.read(fp, h, toks) is not None):
                    disk.keep(fp, h)
                    continue
                bid = seq.block_table[i]
                parent = seq.block_hashes[i - 1] if i else None
                if not disk.put(fp, name, h, toks, self.pool.k[:, bid], self.pool.v[:, bid], parent):
                    blocks = i  # disabled (unwritable) or full: a warning says which
                    break
        if disk.full and disk.warning is None:
            disk.warning = (
                f"disk cache full ({format_size(disk.max_bytes)}): it keeps the first {blocks * bs} of this "
                f"prompt's {n_prompt} tokens (`--disk-cache-size` or `localkv cache clear` make room)"
            )

    # ------------------------------------------------------------ requests

    def _context(self) -> int:
        """--ctx (default: the model's context). One it asks for must fit the model's context and,
        for one sequence, the pool (under a KV budget, only the budget's blocks are held)."""
        ctx, model_ctx, bs = self.config.ctx, self.model_config.ctx_len, self.block_size
        if ctx is None:
            return model_ctx
        if ctx > model_ctx:
            raise ContextOverflow(f"--ctx {ctx} is more than the model's context of {model_ctx} tokens")
        ev = self.policy.config
        held = min(ctx, ev.budget + bs) if ev.budget is not None else ctx
        need = -(-held // bs)
        if need > self.pool.num_blocks:
            per = self.kv_bytes_per_token * bs
            raise PoolExhausted(
                f"--ctx {ctx} needs {need} KV blocks ({format_size(need * per)}) for one sequence; the pool holds "
                f"{self.pool.num_blocks} ({format_size(self.pool.num_blocks * per)}): raise --kv-mem or lower --ctx"
            )
        return ctx

    def check_fits(self, n_prompt: int, max_tokens: int, n_seqs: int = 1, queued: bool = False):
        """Refuse, before any work, a request of n_seqs replies (forks of one prompt) that cannot
        fit the context, the KV budget or the pool's free blocks (with queued: the whole pool,
        which a request waiting its turn in a shared scheduler may get)."""
        ctx, ev = self.ctx, self.policy.config
        if n_prompt == 0:
            raise LocalkvError("empty prompt: nothing to run")
        if n_prompt >= ctx:
            whose = "the model's context" if ctx == self.model_config.ctx_len else "the context (--ctx)"
            raise ContextOverflow(f"prompt is {n_prompt} tokens; {whose} holds {ctx} (shorten the prompt)")
        if self.policy.bounded_context and ev.budget is not None and n_prompt > ev.budget:
            raise BudgetReached(
                f"prompt is {n_prompt} tokens, more than the KV budget of {ev.budget} "
                "(raise --kv-budget or choose an --evict policy)"
            )
        need, total = self._blocks_for(n_prompt, max_tokens, n_seqs)
        free = self.pool.num_blocks if queued else self.pool.num_free
        if need > free and n_seqs > 1:
            raise PoolExhausted(
                f"{n_seqs} branches of up to {max_tokens} tokens need {need} KV blocks with sharing; the pool has "
                f"{free} free (raise --kv-mem, or lower --branches or --max-tokens)"
            )
        if need > free:
            raise PoolExhausted(
                f"request needs {need} KV blocks ({total} tokens), the pool has {free} "
                f"free of {self.pool.num_blocks} (raise --kv-mem or lower --max-tokens)"
            )

    def admits(self, n_prompt: int, n_seqs: int) -> bool:
        """Whether the pool's free blocks hold a request's start: its prompt and the first token
        of each of its n_seqs branches (cached prompt blocks count as free already). Growing
        past that is the scheduler's to handle, by preemption."""
        return self._blocks_for(n_prompt, 1, n_seqs)[0] <= self.pool.num_free

    def _blocks_for(self, n_prompt: int, n_new: int, n_seqs: int) -> tuple[int, int]:
        """Blocks that n_seqs forks of an n_prompt-token prompt hold with up to n_new tokens each,
        and the tokens one of them holds: the full prompt blocks once, the rest per fork; under a
        KV budget, at most the budget's share each (policy none: at most the context)."""
        ev, bs = self.policy.config, self.block_size
        total = min(n_prompt + n_new, self.ctx) if self.policy.bounded_context else n_prompt + n_new
        if ev.budget is not None:
            total = min(total, ev.budget + bs)
        shared = min(n_prompt, total) // bs if n_seqs > 1 else 0  # full prompt blocks every fork shares
        return shared + n_seqs * (-(-total // bs) - shared), total


def _blas_threads() -> int:
    try:
        from threadpoolctl import threadpool_info

        return max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"), default=1)
    except ImportError:
        import os

        return os.cpu_count() or 1


def _kv_formats(choice: str, backend: Backend, head_dim: int) -> tuple[kv_format.KvFormat, kv_format.KvFormat]:
    """The pool's (K, V) formats for EngineConfig.kv_dtype on this backend ("auto": its own)."""
    pair = kv_format.parse(backend.default_kv(head_dim) if choice == "auto" else choice)
    for fmt in pair:
        if fmt.name not in backend.caps.kv_dtypes:
            raise LocalkvError(
                f"--kv-dtype {choice}: the {backend.name} backend keeps K/V in {', '.join(backend.caps.kv_dtypes)} here"
            )
        fmt.row_len(head_dim)  # a head size the format cannot split into blocks: one line, now
    return pair


def _small_pages(*arrays: np.ndarray):
    """No transparent huge pages for the KV pool: each layer's K and V are separate regions of
    it, so with 2 MB pages the first block of a run alone makes 2 x layers x 2 MB resident (120
    MB for SmolLM2-135M); 4 KB pages hold what the run uses. Linux only; best effort."""
    for a in arrays:
        vm.madvise(a.ctypes.data, a.ctypes.data + a.nbytes, vm.MADV_NOHUGEPAGE)
