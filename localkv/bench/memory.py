"""`localkv bench memory`: how much of the reserved KV memory holds real tokens, paged vs
contiguous, on one seeded workload. An allocator-level simulation: no model runs, so it gives
the same numbers on any machine.

Workload (make_workload): n requests, all queued at step 0 (an offline batch, as in the vLLM
paper's throughput runs). Prompt and output lengths are drawn independently from a
log-uniform distribution, floor(exp(U(ln lo, ln(hi + 1)))), default [16, 1024] tokens each
(mean about 242, median about 128: many short requests, a long tail, the shape of ShareGPT
conversations), with numpy's default_rng(seed). A request longer than max_len (default 2048,
the context of the models the vLLM paper served; SmolLM2-135M's own is 8192, which would only
make contiguous reservation look worse) is cut to fit: prompt <= max_len - 1, then
output <= max_len - prompt.

One scheduler drives both memories, step by step, first come first served:
- every running request stores one more token per step (its newest token's K/V), and leaves
  when prompt + output tokens are stored;
- then waiting requests are admitted in order while the head one fits (no skipping);
- paged: the real BlockPool + KVManager (the same code the engine runs, on a pool whose K/V
  arrays are 1 float per slot): admission needs blocks for the stored tokens + one more token
  and leaves 1% of the blocks free as a watermark, as vLLM does; a request's block table grows
  a block only when its last block is full; when a step needs more blocks than are free, the
  most recently admitted request is preempted (its blocks freed, back to the head of the queue,
  its tokens recomputed on re-admission: vLLM's recompute preemption);
- contiguous: each request reserves max_len slots at admission from one arena of the same
  size, first fit over a free list with coalescing, and keeps them to the end, as pre-vLLM
  engines (FasterTransformer, Orca) did because the output length is unknown up front. Two
  oracle variants that no real engine can run show where the waste comes from: "pow2"
  reserves the next power of two >= the request's final length, "exact" its final length.

Measured after every step, summed over steps (time-weighted):
- utilization: slots holding a stored token / reserved slots;
- internal fragmentation: reserved slots without a token / reserved slots, split into
  "reserved for later" (this request's future tokens will land there) and "never used" (past
  the request's final length: the rest of a reservation, the tail of a last block);
- external fragmentation: on steps where a request waits, free slots that cannot serve the
  head request (free gaps shorter than its reservation) / arena slots. A paged pool has none:
  any free block can take any token;
- batch: requests running at once, mean over the steps where a request waits (memory, not
  the queue, is the limit then) and peak.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from localkv.errors import LocalkvError
from localkv.kv.block_pool import BlockPool
from localkv.kv.block_tables import KVManager
from localkv.sequence import Sequence

# SmolLM2-135M's K/V per token at the engine's fp32: 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
WATERMARK = 0.01  # share of the paged pool kept free at admission (vLLM's default)
CONTIGUOUS = ("max", "pow2", "exact")


@dataclass(slots=True, frozen=True)
class MemoryConfig:
    n_requests: int = 1000
    seed: int = 0
    max_len: int = 2048
    prompt_range: tuple[int, int] = (16, 1024)
    output_range: tuple[int, int] = (16, 1024)
    arena_slots: int = 23296  # 1GiB of SmolLM2-135M fp32 K/V, in whole 16-token blocks
    block_size: int = 16

    def validate(self) -> "MemoryConfig":
        if self.n_requests < 1:
            raise LocalkvError(f"invalid request count {self.n_requests}: must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LocalkvError(f"invalid block size {self.block_size}: use a power of two")
        if self.max_len < 2:
            raise LocalkvError(f"invalid max length {self.max_len}: must be >= 2")
        for name, (lo, hi) in (("prompt", self.prompt_range), ("output", self.output_range)):
            if not 1 <= lo <= hi:
                raise LocalkvError(f"invalid {name} length range {lo}-{hi}")
        if self.arena_slots < self.max_len:
            raise LocalkvError(
                f"KV memory of {self.arena_slots} token slots cannot hold one request of "
                f"{self.max_len} tokens reserved contiguously (raise --kv-mem)"
            )
        return self


def arena_slots(kv_bytes: int, block_size: int = 16, bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN) -> int:
    """Token slots in kv_bytes of K/V, whole blocks only (what Engine's pool would hold)."""
    return kv_bytes // (bytes_per_token * block_size) * block_size


@dataclass(slots=True, frozen=True)
class Request:
    id: int
    prompt: int
    output: int

    @property
    def final(self) -> int:
        return self.prompt + self.output


def _log_uniform(rng, lo: int, hi: int, n: int) -> np.ndarray:
    return np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))).astype(int).clip(lo, hi)


