"""superblock.matmul_rows (Q4_K and Q6_K) for whole blocks of 16 activation rows on Intel AMX's
int8 tiles: the same bits for every row, the integer dots on the tile unit.

Why: a prefill pass of a K-quant model is almost all super-block products, and a super-block's
integer sum is exact however it is computed. Each weight, times its half's integer scale (plus
BIAS, so that Q6_K's signed scales give an unsigned value), is split into two unsigned bytes
(_decode, from the packed row group of formats/packed, once per work chunk); tdpbusd then
multiplies 16 weight rows by 16 activation rows
(lanes_inputs(qt, x, 16)'s blocks are already the tiles' layout: 4 bytes of each of 16 rows per
64-byte tile row) 64 values at a time with no per-group scaling left: four products per digit
give a super-block's scaled sum, low byte + 256 x high byte, less BIAS x the activations' sum.
The offsets' integer sums are vpdpwssd on int16 pairs; then superblock._step's float ops per
lane, so a row gets matmul_rows' bits (tests/backends/test_matmul_wide.py): nothing is rounded.

quant.compiled.every_row takes it where the CPU has AMX-INT8 and Linux grants the process the
tile state (`chosen`; LOCALKV_AMX=0 turns it off), for passes of AMX_ROWS rows or more (fewer
run faster on superblock_packed).
"""

import ctypes
import os
import platform
import sys

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import CHUNK, chunk, chunks
from localkv.backends.cpu.kernels.matmul_wide import transpose16
from localkv.backends.cpu.kernels.superblock_packed import group_bytes, packed_ints, row_scales16
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.amx import tile_config, tile_dot_u8i8, tile_load, tile_release, tile_store, tile_zero
from localkv.backends.cpu.simd.f32x8 import fadd, fmul, fstore, fsub, tofloat
from localkv.backends.cpu.simd.u8x32 import scaled_bytes, store32
from localkv.backends.cpu.simd.x16 import iload16, imadd16, izero16, load16, pairs_dot16

LANES = 16  # activation rows per block, and weight rows per tile
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def enable() -> str | None:
    """Ask Linux for the tile state (needed once per process, before any tile op): None when
    the kernel can run here, else why not. LOCALKV_AMX=0 turns it off."""
    if os.environ.get("LOCALKV_AMX", "1").strip().lower() in ("0", "false", "no", "off"):
        return "LOCALKV_AMX=0"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not Linux on x86-64"
    import llvmlite.binding as llvm
    import numba

    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return "numba compiles for a named CPU (NUMBA_CPU_NAME/NUMBA_CPU_FEATURES), not this one"
    features = llvm.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-int8")):
        return "the CPU has no AMX-INT8"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"the kernel refused the AMX tile state ({os.strerror(ctypes.get_errno())})"
    return None


def chosen() -> bool:
    """Whether the CPU has AMX-INT8 and this process holds the tile state (enable)."""
    return enable() is None


@register_jitable
def _config():
    """Palette 1, all eight tiles 16 rows of 64 bytes: 0, 1 the dots' low and high digits
    (int32), 2-5 a super-block's activations (64 values each), 6, 7 weight tiles."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    return cfg


# added to each scaled weight so that it is unsigned (Q6_K's scales are signed): Q4_K's scaled
# values are 0..945, Q6_K's -8064..8001; either splits into two unsigned bytes
BIAS = {"Q4_K": 0, "Q6_K": 8192}


def bias(qt):
    """BIAS of qt's type, a constant."""


@overload(bias, inline="always")
def _bias(qt):
    k = BIAS[qt.qname]
    return lambda qt: k


