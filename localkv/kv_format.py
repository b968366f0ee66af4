"""How one K or V row (one token, one layer, one kv head: head_dim values) is stored in the pool:
each format's layout, its bytes, and its one encoder and decoder.

- f32, f16: the values as they are;
- q8_0: GGUF's block_q8_0 per 32 values: an f16 scale d, then 32 int8 q; a value is q * d
  (34 bytes per 32 values, 0.53x f16);
- q4_0: GGUF's block_q4_0 per 32 values: an f16 scale d, then 16 bytes whose low nibbles hold
  values 0-15 and high nibbles values 16-31, each (nibble - 8) * d (18 bytes, 0.28x f16).

A row is the pool's last axis. The pool array's numpy dtype names its format, which is what the
compiled kernels dispatch on as they compile: float32, float16, int8 (q8_0 bytes), uint8 (q4_0
bytes). Rows are quantized once, when written, each block with the scale that stores it best of
a fixed few (fit; llama.cpp's reference rounding of each value); decoding is
exact in float32 (an 8-bit integer times an f16 fits its 24-bit significand), so every path
that reads a row reads the same floats.
"""

from dataclasses import dataclass

import numpy as np

from localkv.errors import LocalkvError

QK = 32  # values per quantized block (both formats)
Q8_0_BYTES = 34  # f16 scale + 32 int8
Q4_0_BYTES = 18  # f16 scale + 16 bytes of nibbles
# the divisors of a block's scale that the encoder tries, llama.cpp's first (fit): a q8_0 block's
# largest magnitude maps to 127, 126.5 ... 119; a q4_0 block's value of largest magnitude to
# -8, then -9, -8.875 ... -7 (binary fractions: the same float32 in numpy, numba and CUDA C)
DIVISORS = {
    "q8_0": np.float32(127) - np.arange(17, dtype=np.float32) / np.float32(2),
    "q4_0": np.float32(-8) + np.r_[0, -8:0, 1:9].astype(np.float32) / np.float32(8),
}
ENCODER = "fit17"  # which encoder wrote a quantized pool's rows: in the prefix cache's key


@dataclass(frozen=True, slots=True)
class KvFormat:
    name: str  # what --kv-dtype says: f32 | f16 | q8_0 | q4_0
    dtype: np.dtype  # the pool array's element type (names the format, see the docstring)
    block: int  # values per block (1: a float format)
    block_bytes: int  # bytes per block

    @property
    def stored(self) -> str:
        """The name in prefix-cache salts and disk-entry headers (float formats: numpy's, as
        before quantized formats existed, so their entries stay valid)."""
        return self.dtype.name if self.block == 1 else self.name

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_len(self, head_dim: int) -> int:
        """Elements of the pool's last axis per row of head_dim values."""
        if head_dim % self.block:
            raise LocalkvError(
                f"--kv-dtype {self.name} needs a head dimension divisible by {self.block}, not {head_dim}"
            )
        return head_dim // self.block * self.block_bytes // self.dtype.itemsize

    def row_bytes(self, head_dim: int) -> int:
        return self.row_len(head_dim) * self.dtype.itemsize

    def head_dim(self, row_len: int) -> int:
        return row_len * self.dtype.itemsize // self.block_bytes * self.block


F32 = KvFormat("f32", np.dtype(np.float32), 1, 4)
F16 = KvFormat("f16", np.dtype(np.float16), 1, 2)
Q8_0 = KvFormat("q8_0", np.dtype(np.int8), QK, Q8_0_BYTES)
Q4_0 = KvFormat("q4_0", np.dtype(np.uint8), QK, Q4_0_BYTES)
FORMATS = {f.name: f for f in (F32, F16, Q8_0, Q4_0)}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}
_BY_STORED = {f.stored: f for f in FORMATS.values()}


def parse(text: str) -> tuple[KvFormat, KvFormat]:
    """(K, V) formats of a --kv-dtype value: one format for both, or K:V (e.g. q8_0:q4_0).
    LocalkvError for anything else."""
    parts = str(text).strip().lower().split(":")
    if len(parts) in (1, 2) and all(p in FORMATS for p in parts):
        return FORMATS[parts[0]], FORMATS[parts[-1]]
    raise LocalkvError(f"unknown --kv-dtype {text!r}: use auto, {', '.join(FORMATS)}, or K:V such as q8_0:q4_0")


def pair_name(k: KvFormat, v: KvFormat) -> str:
    """What --kv-dtype would say for these formats (one name when they are the same)."""
    return k.name if k == v else f"{k.name}:{v.name}"


def of(a) -> KvFormat:
    """The format of a pool array (or a numpy dtype)."""
    dtype = np.dtype(getattr(a, "dtype", a))
    if dtype not in _BY_DTYPE:
        raise RuntimeError(f"no K/V format is stored as {dtype}: a bug in the caller's logic")
    return _BY_DTYPE[dtype]


def by_stored(name: str) -> KvFormat | None:
    """The format of one stored name (float16, q8_0...), or None for a name no format has."""
    return _BY_STORED.get(name)


def pair_stored(k: KvFormat, v: KvFormat) -> str:
    """A pool's formats as salts and disk entries name them: K's stored name, or "K:V"."""
    return k.stored if k == v else f"{k.stored}:{v.stored}"


