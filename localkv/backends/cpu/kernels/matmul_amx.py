"""matmul_wide (the 16-row lanes kernel) for the types of one scale per group (activation
group 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with its integer products on Intel AMX's int8 tiles:
the same bits for every row.

Why: a prefill pass is mostly these products, and matmul_wide pays per weight row and group
8 vpdpbusd, each with a broadcast of 4 weights. One tdpbusd instead multiplies 16 weight rows
by 16 activation rows over a whole group (the one integer matmul_few.group_step scales for
these types): a work chunk's weights are decoded once into bytes (`_decode`: each group's u,
as formats.group gives it, and its scales), then per block of activation rows one tile
product a group goes to memory and each weight row walks the products in group_step's float
ops and walk's order (matmul_few.walk_from), so lane r gets the sums matmul_wide
gives it: equal bits (tests/backends/test_matmul_wide.py). lanes_inputs(qt, x, 16)'s blocks
are already the B tiles' layout (4 bytes of each of 16 rows per 64-byte tile row).

The decode is paid once per call, so a pass of one block (a verify pass) gains nothing:
quant.compiled.every_row gives it passes of AMX_LANE_ROWS rows or more where superblock_amx
is chosen (AMX-INT8, the tile state granted; LOCALKV_AMX=0 turns both off).
"""

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from localkv.backends.cpu.formats.blocks import geometry, group
from localkv.backends.cpu.kernels import EXACT_PAR
from localkv.backends.cpu.kernels.matmul_few import CHUNK, PREFETCH, chunk, chunks, one_scale_step, walk_from
from localkv.backends.cpu.kernels.matmul_wide import transpose16
from localkv.backends.cpu.numba_hooks import NO_NRT
from localkv.backends.cpu.simd.amx import tile_config, tile_dot_u8i8, tile_load, tile_release, tile_store, tile_zero
from localkv.backends.cpu.simd.f32x8 import fadd, fstore
from localkv.backends.cpu.simd.u8x32 import prefetch, store32
from localkv.backends.cpu.simd.x16 import iload16, load16, splat16, zero16

LANES = 16  # activation rows per block, and weight rows per tile


@register_jitable
def _config():
    """Palette 1: tile 0 a group's products (16 weight rows x 16 activation rows, int32), 1
    its weights (16 rows of 32 bytes), 2 its activations (8 rows of 64 bytes: 4 values of
    each of 16 rows per tile row)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (colsb, rows) in enumerate(((64, 16), (32, 16), (64, 8))):
        cfg[16 + 2 * t] = colsb
        cfg[48 + t] = rows
    return cfg


@register_jitable(**NO_NRT)
def _decode(qt, w, n, ng, i, ub, sc):
    """Weight row n of w as the tiles and the walk take it: group g's 32 values u at ub[g, i],
    its scale and offset at sc[i, g]."""
    groups, nbytes = geometry(qt)
    base = n * w.shape[1]
    u8 = ub.reshape(-1)
    for g in range(ng):
        blk = base + (g // groups) * nbytes
        prefetch(w, blk + PREFETCH)
        u, sa, _, ma, _ = group(qt, w, blk, g % groups)
        store32(u8, 512 * g + 32 * i, u)
        sc[i, g, 0], sc[i, g, 1] = sa, ma


@register_jitable(**NO_NRT)
def _products(ub, xb, ng, cbuf):
    """Every group's integer dots, 16 weight rows x 16 activation rows (xb: one block of
    lanes_inputs(qt, x, 16)'s xi), into cbuf [group][weight row][lane]."""
    u8 = ub.reshape(-1)
    for g in range(ng):
        tile_zero(0)
        tile_load(1, u8, 512 * g, 32)
        tile_load(2, xb, 512 * g, 64)
        tile_dot_u8i8(0, 1, 2)
        tile_store(0, cbuf, 256 * g, 64)


@register_jitable(**NO_NRT)
def _step(qt, w, blk, j, g, inp, a, m):
    """matmul_few.walk_from's step over the products (inp: cbuf, the scales sc, the weight row
    i, the block's dxv and xsa; w, blk, j: the file's, unused): group g's group_step."""
    cbuf, sc, i, dxv, xsa = inp
    return one_scale_step(iload16(cbuf, 256 * g + 16 * i), splat16(sc[i, g, 0]), splat16(sc[i, g, 1]),
                          load16(dxv, 16 * g), load16(xsa, 16 * g), a, m)  # fmt: skip


@register_jitable(**NO_NRT)
def _walk(qt, w, cbuf, sc, i, ng, dxv, xsa):
    """Weight row i's 16 lanes: walk's order and sum over the products in cbuf."""
    a0, a1, m0, m1 = walk_from(_step, qt, w, 0, (cbuf, sc, i, dxv, xsa), ng, zero16())
    return fadd(fadd(a0, a1), fadd(m0, m1))


@njit(**EXACT_PAR)
def matmul_amx(qt, xi, dxv, xsa, xsb, ws, offs, out):
    """matmul_wide for lanes_inputs(qt, x, 16)'s blocks (out [16 * blocks, outputs]) on AMX
    tiles: row r's outputs are lane r % 16 of its block, matmul_lanes' bits. Each work chunk's
    weight rows (up to 16: one tile's) are decoded once, then every block passes over them.
    xsb: unread (offset_sums gives these types one offset sum per group)."""
    nb, ng = xi.shape[0], xi.shape[1] // 512
    counts = chunks(ws)
    for c in prange(counts[0] + counts[1] + counts[2]):
        tile_config(_config())
        i, n0, n1, col = chunk(ws, offs, counts, c)
        w, rows = ws[i], n1 - n0
        ub = np.zeros((ng, LANES, 32), np.uint8)  # rows past the chunk's stay zero
        sc = np.empty((CHUNK, ng, 2), np.float32)
        for n in range(n0, n1):
            _decode(qt, w, n, ng, n - n0, ub, sc)
        cbuf = np.empty(256 * ng, np.int32)
        vb, tb = np.empty(LANES * CHUNK, np.float32), np.empty(LANES * CHUNK, np.float32)
        for b in range(nb):
            _products(ub, xi[b], ng, cbuf)
            for r in range(rows):
                fstore(vb, LANES * r, _walk(qt, w, cbuf, sc, r, ng, dxv[b], xsa[b]))
            transpose16(vb, tb)  # out's rows are tokens: each takes the chunk's outputs in one store
            for t in range(LANES):
                out[b * LANES + t, col + n0 : col + n1] = tb[LANES * t : LANES * t + rows]
        tile_release()
