"""Rotated K/V: a fixed orthogonal transform of each head's rows before a quantized pool stores
them, so that a few large values of a head dimension no longer set a whole block's scale.

The transform is M = H D / sqrt(n): random signs D (from SEED), then a Walsh-Hadamard transform
H of each n-value block of the head dimension (n the largest power of two dividing it: the whole
head for 64 or 128). M is orthogonal, so (M q) . (M k) = q . k and sum_j w_j (M v_j) = M (sum_j
w_j v_j): the attention of rotated Q and K over rotated V, rotated back by M^T = D H / sqrt(n),
is the attention of the rows themselves up to rounding. K and Q turn when K is quantized, V and
the attention output when V is; a float pool needs none.

Every value goes through the same butterflies (pairs summed and differenced, stage by stage),
the sign flips and one float32 multiply, whatever the number of rows: a row's bits depend on
the row alone, on numpy, numba or CuPy alike. The seed and the block are part of the prefix
cache's key (`tag`): rows rotated otherwise are another format.
"""

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

SEED = 0x10CA1  # the signs; changing it changes every rotated row (and the prefix-cache key)


@dataclass(frozen=True)
class Rotation:
    head_dim: int
    k: bool  # K (and Q) rotated
    v: bool  # V rotated (and the attention output turned back)
    signs: np.ndarray = field(repr=False, compare=False)
    block: int = 0

    @classmethod
    def for_formats(cls, k_quantized: bool, v_quantized: bool, head_dim: int, enabled: bool = True):
        """The rotation of a pool whose K / V are quantized or not; None when nothing turns."""
        if not enabled or not (k_quantized or v_quantized):
            return None
        signs = np.where(np.random.default_rng(SEED).random(head_dim) < 0.5, -1.0, 1.0).astype(np.float32)
        return cls(head_dim, k_quantized, v_quantized, signs, head_dim & -head_dim)

    @property
    def tag(self) -> str:
        """What the prefix cache's key says of it."""
        return f"rot-h{self.block}-s{SEED:x}-{'k' if self.k else ''}{'v' if self.v else ''}"

    def heads(self, n_heads: int, n_kv_heads: int) -> tuple[int, int]:
        """The heads of a qkv row [q heads | k heads | v heads] that turn: [first, end)."""
        return 0 if self.k else n_heads + n_kv_heads, n_heads + (2 if self.v else 1) * n_kv_heads

    @cached_property  # read on every layer of every pass
    def scale(self) -> np.float32:
        return np.float32(1 / np.sqrt(self.block))

    def apply(self, x, xp=np):
        """M x for rows x [..., head_dim] (float32): a new array."""
        return hadamard(x * xp.asarray(self.signs), self.block, xp) * self.scale

    def undo(self, y, xp=np):
        """M^T y: a new array."""
        return hadamard(y, self.block, xp) * self.scale * xp.asarray(self.signs)


def hadamard(x, n: int, xp=np):
    """The unnormalised Walsh-Hadamard transform of each n-value block of x's last axis (n a
    power of two dividing it), by butterflies: stage h sums and differences the values h apart."""
    shape, d = x.shape, x.shape[-1]
    y = x.reshape(-1, d // n, n)
    h = 1
    while h < n:
        y = y.reshape(-1, d // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = xp.stack((a + b, a - b), axis=-2)
        h *= 2
    return y.reshape(shape)