def pair_by_stored(name: str) -> tuple[KvFormat, KvFormat] | None:
    """(K, V) formats of a disk entry's dtype field (pair_stored's names), or None for a name
    no pool has."""
    parts = name.split(":")
    if len(parts) not in (1, 2) or any(p not in _BY_STORED for p in parts):
        return None
    return _BY_STORED[parts[0]], _BY_STORED[parts[-1]]


def encode(x: np.ndarray, fmt: KvFormat) -> np.ndarray:
    """Rows x [..., head_dim] (float32) in fmt: [..., fmt.row_len(head_dim)] of fmt.dtype. A
    quantized block takes the scale of DIVISORS[fmt] that stores it with the least squared
    error (see fit)."""
    if not fmt.quantized:
        return x.astype(fmt.dtype, copy=False)
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, QK)
    d, q = fit(blocks, fmt)
    if fmt is Q4_0:
        q = q[..., :16] | (q[..., 16:] << 4)
    out = np.empty((*blocks.shape[:-1], fmt.block_bytes), np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-1], -1).view(fmt.dtype)


def fit(blocks: np.ndarray, fmt: KvFormat) -> tuple[np.ndarray, np.ndarray]:
    """Each block's scale d [..., 1] (float32, stored as f16) and its 32 codes (q8_0: int8 q;
    q4_0: uint8 nibbles n, value n - 8). For each divisor c of DIVISORS[fmt] in order, d =
    ref / c (ref: q8_0 the largest magnitude, q4_0 the value of largest magnitude with its
    sign, the first such), the codes by llama.cpp's rounding of each value over the scale as
    stored (f16(d): llama.cpp divides by d before rounding it, so a value near a rounding
    boundary can land on the farther point), clamped; the block keeps the first c whose values
    (codes times f16(d)) have the least squared error, summed in _tree order. The first
    divisor is llama.cpp's scale, so a block is never stored worse than by its rule; the
    others shrink the grid so that the values land nearer its points (BENCHMARKS.md, "K/V
    scales fitted"). The kernels and the GPU's encoder compute every step alike: the same
    bytes."""
    if fmt is Q8_0:
        ref = _block_max(np.abs(blocks))
    else:
        at = np.abs(blocks).argmax(axis=-1)[..., None]
        ref = np.take_along_axis(blocks, at, axis=-1)
    best_d = best_q = best_err = None
    for c in DIVISORS[fmt.name]:
        d = ref / c
        stored = d.astype(np.float16).astype(np.float32)
        q = _codes(blocks * _inverse(stored), fmt)
        value = (q.astype(np.float32) - np.float32(8)) if fmt is Q4_0 else q.astype(np.float32)
        e = blocks - value * stored
        err = _tree(e * e)
        if best_err is None:
            best_d, best_q, best_err = d, q, err
            continue
        better = err < best_err  # NaN never is: a block with NaN or Inf keeps the first rule
        best_d, best_err = np.where(better, d, best_d), np.where(better, err, best_err)
        best_q = np.where(better, q, best_q)
    return best_d, best_q


def _codes(y: np.ndarray, fmt: KvFormat) -> np.ndarray:
    """Values over the scale as codes: q8_0 C's roundf in [-127, 127]; q4_0 trunc(y + 8.5)
    in [0, 15] (llama.cpp's q4_0 rounding, its offset added as a float)."""
    if fmt is Q8_0:
        return np.clip(_round_away(y), -127, 127).astype(np.int8)
    with np.errstate(invalid="ignore"):
        return np.clip(np.trunc(y + np.float32(8.5)), 0, 15).astype(np.uint8)


def _tree(a: np.ndarray) -> np.ndarray:
    """The sum over the last axis (32 values) [..., 1], in one fixed order every encoder keeps:
    the second half added to the first lane by lane, then again, down to one."""
    return _halving(a, np.add)


def decode(a, xp=np):
    """Pool rows [..., row_len] as float32 [..., head_dim] (float32 rows as they are); xp: the
    array module of a (numpy, or CuPy for the GPU backend's fallback paths)."""
    fmt = of(a)
    if not fmt.quantized:
        return a if fmt is F32 else a.astype(np.float32)
    b = xp.ascontiguousarray(a).view(np.uint8).reshape(*a.shape[:-1], -1, fmt.block_bytes)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)
    if fmt is Q8_0:
        q = b[..., 2:].view(np.int8).astype(np.float32)
    else:
        nib = b[..., 2:]
        q = xp.concatenate((nib & 15, nib >> 4), axis=-1).astype(np.float32) - np.float32(8)
    return (q * d).reshape(*a.shape[:-1], -1)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, 0 where d is 0 (a block of zeros), as ggml's quantizers take it."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _block_max(a: np.ndarray) -> np.ndarray:
    """The max over the last axis (32 values) [..., 1], as halving np.maximum steps: numpy's
    reduction over a short last axis runs a loop per block."""
    return _halving(a, np.maximum)


def _halving(a: np.ndarray, op) -> np.ndarray:
    """op over the last axis [..., 1]: the second half into the first lane by lane, down to one."""
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = op(a[..., :h], a[..., h:])
    return a


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero; numpy's rint goes to even, so exact ties (x - rint(x)
    is exact in float32 here) move one step away from zero."""
    r = np.rint(x)
    tie = np.abs(x - r) == np.float32(0.5)
    return np.where(tie, x + np.copysign(np.float32(0.5), x), r)
