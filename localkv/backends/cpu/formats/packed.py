"""Weights repacked for the 16-lane kernels that take a few activation rows: 16 weight rows
interleaved per block, so that a 64-byte load holds 4 bytes of each of 16 rows and one
vpdpbusd multiplies them with 4 broadcast activations, the outputs in the lanes. The sums
need no horizontal reduction, and the scales of 16 rows load as one vector. Q4_K and Q6_K
(kernels/superblock_packed: every pass; their 6-bit scales unpacked once, here), and the
32-value types Q4_0, Q4_1 and Q8_0 (kernels/matmul_packed: a decode step's few rows).

A weight of R rows becomes uint8 [ceil(R / 16), blocks * GROUP_BYTES[type]]: row group g,
block b at byte b * GROUP_BYTES of row g. Rows past R are zero (their outputs are never
written). Within a group's block, n = the row in the group (0..15):

    Q4_K (2368 bytes)                       Q6_K (3360 bytes)
    0     qs dword k of row n at 64k + 4n   0     ql dword k of row n at 64k + 4n
    2048  scales j, j+1 at 32(j/2) + 2n     2048  qh dword k of row n at 64k + 4n
    2176  mins   j, j+1 at 32(j/2) + 2n     3072  scales k, k+1 (int8) at 32(k/2) + 2n
    2304  d (fp16) of row n at 2n           3328  d (fp16) of row n at 2n
    2336  dmin (fp16) of row n at 2n

    Q4_0 (288 bytes)                  Q4_1 (320 bytes)                  Q8_0 (544 bytes)
    0    qs dword k of row n at       0    qs dword k at 64k + 4n       0    u = q + 128 (the
         64k + 4n                     256  d (fp16) of row n at 2n           kernels' unsigned
    256  d (fp16) of row n at 2n      288  m (fp16) of row n at 2n           byte) dword k at
                                                                             64k + 4n
                                                                        512  d (fp16) at 2n

The bytes of a row are the file's (qs, ql, qh keep their nibble and bit order; see formats;
Q8_0's bytes xor 128), so the integers a block gives are the same whichever layout they are
read from. The scales and mins in pairs are int16 pairs once widened: vpdpwssd's operand.
"""

import numpy as np

from localkv.backends.cpu.formats.types import block_size

GROUP = 16  # weight rows interleaved
GROUP_BYTES = {"Q4_K": 2368, "Q6_K": 3360, "Q4_0": 288, "Q4_1": 320, "Q8_0": 544}
TYPES = tuple(GROUP_BYTES)
FORMAT = "p1"  # this layout's name: a changed layout must get a new one (it keys the files on disk)
_SLICE = 512  # row groups packed at a time: bounds the temporary arrays
# the file's blocks as records (numpy reads the unaligned fields in place)
_BLOCKS = {
    "Q4_K": np.dtype({"names": ["d", "dmin", "scales", "qs"], "formats": ["<u2", "<u2", ("u1", 12), ("<u4", 32)],
                      "offsets": [0, 2, 4, 16], "itemsize": 144}),
    "Q6_K": np.dtype({"names": ["ql", "qh", "scales", "d"], "formats": [("<u4", 32), ("<u4", 16), ("<u2", 8), "<u2"],
                      "offsets": [0, 128, 192, 208], "itemsize": 210}),
    "Q4_0": np.dtype({"names": ["d", "qs"], "formats": ["<u2", ("<u4", 4)], "offsets": [0, 2], "itemsize": 18}),
    "Q4_1": np.dtype({"names": ["d", "m", "qs"], "formats": ["<u2", "<u2", ("<u4", 4)], "offsets": [0, 2, 4],
                      "itemsize": 20}),
    "Q8_0": np.dtype({"names": ["d", "qs"], "formats": ["<u2", ("<u4", 8)], "offsets": [0, 2], "itemsize": 34}),
}  # fmt: skip


def packed_shape(qtype: str, rows: int, cols: int) -> tuple[int, int]:
    """The shape of the packed form of a [rows, cols] weight."""
    return -(-rows // GROUP), cols // block_size(qtype)[0] * GROUP_BYTES[qtype]


def pack(qtype: str, data: np.ndarray) -> np.ndarray:
    """The packed form of a weight's blocks data (uint8 [rows, row bytes], the file's)."""
    if qtype not in GROUP_BYTES:
        raise ValueError(f"no packed form of {qtype} weights (only {', '.join(TYPES)})")
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).view(_BLOCKS[qtype])  # [rows, super-blocks]
    nb, gb = blocks.shape[1], GROUP_BYTES[qtype]
    groups = -(-rows // GROUP)
    out = np.empty((groups, nb * gb), np.uint8)
    fill = _FILL[qtype]
    for g0 in range(0, groups, _SLICE):
        g1 = min(groups, g0 + _SLICE)
        part = blocks[g0 * GROUP : g1 * GROUP]
        if len(part) < (g1 - g0) * GROUP:  # the last group's missing rows: zero
            part = np.concatenate([part, np.zeros((g1 - g0) * GROUP - len(part), part.dtype)[:, None].repeat(nb, 1)])
        fill(part.reshape(g1 - g0, GROUP, nb), out[g0:g1].reshape(g1 - g0, nb, gb))
    return out


def _lanes(field: np.ndarray) -> np.ndarray:
    """A per-row field [g, n, sb, k] as [g, sb, k, n]: item k of row n at k * 16 + n."""
    return field.transpose(0, 2, 3, 1)


def _put(out: np.ndarray, at: int, v: np.ndarray):
    """out[..., at:] = v's items as bytes (v [g, sb, ...] of any unsigned dtype)."""
    flat = np.ascontiguousarray(v).reshape(*v.shape[:2], -1)
    out[..., at : at + flat.shape[2] * flat.itemsize] = flat.view(np.uint8)


def _pairs(v: np.ndarray) -> np.ndarray:
    """Per-row bytes [g, n, sb, k] (k even) as pairs: k, k+1 of row n at 32(k/2) + 2n."""
    g, n, nb, k = v.shape
    return v.reshape(g, n, nb, k // 2, 2).view(np.uint16)[..., 0].transpose(0, 2, 3, 1)


def _q4k(b: np.ndarray, out: np.ndarray):
    _put(out, 0, _lanes(b["qs"]))
    q = b["scales"]
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    _put(out, 2048, _pairs(sc))
    _put(out, 2176, _pairs(mn))
    _put(out, 2304, b["d"].transpose(0, 2, 1))
    _put(out, 2336, b["dmin"].transpose(0, 2, 1))


def _q6k(b: np.ndarray, out: np.ndarray):
    _put(out, 0, _lanes(b["ql"]))
    _put(out, 2048, _lanes(b["qh"]))
    _put(out, 3072, _lanes(b["scales"]))
    _put(out, 3328, b["d"].transpose(0, 2, 1))


def _q4(b: np.ndarray, out: np.ndarray):
    _put(out, 0, _lanes(b["qs"]))
    _put(out, 256, b["d"].transpose(0, 2, 1))
    if "m" in b.dtype.names:
        _put(out, 288, b["m"].transpose(0, 2, 1))


def _q8_0(b: np.ndarray, out: np.ndarray):
    _put(out, 0, _lanes(b["qs"] ^ np.uint32(0x80808080)))
    _put(out, 512, b["d"].transpose(0, 2, 1))


_FILL = {"Q4_K": _q4k, "Q6_K": _q6k, "Q4_0": _q4, "Q4_1": _q4, "Q8_0": _q8_0}
