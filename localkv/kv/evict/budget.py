"""EvictConfig: a policy name and a per-sequence KV budget, and how the budget is split.

With block size B, all counts per sequence (tokens unless the name says blocks):

- budget_blocks   = budget // B
- sink_tokens     = sinks rounded up to whole blocks (they never leave)
- room_blocks     = budget_blocks - sink blocks - 1, the 1 being the spare block that holds
                    the partially filled last block
- side_blocks     = the part of the room held outside the pool's block table: h2o's
                    heavy-hitter slots (per layer and kv head) or offload's recall slots (per
                    layer); 0 for sliding. With an explicit `recent`, all the room the window
                    leaves; else the policy's share of the room, leaving at least one block.
- recent_tokens   = `recent` if given, else what the side slots leave: (room - side) * B
- resident_blocks = budget_blocks - side_blocks: the most blocks a table holds after a step
- chunk_limit     = max(1, recent_tokens): the most tokens one step may append

After a step a table holds the sinks and the blocks that meet the last recent_tokens
positions, at most ceil(recent / B) + 1 of them, so validate() asks for
budget_blocks * B >= sink_tokens + ceil(recent / B) * B + B + side_blocks * B.
Each layer then attends to at most the budget: the resident blocks plus its side slots.
"""

from dataclasses import dataclass
from typing import Literal, get_args

from localkv.errors import LocalkvError

PolicyName = Literal["none", "sliding", "h2o", "offload"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class EvictConfig:
    policy: PolicyName = "none"
    budget: int | None = None  # tokens of KV one sequence may hold (none: a hard stop; None: no limit)
    sinks: int = 4  # leading tokens always kept (rounded up to whole blocks)
    recent: int | None = None  # trailing tokens always kept; None: what the side slots leave
    heavy_share: float = 0.5  # h2o: share of the room spent on per-layer-head heavy-hitter slots
    decay: float = 0.999  # h2o: scores fade by this factor per query (1.0: plain H2O sums)
    recall_share: float = 0.9  # offload: share of the room spent on per-layer recall slots
    rerank: int = 3  # offload: Quest keeps rerank x the recall slots as candidates for the exact pass

    def validate(self, block_size: int) -> "EvictConfig":
        """Raise LocalkvError (one line, what to change) unless the config can run; return self."""
        if self.policy not in POLICIES:
            raise LocalkvError(f"unknown KV policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        for name in ("budget", "sinks", "recent"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise LocalkvError(f"invalid KV {name} {value}: must be >= 0")
        if self.policy == "none":
            return self
        if self.budget is None:
            raise LocalkvError(f"KV policy {self.policy!r} needs a budget (tokens of KV per sequence)")
        for name in ("recall_share", "heavy_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise LocalkvError(f"invalid {name.replace('_', ' ')} {getattr(self, name)}: must be in [0, 1)")
        bs, sinks, recent = block_size, self.sink_tokens(block_size), self.recent_tokens(block_size)
        need = sinks + ceil_div(recent, bs) * bs + bs + self.side_blocks(bs) * bs
        if self.budget_blocks(bs) * bs < need:
            raise LocalkvError(
                f"KV budget {self.budget} tokens is too small: sinks ({sinks}, whole blocks of {bs}) "
                f"+ recent window ({recent}, whole blocks) + one block ({bs}) need {need}"
            )
        return self

    def budget_blocks(self, block_size: int) -> int:
        return (self.budget or 0) // block_size

    def sink_tokens(self, block_size: int) -> int:
        return ceil_div(self.sinks, block_size) * block_size

    def room_blocks(self, block_size: int) -> int:
        """The budget past the sink blocks and the spare block."""
        return max(0, self.budget_blocks(block_size) - 1 - self.sink_tokens(block_size) // block_size)

    def side_blocks(self, block_size: int) -> int:
        """Blocks' worth of the budget held outside the pool's table (h2o, offload; else 0)."""
        share = {"offload": self.recall_share, "h2o": self.heavy_share}.get(self.policy)
        if share is None:
            return 0
        room = self.room_blocks(block_size)
        if self.recent is not None:
            return max(0, room - ceil_div(self.recent, block_size))
        return min(max(0, room - 1), int(room * share))

    def recent_tokens(self, block_size: int) -> int:
        if self.recent is not None:
            return self.recent
        return (self.room_blocks(block_size) - self.side_blocks(block_size)) * block_size

    def resident_blocks(self, block_size: int) -> int:
        """The most blocks a sequence's table holds in the pool after a step."""
        return self.budget_blocks(block_size) - self.side_blocks(block_size)

    def heavy_tokens(self, block_size: int) -> int:
        """h2o: heavy-hitter slots per layer and kv head (0 for the other policies)."""
        return self.side_blocks(block_size) * block_size if self.policy == "h2o" else 0

    def recall_blocks(self, block_size: int) -> int:
        """offload: blocks each layer may read back from the tier per step (0 for the others)."""
        return self.side_blocks(block_size) if self.policy == "offload" else 0

    def chunk_limit(self, block_size: int) -> int | None:
        """The most tokens one step may append to a sequence and still end within budget."""
        return None if self.policy == "none" else max(1, self.recent_tokens(block_size))
