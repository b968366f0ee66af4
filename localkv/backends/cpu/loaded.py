"""What build.load found in this process: whether the attention and element-wise kernels run,
each weight type's kernels, and the kernel modules loaded. Apart from build so that the weight
API (quant) reads it without importing the loader that imports it."""

from dataclasses import dataclass, field
from types import ModuleType


@dataclass(slots=True)
class State:
    """What load() found in this process, and the kernel modules it loaded."""

    ok: bool | None = None  # the attention and element-wise kernels run; None until load() tried
    imported: bool = False  # numba and the kernel modules imported, the stale-cache guard run
    why: str | None = None  # why they do not
    types: dict[str, str | None] = field(default_factory=dict)  # weight type -> None (runs) or why not
    kv: dict[str, str | None] = field(default_factory=dict)  # K/V format -> None (its kernels passed) or why not
    attention: ModuleType | None = None  # kernels.attention, decode_rows, elementwise once checked
    decode_rows: ModuleType | None = None
    elementwise: ModuleType | None = None
    weights: ModuleType | None = None  # quant.compiled, once a weight type's kernels passed


state = State()
