"""The GGUF block formats, decoded 32 values at a time for the kernels.

Every block type here can be written, per group of 32 values, as
    value[i] = s * u[i] + m,    u[i] an unsigned byte,
with one (s, m) for values 0-15 and one for 16-31 (the K-quants Q2_K, Q3_K and Q6_K scale
every 16 values; the others every 32 or every 256). `group(qt, w, blk, j)` returns
(u, sa, sb, ma, mb) for group j of the block starting at byte blk of w. Signed formats become
unsigned with an offset folded into m (Q8_0: u = q + 128, m = -128 d), so the kernels need
one unsigned x signed byte product (`simd/u8x32.dot`) for every type.

Layouts as in ggml's ggml-common.h / gguf's quants.py (fp16 scales little-endian):
    Q4_0 d, qs[16]                Q4_1 d, m, qs[16]          Q8_0 d, qs[32] (int8)
    Q5_0 d, qh[4], qs[16]         Q5_1 d, m, qh[4], qs[16]   (value j: nibble j | bit j of qh << 4)
    Q2_K scales[16] (low nibble scale, high min), qs[64] (2 bits), d, dmin
    Q3_K hmask[32], qs[64] (2 bits), scales[12] (16 x 6 bits, -32), d
    Q4_K d, dmin, scales[12] (8 scales + 8 mins, 6 bits), qs[128]
    Q5_K d, dmin, scales[12], qh[32], qs[128]
    Q6_K ql[128], qh[64], scales[16] (int8), d
(Q4_0/Q4_1/Q5_*: value j < 16 is the low nibble of qs[j], value j + 16 its high nibble.
K-quant nibbles hold value c*64 + k*32 + l in byte c*32 + l, low nibble k = 0; 2-bit fields hold
value h*128 + s*32 + l at bits 2s of byte h*32 + l; high bits of value i*32 + l are bit i of
hmask/qh byte l; Q6_K's nibbles hold value h*128 + k*64 + l at byte h*64 + l.)

The kernel a qtype selects is chosen while numba compiles: the kernels take a `QType` marker
as their first argument, and `group` / `geometry` resolve on its numba type, so each type's
kernel contains only its own decoder.
"""

import numpy as np
from numba import types
from numba.extending import NativeValue, models, overload, register_jitable, register_model, typeof_impl, unbox

from localkv.backends.cpu.formats.types import BLOCK_TYPES, FLOAT_TYPES, activation_group, block_size
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fjoin, fmul, fsplat, hgather
from localkv.backends.cpu.simd.u8x32 import (
    at,
    band,
    bits,
    bor,
    bxor,
    dot,
    dot7,
    half,
    lanes_dot,
    lanes_dot5,
    lanes_dot7,
    load32,
    nibbles,
    shl,
    shr,
    u32,
)  # fmt: skip


class QTypeT(types.Type):
    """numba type of a QType marker: one per block type."""

    def __init__(self, qname: str):
        self.qname = qname
        super().__init__(name=f"qtype[{qname}]")


class QType:
    """The marker passed to the kernels. `_numba_type_` spares numba's slow typeof path."""

    __slots__ = ("_numba_type_", "name")

    def __init__(self, name: str):
        self.name = name
        self._numba_type_ = QTypeT(name)


MARKERS = {name: QType(name) for name in BLOCK_TYPES + FLOAT_TYPES}


@typeof_impl.register(QType)
def _typeof_qtype(val, c):
    return val._numba_type_


register_model(QTypeT)(models.OpaqueModel)