def make_workload(cfg: MemoryConfig) -> list[Request]:
    rng = np.random.default_rng(cfg.seed)
    p = _log_uniform(rng, *cfg.prompt_range, cfg.n_requests)
    o = _log_uniform(rng, *cfg.output_range, cfg.n_requests)
    out = []
    for i, (a, b) in enumerate(zip(p.tolist(), o.tolist())):
        a = min(a, cfg.max_len - 1)
        out.append(Request(i, a, max(1, min(b, cfg.max_len - a))))
    return out


# ------------------------------------------------------------------ allocators


class PagedMemory:
    """The engine's BlockPool + KVManager, with 1-float K/V: only the bookkeeping is exercised."""

    name = "paged"

    def __init__(self, slots: int, block_size: int):
        self.bs = block_size
        self.pool = BlockPool(1, slots // block_size, block_size, 1, 1)
        self.kv = KVManager(self.pool)
        self.seqs: dict[int, Sequence] = {}
        self.watermark = int(self.pool.num_blocks * WATERMARK)

    @property
    def slots(self) -> int:
        return self.pool.num_blocks * self.bs

    def admit(self, r: Request, stored: int) -> bool:
        need = -(-(stored + 1) // self.bs)
        if self.pool.num_free - need < self.watermark:
            return False
        seq = Sequence([])
        self.kv.append_slots(seq, stored)
        self.seqs[r.id] = seq
        return True

    def need(self, running: list) -> int:
        """Blocks the next step takes (one more token for each running request)."""
        return sum(self.kv.need(self.seqs[r.id], 1) for r, _ in running)

    def grow(self, r: Request):
        self.kv.append_slots(self.seqs[r.id], 1)

    def free(self, r: Request):
        self.kv.free(self.seqs.pop(r.id))

    def reserved_by(self, r: Request) -> int:
        return len(self.seqs[r.id].block_table) * self.bs

    def reserved(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free) * self.bs

    def free_slots(self) -> int:
        return self.pool.num_free * self.bs

    def stranded(self, r: Request) -> int:
        return 0  # any free block serves any request

    def tables(self) -> list[list[int]]:
        return [s.block_table for s in self.seqs.values()]


class ContiguousMemory:
    """One arena of slots; each request takes one contiguous reservation, first fit."""

    def __init__(self, slots: int, max_len: int, mode: str = "max"):
        if mode not in CONTIGUOUS:
            raise ValueError(f"unknown contiguous mode {mode!r}")
        self.name = "contiguous" if mode == "max" else f"contiguous-{mode}"
        self.slots, self.max_len, self.mode = slots, max_len, mode
        self.gaps: list[list[int]] = [[0, slots]]  # sorted [start, length] free ranges
        self.held: dict[int, tuple[int, int]] = {}  # request id -> (start, length)

    def size_for(self, r: Request) -> int:
        if self.mode == "max":
            return self.max_len
        if self.mode == "pow2":
            return min(self.max_len, 1 << (r.final - 1).bit_length())
        return r.final

    def admit(self, r: Request, stored: int) -> bool:
        size = self.size_for(r)
        for g in self.gaps:
            if g[1] >= size:
                self.held[r.id] = (g[0], size)
                g[0] += size
                g[1] -= size
                if not g[1]:
                    self.gaps.remove(g)
                return True
        return False

    def need(self, running: list) -> int:
        return 0  # a reservation already covers every token the request will store

    def grow(self, r: Request):
        pass

    def free(self, r: Request):
        start, size = self.held.pop(r.id)
        self.gaps.append([start, size])
        self.gaps.sort()
        merged = [self.gaps[0]]
        for s, n in self.gaps[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1][1] += n
            else:
                merged.append([s, n])
        self.gaps = merged

    def reserved_by(self, r: Request) -> int:
        return self.held[r.id][1]

    def reserved(self) -> int:
        return sum(n for _, n in self.held.values())

    def free_slots(self) -> int:
        return sum(n for _, n in self.gaps)

    def stranded(self, r: Request) -> int:
        size = self.size_for(r)
        return sum(n for _, n in self.gaps if n < size)


# ------------------------------------------------------------------ simulation


@dataclass(slots=True)
class SimResult:
    allocator: str
    steps: int = 0
    tokens_stored: int = 0  # sum over steps of slots holding a token
    slots_reserved: int = 0  # sum over steps of reserved slots
    reserved_later: int = 0  # sum over steps of reserved slots a future token of the same request will use
    never_used: int = 0  # sum over steps of reserved slots past the request's final length
    stranded: int = 0  # sum over waiting steps of free slots the head request cannot use
    waiting_steps: int = 0
    batch_waiting: int = 0  # sum over waiting steps of running requests
    peak_batch: int = 0
    peak_reserved: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    arena: int = 0
    finished: int = 0
    series: dict = field(default_factory=lambda: {"step": [], "reserved": [], "stored": [], "running": []})

    @property
    def utilization(self) -> float:
        return self.tokens_stored / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def internal_frag(self) -> float:
        return 1 - self.utilization if self.slots_reserved else 0.0

    @property
    def external_frag(self) -> float:
        return self.stranded / (self.waiting_steps * self.arena) if self.waiting_steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.batch_waiting / self.waiting_steps if self.waiting_steps else float(self.peak_batch)

    def row(self) -> dict:
        res = self.slots_reserved or 1
        return {
            "allocator": self.allocator,
            "utilization": self.utilization,
            "internal_frag": self.internal_frag,
            "reserved_for_later": self.reserved_later / res,
            "never_used": self.never_used / res,
            "external_frag": self.external_frag,
            "mean_batch": self.mean_batch,
            "peak_batch": self.peak_batch,
            "steps": self.steps,
            "peak_reserved_slots": self.peak_reserved,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "arena_slots": self.arena,
            "finished": self.finished,
        }


def simulate(mem, requests: list[Request], max_series: int = 2000, check=None) -> SimResult:
    """Run the workload through one memory; check(mem, running) is called after every step."""
    res = SimResult(mem.name, arena=mem.slots)
    waiting = [(r, r.prompt) for r in requests]  # (request, tokens to store on admission)
    waiting.reverse()  # pop() from the end: the head of the queue is waiting[-1]
    running: list[list] = []  # [request, stored tokens], in admission order
    trace = []
    while waiting or running:
        # every running request stores its newest token
        need = mem.need(running)
        free = mem.pool.num_free if isinstance(mem, PagedMemory) else 0
        while need > free and running:  # paged only: recompute-preempt the newest request
            r, stored = running.pop()
            mem.free(r)
            waiting.append((r, stored))
            res.preemptions += 1
            res.recomputed_tokens += stored
            need, free = mem.need(running), mem.pool.num_free
        still = []
        for item in running:
            mem.grow(item[0])
            item[1] += 1
            if item[1] >= item[0].final:
                mem.free(item[0])
                res.finished += 1
            else:
                still.append(item)
        running = still
        # admit in order while the head fits
        while waiting and mem.admit(waiting[-1][0], waiting[-1][1]):
            running.append(list(waiting.pop()))
        if not running and waiting:
            r = waiting[-1][0]
            raise LocalkvError(f"request of {r.final} tokens never fits {mem.slots} slots ({mem.name})")
        trace.append(_record(res, mem, running, waiting[-1][0] if waiting else None))
        if check:
            check(mem, running)
    stride = max(1, -(-len(trace) // max_series))
    for step, reserved, stored, n in trace[::stride]:
        res.series["step"].append(step)
        res.series["reserved"].append(reserved)
        res.series["stored"].append(stored)
        res.series["running"].append(n)
    return res


def _record(res: SimResult, mem, running: list, head: Request | None) -> tuple[int, int, int, int]:
    """Add one step's measures to res (head: the waiting request at the queue's head, if any);
    returns the step's (step, reserved, stored, running) for the series."""
    res.steps += 1
    stored = sum(s for _, s in running)
    reserved = mem.reserved()
    res.tokens_stored += stored
    res.slots_reserved += reserved
    for r, s in running:
        held = mem.reserved_by(r)
        res.reserved_later += min(held, r.final) - s
        res.never_used += held - min(held, r.final)
    if head is not None:
        res.waiting_steps += 1
        res.batch_waiting += len(running)
        res.stranded += mem.stranded(head)
    res.peak_batch = max(res.peak_batch, len(running))
    res.peak_reserved = max(res.peak_reserved, reserved)
    return res.steps, reserved, stored, len(running)


def run(cfg: MemoryConfig, variants=CONTIGUOUS) -> tuple[list[Request], list[SimResult]]:
    """The workload through the paged pool and each contiguous variant, same arena size."""
    cfg.validate()
    reqs = make_workload(cfg)
    out = [simulate(PagedMemory(cfg.arena_slots, cfg.block_size), reqs)]
    for mode in variants:
        out.append(simulate(ContiguousMemory(cfg.arena_slots, cfg.max_len, mode), reqs))
    return reqs, out


def workload_stats(reqs: list[Request]) -> dict:
    p = np.array([r.prompt for r in reqs])
    o = np.array([r.output for r in reqs])
    return {
        "requests": len(reqs),
        "prompt_mean": float(p.mean()),
        "prompt_median": float(np.median(p)),
        "prompt_max": int(p.max()),
        "output_mean": float(o.mean()),
        "output_median": float(np.median(o)),
        "output_max": int(o.max()),
        "final_mean": float((p + o).mean()),
    }
