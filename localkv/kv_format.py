"""How one K or V row (one token, one layer, one kv head: head_dim values) is stored in the pool:
each format's layout, its bytes, and its one encoder and decoder.

- f32, f16: the values as they are;
- q8_0: GGUF's block_q8_0 per 32 values: an f16 scale d, then 32 int8 q; a value is q * d
  (34 bytes per 32 values, 0.53x f16);
- q4_0: GGUF's block_q4_0 per 32 values: an f16 scale d, then 16 bytes whose low nibbles hold
  values 0-15 and high nibbles values 16-31, each (nibble - 8) * d (18 bytes, 0.28x f16).

A row is the pool's last axis. The pool array's numpy dtype names its format, which is what the
compiled kernels dispatch on as they compile: float32, float16, int8 (q8_0 bytes), uint8 (q4_0
bytes). Rows are quantized once, when written, with llama.cpp's reference rounding; decoding is
exact in float32 (an 8-bit integer times an f16 fits its 24-bit significand), so every path
that reads a row reads the same floats.
"""

from dataclasses import dataclass

import numpy as np

from localkv.errors import LocalkvError

QK = 32  # values per quantized block (both formats)
Q8_0_BYTES = 34  # f16 scale + 32 int8
Q4_0_BYTES = 18  # f16 scale + 16 bytes of nibbles


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
    """The format of a disk entry's dtype field, or None for a name no format has."""
    return _BY_STORED.get(name)


def encode(x: np.ndarray, fmt: KvFormat) -> np.ndarray:
    """Rows x [..., head_dim] (float32) in fmt: [..., fmt.row_len(head_dim)] of fmt.dtype."""
    if not fmt.quantized:
        return x.astype(fmt.dtype, copy=False)
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, QK)
    if fmt is Q8_0:
        d = _block_max(np.abs(blocks)) / np.float32(127)
        q = _round_away(blocks * _inverse(d)).astype(np.int8)
    else:  # the value of largest magnitude, sign kept, maps to -8
        at = np.abs(blocks).argmax(axis=-1)[..., None]
        d = np.take_along_axis(blocks, at, axis=-1) / np.float32(-8)
        n = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
        q = n[..., :16] | (n[..., 16:] << 4)
    out = np.empty((*blocks.shape[:-1], fmt.block_bytes), np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-1], -1).view(fmt.dtype)


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
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = np.maximum(a[..., :h], a[..., h:])
    return a


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero; numpy's rint goes to even, so exact ties (x - rint(x)
    is exact in float32 here) move one step away from zero."""
    r = np.rint(x)
    tie = np.abs(x - r) == np.float32(0.5)
    return np.where(tie, x + np.copysign(np.float32(0.5), x), r)
