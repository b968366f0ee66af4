"""A row of the paged pool (one token's head_dim values of one kv head) read as float32
vectors, in the pool's K/V format (kv_format: its numpy dtype names it): f32 as is, f16 by F16C,
q8_0 / q4_0 as their integer codes times the block's scale (exact in float32)."""

from numba import types
from numba.extending import overload

from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.f32x8 import fload, fstore, hload, q4load, q8load
from localkv.backends.cpu.simd.u8x32 import half
from localkv.kv_format import Q4_0_BYTES, Q8_0_BYTES, QK


def vload(a, off):
    """8 pool values at a flat offset as float32: float32 as is, uint16 as half floats."""


@overload(vload, jit_options={"fastmath": True, **NO_NRT})
def _vload_impl(a, off):
    if a.dtype == types.uint16:
        return lambda a, off: hload(a, off)
    return lambda a, off: fload(a, off)


def quant_bytes(a) -> int:
    """The bytes of one 32-value block of a pool array in a quantized K/V format (0: floats)."""
    return Q8_0_BYTES if a.dtype == types.int8 else Q4_0_BYTES if a.dtype == types.uint8 else 0


def block_values(a, at, j, s):
    """Values j .. j + 7 (j a multiple of 8) of the quantized block at byte `at` of a pool array,
    times its scale s, as float32: q8_0, 32 int8 after the f16 scale; q4_0, 16 bytes of two
    nibbles (values 0-15 low, 16-31 high)."""


@overload(block_values, inline="always")
def _block_values_impl(a, at, j, s):
    if a.dtype == types.int8:
        return lambda a, at, j, s: q8load(a, at + 2 + j, s)
    return lambda a, at, j, s: q4load(a, at + 2 + j % (QK // 2), j // (QK // 2) * 4, s)


def rload(a, row, d):
    """Values d .. d + 7 (d a multiple of 8) of row `row` of a pool array (a row: its last
    axis; row a flat index over the others) as float32, in the array's K/V format (kv_format:
    its dtype names it)."""


@overload(rload, jit_options={"fastmath": True, **NO_NRT})
def _rload_impl(a, row, d):
    last, nbytes = a.ndim - 1, quant_bytes(a)
    if nbytes:

        def quantized(a, row, d):
            at = row * a.shape[last] + d // QK * nbytes
            return block_values(a, at, d % QK, half(a, at))

        return quantized
    return lambda a, row, d: vload(a, row * a.shape[last] + d)


def row_into(dst, off, a, row, hd):
    """dst[off : off + hd] = row `row` of a pool array as float32 (rload's values; a quantized
    format's scale read once per block, not once per 8 values)."""


@overload(row_into, jit_options={"fastmath": True, **NO_NRT})
def _row_into_impl(dst, off, a, row, hd):
    last, nbytes = a.ndim - 1, quant_bytes(a)
    if nbytes:

        def quantized(dst, off, a, row, hd):
            for b in range(hd // QK):
                at = row * a.shape[last] + b * nbytes
                s = half(a, at)
                for j in range(0, QK, 8):
                    fstore(dst, off + b * QK + j, block_values(a, at, j, s))

        return quantized

    def floats(dst, off, a, row, hd):
        for d in range(0, hd, 8):
            fstore(dst, off + d, vload(a, row * a.shape[last] + d))

    return floats
