"""One step's KV work, planned once and committed exactly: which blocks each sequence's policy
frees, how many free blocks the new tokens take, and whether the pool holds them (vLLM's
allocate_slots, nano-vllm's can_append / may_append). Planning changes nothing; a commit that
raises changes nothing either. And the way back: dropping a sequence's last tokens."""

from dataclasses import dataclass, field

import numpy as np

from localkv.errors import BudgetReached, PoolExhausted
from localkv.kv.block_tables import KVManager
from localkv.kv.evict import Policy, RoomPlan
from localkv.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    """What one step appends to which sequences, and what that takes from the pool.

    counts[i] new tokens go to seqs[i]: a prompt chunk, one sampled token, or several tokens of
    a decoding sequence (a speculative draft) whose tail may be rolled back after the forward
    (rollback below). A rollback may touch only the dropped tokens: their slots (left to be
    overwritten), the blocks they leave empty (released; one registered in the prefix cache
    keeps its hash, since its K/V is that of the tokens the hash names) and the registration of
    the block they leave partly filled (dropped if the sequence holds it alone, as its next
    write overwrites it; a shared one keeps it, and the next write copies the block). It never
    touches the blocks, hashes or registrations of the tokens that stay, nor another sequence.
    A policy that acted on the step's tokens (victims chosen for them, H2O's attention mass
    folded from their queries, offload's recall events) cannot take that back: rollback under
    it raises before anything changes.

    A plan is for the state it was made in: commit it before anything else changes the pool or
    its sequences (commit refuses a plan it can see is stale)."""

    seqs: list[Sequence]  # the step's sequences, in order (without those out of budget)
    counts: list[int]  # new tokens each appends
    rooms: list[RoomPlan]  # what each one's policy frees before its tokens are appended
    out_of_budget: list[tuple[Sequence, str]]  # left out: their policy cannot make room (why)
    need: int  # free blocks the new tokens take, copies-on-write included
    short: int  # blocks the pool lacks for the step (<= 0: it fits), counting the victims it frees
    stamp: tuple = field(default=(), repr=False)  # the state planned for

    @property
    def fits(self) -> bool:
        return self.short <= 0


def plan_step(policy: Policy, kv: KVManager, seqs: list[Sequence], counts: list[int]) -> StepPlan:
    """Plan a step of counts[i] pending tokens of seqs[i]; a sequence whose policy cannot make
    room goes to out_of_budget instead. Changes nothing."""
    if len(seqs) != len(counts) or not all(0 < n <= len(s.pending) for s, n in zip(seqs, counts)):
        raise RuntimeError("a step count outside a sequence's pending tokens: a bug in the caller's logic")
    kept, kept_counts, rooms, out = [], [], [], []
    for seq, n in zip(seqs, counts):
        try:
            rooms.append(policy.plan(seq, n))
        except BudgetReached as e:
            out.append((seq, str(e)))
            continue
        kept.append(seq)
        kept_counts.append(n)
    need = sum(kv.need(s, n) for s, n in zip(kept, kept_counts))
    short = need - kv.pool.num_free - sum(len(r.victims) for r in rooms)  # each victim frees one block
    return StepPlan(kept, kept_counts, rooms, out, need, short, _stamp(kv, kept))


def commit(policy: Policy, kv: KVManager, plan: StepPlan) -> list[np.ndarray]:
    """Carry out a plan's KV work: the policy's room, then slots for the new tokens (one array
    per sequence). Everything that can fail is checked first: a commit that raises changes
    nothing."""
    if plan.out_of_budget:
        seq, why = plan.out_of_budget[0]
        raise BudgetReached(why)
    if not plan.seqs:
        raise RuntimeError("an empty step plan: a bug in the caller's logic")
    if plan.stamp != _stamp(kv, plan.seqs):
        raise RuntimeError("a step plan committed after its sequences or the pool changed: a bug in the caller's logic")
    if not plan.fits:
        free = plan.need - plan.short
        raise PoolExhausted(f"KV pool exhausted: this step needs {plan.need} blocks, {free} are free (raise --kv-mem)")
    policy.reserve(plan.rooms)  # e.g. the offload tier's spill space, before any sequence is touched
    for seq, room in zip(plan.seqs, plan.rooms):
        policy.make_room(seq, room)
    return [kv.append_slots(seq, n) for seq, n in zip(plan.seqs, plan.counts)]


def rollback(policy: Policy, kv: KVManager, seq: Sequence, n: int) -> None:
    """Drop seq's last n tokens, all computed (the StepPlan contract): the policy first (it
    raises if it cannot), then the block table."""
    policy.rollback(seq, n)
    kv.rollback(seq, n)


def _stamp(kv: KVManager, seqs: list[Sequence]) -> tuple:
    """What a plan depends on and a caller could change before committing it: the pool's free
    count and each sequence's length, table and tail block's sharing."""
    blocks = kv.pool.blocks
    return kv.pool.num_free, [
        (s.num_computed, s.num_stored, len(s.block_table), blocks[s.block_table[-1]].ref_count if s.block_table else 0)
        for s in seqs
    ]