@register_jitable(**NO_NRT)
def _decode(qt, p, base, nsb, i, ad, ms):
    """Weight row i of a packed row group (from byte base of p) as the tiles multiply it: each
    value times its half's integer scale, plus bias(qt), split into a low and a high byte (both
    unsigned), at ad[sb, digit, q, i, :] for values 64 q..64 q + 63 of super-block sb; each
    half's offset factor into ms."""
    gb = group_bytes(qt)
    a = ad.reshape(-1)
    for sb in range(nsb):
        for j in range(8):
            g = 8 * sb + j
            u, ka, kb, ma, mb = packed_ints(qt, p, base + sb * gb, i, j)
            ms[2 * g], ms[2 * g + 1] = ma, mb
            lo, hi = scaled_bytes(u, ka, kb, bias(qt))
            o = 8192 * sb + 1024 * (j // 2) + 64 * i + 32 * (j % 2)  # ad[sb, digit, j // 2, i, 32 (j % 2):]
            store32(a, o, lo)
            store32(a, o + 4096, hi)


@register_jitable(**NO_NRT)
def _dots(ad, sb, xb, cbuf):
    """The integer dots of super-block sb for the chunk's 16 weight rows (ad) x the block's 16
    activation rows (xb: lanes_inputs' layout is the tiles'), as two int32 tiles into cbuf:
    the low bytes' sums, then the high bytes' (256 values deep: four tile products each)."""
    a = ad.reshape(-1)
    o = 8192 * sb  # ad's bytes per super-block: 2 digits x 4 tiles of 1 KiB
    tile_zero(0)
    tile_zero(1)
    tile_load(2, xb, 4096 * sb, 64)
    tile_load(3, xb, 4096 * sb + 1024, 64)
    tile_load(4, xb, 4096 * sb + 2048, 64)
    tile_load(5, xb, 4096 * sb + 3072, 64)
    tile_load(6, a, o, 64)
    tile_load(7, a, o + 4096, 64)
    tile_dot_u8i8(0, 6, 2)
    tile_dot_u8i8(1, 7, 2)
    tile_load(6, a, o + 1024, 64)
    tile_load(7, a, o + 5120, 64)
    tile_dot_u8i8(0, 6, 3)
    tile_dot_u8i8(1, 7, 3)
    tile_load(6, a, o + 2048, 64)
    tile_load(7, a, o + 6144, 64)
    tile_dot_u8i8(0, 6, 4)
    tile_dot_u8i8(1, 7, 4)
    tile_load(6, a, o + 3072, 64)
    tile_load(7, a, o + 7168, 64)
    tile_dot_u8i8(0, 6, 5)
    tile_dot_u8i8(1, 7, 5)
    tile_store(0, cbuf, 0, 64)
    tile_store(1, cbuf, 256, 64)


@register_jitable(**NO_NRT)
def _rows(qt, p, base, sb, rows, cbuf, ps, ss, dx, mp, acc, low):
    """Per weight row r of the chunk: super-block sb's two exact integers (the dots' digits
    joined, the bias taken back; the offsets' as pairs_dot16 of the activations' pair sums ps
    and the row's pairs mp) and superblock._step's float step on 16 lanes, into acc and low."""
    n = mp.shape[1] // (ss.shape[0] // LANES)  # offset pairs per super-block
    sums = iload16(ss, LANES * sb)
    for r in range(rows):
        i = imadd16(iload16(cbuf, 16 * r), iload16(cbuf, 256 + 16 * r), 256, sums, -bias(qt))
        m = izero16()
        for q in range(n * sb, n * sb + n):
            m = pairs_dot16(m, ps, LANES * q, mp[r, q])
        s, t = row_scales16(qt, p, base + sb * group_bytes(qt), r, dx)
        fstore(acc, 16 * r, fadd(load16(acc, 16 * r), fmul(tofloat(i), s)))
        fstore(low, 16 * r, fadd(load16(low, 16 * r), fmul(tofloat(m), t)))


def per_group(qt):
    """Whether qt's offsets take one factor per group (Q4_K) rather than per half (Q6_K)."""


@overload(per_group, inline="always")
def _per_group(qt):
    k = qt.qname == "Q4_K"
    return lambda qt: k


@njit(**EXACT_PAR)
def lane_sums(xi):
    """The integer sums of each 16 activations of lanes_inputs(qt, x, 16)'s blocks xi: bs
    [blocks, groups * 32] int32, bs[b, 32 g + 16 h + r] = the sum of values 16 h..16 h + 15 of
    group g of row r of block b (what the super-blocks' offsets multiply)."""
    nb, ng = xi.shape[0], xi.shape[1] // 512
    bs = np.zeros((nb, ng * 32), np.int32)
    for b in prange(nb):
        for g in range(ng):
            for h in range(2):
                for k in range(4 * h, 4 * h + 4):
                    for r in range(LANES):
                        o = 512 * g + 64 * k + 4 * r
                        bs[b, 32 * g + 16 * h + r] += xi[b, o] + xi[b, o + 1] + xi[b, o + 2] + xi[b, o + 3]
    return bs


@njit(**EXACT_PAR)
def prepared_sums(qt, xi):
    """The activations' integer sums the super-block products take, per lane: (ps, ss). ps
    [blocks, pairs * 16] int32: the sums the offsets multiply as int16 pairs (pairs_dot16's
    operand; Q4_K's per group, Q6_K's per 16-value half), word [p, r] = sums 2p (low half) and
    2p + 1 of row r; ss [blocks, super-blocks * 16]: each super-block's whole sum (the bias's)."""
    bs = lane_sums(xi)  # [b, 32 g + 16 h + r]: per half
    nb, ng = xi.shape[0], xi.shape[1] // 512
    grouped = per_group(qt)
    pairs = ng // 2 if grouped else ng
    ps = np.empty((nb, pairs * LANES), np.int32)
    ss = np.zeros((nb, ng // 8 * LANES), np.int32)
    for b in prange(nb):
        for p in range(pairs):
            for r in range(LANES):
                if grouped:  # groups 2p, 2p + 1: each the sum of its halves
                    lo = bs[b, 64 * p + r] + bs[b, 64 * p + 16 + r]
                    hi = bs[b, 64 * p + 32 + r] + bs[b, 64 * p + 48 + r]
                else:  # halves 2p, 2p + 1: group p's
                    lo, hi = bs[b, 32 * p + r], bs[b, 32 * p + 16 + r]
                ps[b, LANES * p + r] = (lo & 0xFFFF) | (hi << 16)
        for g in range(ng):
            for r in range(LANES):
                ss[b, LANES * (g // 8) + r] += bs[b, 32 * g + r] + bs[b, 32 * g + 16 + r]
    return ps, ss


def min_pairs(qt, ms, mp, rows):
    """Each row's offset factors (ms, per half) as int16 pairs in prepared_sums' order, into mp."""


@overload(min_pairs, inline="always")
def _min_pairs(qt, ms, mp, rows):
    step = 4 if qt.qname == "Q4_K" else 2  # halves per pair: Q4_K's halves share their factor

    def impl(qt, ms, mp, rows):
        for r in range(rows):
            for p in range(mp.shape[1]):
                lo, hi = ms[r, step * p], ms[r, step * p + step // 2]
                mp[r, p] = (lo & 0xFFFF) | (hi << 16)

    return impl


@njit(**EXACT_PAR)
def matmul_super_amx(qt, xi, dxv, ps, ss, ws, packs, offs, out):
    """superblock.matmul_rows for lanes_inputs(qt, x, 16)'s blocks xi and their prepared_sums (ps,
    ss) (out [16 * blocks, outputs]), on AMX tiles. Each work chunk's weight rows (up to 16:
    one tile's) are decoded once; then a super-block at a time passes over every block (its
    weight tiles stay in L1; block by super-block reread them from L2: slower)."""
    nb, ng = xi.shape[0], xi.shape[1] // 512
    nsb = ng // 8
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        tile_config(_config())
        i, n0, n1, col = chunk(ws, offs, counts, c)
        p = packs[i]
        base = (n0 // LANES) * p.shape[1]  # the packed row group's first byte
        rows = n1 - n0
        ad = np.zeros((nsb, 2, 4, LANES, 64), np.uint8)  # rows past the chunk's stay zero
        ms = np.empty((CHUNK, 2 * ng), np.int32)
        for n in range(n0, n1):
            _decode(qt, p, base, nsb, n - n0, ad, ms[n - n0])
        mp = np.empty((CHUNK, ps.shape[1] // LANES), np.int32)
        min_pairs(qt, ms, mp, rows)
        cbuf = np.empty(512, np.int32)
        acc, low = np.zeros((nb, LANES * CHUNK), np.float32), np.zeros((nb, LANES * CHUNK), np.float32)
        for sb in range(nsb):  # each block's steps stay in super-block order; sb's weight tiles stay in L1
            for b in range(nb):
                _dots(ad, sb, xi[b], cbuf)
                dx = load16(dxv[b], 128 * sb)
                _rows(qt, p, base, sb, rows, cbuf, ps[b], ss[b], dx, mp, acc[b], low[b])
        vb, tb = np.empty(LANES * CHUNK, np.float32), np.empty(LANES * CHUNK, np.float32)
        for b in range(nb):
            for r in range(rows):
                fstore(vb, 16 * r, fsub(load16(acc[b], 16 * r), load16(low[b], 16 * r)))
            transpose16(vb, tb)  # out's rows are tokens: each takes the chunk's outputs in one store
            for t in range(LANES):
                out[b * LANES + t, col + n0 : col + n1] = tb[LANES * t : LANES * t + rows]
        tile_release()
