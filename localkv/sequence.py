"""A sequence: its token ids and the block table that maps its positions to pool blocks."""

from dataclasses import dataclass, field
from itertools import count

_ids = count()


@dataclass(slots=True)
class Sequence:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_kv: int = 0  # tokens whose K/V are in the pool; tokens[num_kv:] still need a forward pass
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.num_kv:]