@unbox(QTypeT)
def _unbox_qtype(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


def geometry(qt):
    """(groups of 32 per block, bytes per block), constants of the type."""


@overload(geometry, inline="always")
def _geometry(qt):
    values, nbytes = block_size(qt.qname)
    groups = values // 32
    return lambda qt: (groups, nbytes)


def act_group(qt):
    """The activations' quantization group of this type (types.activation_group), a constant."""


@overload(act_group, inline="always")
def _act_group(qt):
    n = activation_group(qt.qname)
    return lambda qt: n


def product(qt, acc, u, s):
    """u8x32.dot for this type's u: dot7 (faster without VNNI) unless u may reach 128 (Q8_0)."""


@overload(product, inline="always")
def _product(qt, acc, u, s):
    if qt.qname == "Q8_0":
        return lambda qt, acc, u, s: dot(acc, u, s)
    return lambda qt, acc, u, s: dot7(acc, u, s)


FIVE_BITS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"})  # every u < 32: lanes_dot5


def lanes_product(qt, u, xi, off):
    """u8x32.lanes_dot for this type's u, as `product` (lanes_dot5 where u < 32)."""


@overload(lanes_product, inline="always")
def _lanes_product(qt, u, xi, off):
    if qt.qname == "Q8_0":
        return lambda qt, u, xi, off: lanes_dot(u, xi, off)
    if qt.qname in FIVE_BITS:
        return lambda qt, u, xi, off: lanes_dot5(u, xi, off)
    return lambda qt, u, xi, off: lanes_dot7(u, xi, off)


def scales8(qt, w, off, idx, scalars):
    """group's (sa, sb, ma, mb) of 8 weight rows as F32x8 (lane l: the row whose block starts at
    byte off + idx[l]). The types whose block opens with its f16 scale (and min) gather them in
    one load; the others join the scalars `group` gave ((sa 4-tuples), (sb), (ma), (mb), each a
    pair of 4-tuples). The same values either way."""


@overload(scales8, inline="always")
def _scales8(qt, w, off, idx, scalars):
    if qt.qname not in GATHERED:

        def joined(qt, w, off, idx, scalars):
            (sa, ta), (sb, tb), (ma, na), (mb, nb) = scalars
            return fjoin(sa, ta), fjoin(sb, tb), fjoin(ma, na), fjoin(mb, nb)

        return joined
    if qt.qname in _WITH_MIN:

        def with_min(qt, w, off, idx, scalars):
            d, m = hgather(w, off, idx)
            return d, d, m, m

        return with_min
    k = np.float32(OFFSET[qt.qname])

    def offset_min(qt, w, off, idx, scalars):  # m = k * d (exact: k is a power of 2)
        d, _ = hgather(w, off, idx)
        m = fmul(fsplat(k), d)
        return d, d, m, m

    return offset_min


# The types whose block opens with d: then m, or (the signed ones) m = this times d
_WITH_MIN = frozenset(("Q4_1", "Q5_1"))
OFFSET = {"Q4_0": -8.0, "Q5_0": -16.0, "Q8_0": -128.0}
GATHERED = _WITH_MIN | frozenset(OFFSET)  # scales8 gathers these types' scales


def group(qt, w, blk, j):
    """(u, sa, sb, ma, mb) of group j of the block at byte blk of w (see the module doc)."""


@overload(group, jit_options=NO_NRT)
def _group(qt, w, blk, j):
    return _DECODERS[qt.qname]


def _q4_0(qt, w, blk, j):
    d = half(w, blk)
    return nibbles(w, blk + 2), d, d, np.float32(-8) * d, np.float32(-8) * d


def _q4_1(qt, w, blk, j):
    d, m = half(w, blk), half(w, blk + 2)
    return nibbles(w, blk + 4), d, d, m, m


def _q5_0(qt, w, blk, j):
    d = half(w, blk)
    u = bor(nibbles(w, blk + 6), shl(bits(u32(w, blk + 2)), 4))
    return u, d, d, np.float32(-16) * d, np.float32(-16) * d


def _q5_1(qt, w, blk, j):
    d, m = half(w, blk), half(w, blk + 2)
    return bor(nibbles(w, blk + 8), shl(bits(u32(w, blk + 4)), 4)), d, d, m, m


def _q8_0(qt, w, blk, j):
    d = half(w, blk)
    return bxor(load32(w, blk + 2), 0x80), d, d, np.float32(-128) * d, np.float32(-128) * d


def _q2_k(qt, w, blk, j):
    u = band(shr(load32(w, blk + 16 + 32 * (j >> 2)), 2 * (j & 3)), 3)
    d, dmin = half(w, blk + 80), half(w, blk + 82)
    sa, sb = at(w, blk + 2 * j), at(w, blk + 2 * j + 1)
    return u, d * np.float32(sa & 15), d * np.float32(sb & 15), -dmin * np.float32(sa >> 4), -dmin * np.float32(sb >> 4)


@register_jitable(**NO_NRT)
def _q3_k_scale(w, blk, t):
    lo = (at(w, blk + 96 + (t & 7)) >> (4 * (t >> 3))) & 15
    hi = (at(w, blk + 104 + (t & 3)) >> (2 * (t >> 2))) & 3
    return (lo | (hi << 4)) - 32


def _q3_k(qt, w, blk, j):
    ql = band(shr(load32(w, blk + 32 + 32 * (j >> 2)), 2 * (j & 3)), 3)
    u = bor(ql, shl(band(shr(load32(w, blk), j), 1), 2))
    d = half(w, blk + 108)
    sa, sb = d * np.float32(_q3_k_scale(w, blk, 2 * j)), d * np.float32(_q3_k_scale(w, blk, 2 * j + 1))
    return u, sa, sb, np.float32(-4) * sa, np.float32(-4) * sb


@register_jitable(**NO_NRT)
def _k_scale_min(w, o, j):
    """Scale and min of group j from the 12 packed bytes at w[o:] (Q4_K, Q5_K)."""
    if j < 4:
        return at(w, o + j) & 63, at(w, o + j + 4) & 63
    sc = (at(w, o + j + 4) & 15) | ((at(w, o + j - 4) >> 6) << 4)
    return sc, (at(w, o + j + 4) >> 4) | ((at(w, o + j) >> 6) << 4)


@register_jitable(**NO_NRT)
def _q4_k_u(w, blk, j):
    return band(shr(load32(w, blk + 16 + 32 * (j >> 1)), 4 * (j & 1)), 15)


def _q4_k(qt, w, blk, j):
    u = _q4_k_u(w, blk, j)
    sc, mn = _k_scale_min(w, blk + 4, j)
    s, m = half(w, blk) * np.float32(sc), -half(w, blk + 2) * np.float32(mn)
    return u, s, s, m, m


def _q5_k(qt, w, blk, j):
    lo = band(shr(load32(w, blk + 48 + 32 * (j >> 1)), 4 * (j & 1)), 15)
    u = bor(lo, shl(band(shr(load32(w, blk + 16), j), 1), 4))
    sc, mn = _k_scale_min(w, blk + 4, j)
    s, m = half(w, blk) * np.float32(sc), -half(w, blk + 2) * np.float32(mn)
    return u, s, s, m, m


@register_jitable(**NO_NRT)
def _q6_k_u(w, blk, j):
    h, r = j >> 2, j & 3
    lo = band(shr(load32(w, blk + 64 * h + 32 * (r & 1)), 4 * (r >> 1)), 15)
    hi = band(shr(load32(w, blk + 128 + 32 * h), 2 * r), 3)
    return bor(lo, shl(hi, 4))


@register_jitable(**NO_NRT)
def _q6_k_scale(w, blk, k):
    """The signed 8-bit scale of Q6_K's 16-value sub-block k."""
    return (at(w, blk + 192 + k) ^ 128) - 128


def _q6_k(qt, w, blk, j):
    d = half(w, blk + 208)
    sa, sb = d * np.float32(_q6_k_scale(w, blk, 2 * j)), d * np.float32(_q6_k_scale(w, blk, 2 * j + 1))
    return _q6_k_u(w, blk, j), sa, sb, np.float32(-32) * sa, np.float32(-32) * sb


_DECODERS = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def k_ints(qt, w, blk, j):
    """Group j of a Q4_K or Q6_K super-block in integers, as the super-block products use it:
    (u, the integer scales of its two 16-value halves, the integer factors of their
    activation sums): Q4_K's 6-bit scale and min twice, Q6_K's two signed scales twice."""


@overload(k_ints, jit_options=NO_NRT)
def _k_ints(qt, w, blk, j):
    if qt.qname == "Q4_K":

        def q4k(qt, w, blk, j):
            sc, mn = _k_scale_min(w, blk + 4, j)
            return _q4_k_u(w, blk, j), sc, sc, mn, mn

        return q4k

    def q6k(qt, w, blk, j):
        sa, sb = _q6_k_scale(w, blk, 2 * j), _q6_k_scale(w, blk, 2 * j + 1)
        return _q6_k_u(w, blk, j), sa, sb, sa, sb

    return q6k
