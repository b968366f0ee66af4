"""A sequence: its token ids and the block table that maps its positions to pool blocks."""

from dataclasses import dataclass, field
from itertools import count

_ids = count()

# A block-table entry read per kv head (kv/evict's PositionedKV, the CPU causal kernel's tables)
# may also say where a block's keys are not: HOLE (offloaded, not recalled: they weigh 0), or
# extra_entry(i) for block i of K/V recalled beside the pool.
HOLE = -1


def extra_entry(i):
    """The table entry of block i of the recalled K/V (the entries below HOLE)."""
    return -2 - i


@dataclass(slots=True)
class Sequence:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens run through the model: the next one sits at this position
    num_stored: int = 0  # tokens whose K/V the block table holds (fewer than computed once blocks are evicted)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full blocks
    hashable: bool = True  # false once eviction broke the block <-> position correspondence
    cow_copies: int = 0  # shared blocks this sequence copied before writing into them
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.num_computed :]
