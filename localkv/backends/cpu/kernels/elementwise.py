"""Fused element-wise kernels: one pass where numpy makes several (and temporaries), for
prefill's memory-bound steps (RMSNorm, RoPE, SwiGLU: single-threaded), the rotation of
quantized K/V's rows (kv/rotation: parallel over the tokens) and their quantization as they are
written (kv_format.encode's arithmetic, value for value: numpy's takes a dozen array passes, a
decode step's cost on every layer)."""

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from localkv import kv_format
from localkv.backends.cpu.kernels import EXACT, EXACT_PAR, SER, self_check
from localkv.backends.cpu.kernels.attention import exp
from localkv.backends.cpu.simd.f32x8 import fadd, fload, fstore, fsub
from localkv.backends.cpu.simd.u8x32 import as_half, half_bits
from localkv.backends.cpu.simd.x16 import fit_error32, store_codes32
from localkv.kv_format import DIVISORS, Q4_0_BYTES, Q8_0_BYTES, QK

# frozen into the kernels as constants (kv_format.fit's tables)
_Q8_DIVISORS, _Q4_DIVISORS = DIVISORS["q8_0"], DIVISORS["q4_0"]


@njit(**SER)
def rmsnorm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, row by row."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        r = np.float32(1.0 / np.sqrt(ss / D + eps))
        for d in range(D):
            out[t, d] = x[t, d] * r * w[d]


@njit(**SER)
def silu_mul(gu, f, out, by_rows):
    """out = silu(gate) * up, one pass where numpy makes five. gu (C-contiguous) holds gate then
    up: along its rows when by_rows (a prefill pass's transposed [2f, T] matmul output; out
    [f, T]), else along each row ([T, 2f]; out [T, f]). sigmoid from exp(-|gate|): the
    vectorising exp takes x <= 0."""
    dr, dc = (f, 0) if by_rows else (0, f)  # up's offset from gate: the C-contiguous array is
    R, C = out.shape  # indexed as it is, so the inner loop runs on vectors
    one = np.float32(1)
    for r in range(R):
        for c in range(C):
            a = gu[r, c]
            e = exp(-abs(a))
            s = one / (one + e)
            out[r, c] = a * (s if a >= 0 else e * s) * gu[r + dr, c + dc]


@register_jitable
def _rotate(x, t, j, i0, i1, c, s):
    a, b = x[t, j, i0], x[t, j, i1]
    x[t, j, i0] = a * c - b * s
    x[t, j, i1] = b * c + a * s


@register_jitable
def _rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the halves (i, i + hd/2) (NEOX)
    or the adjacent pairs (2i, 2i+1) (llama.cpp's "normal" order). x may be a view of a
    prefill pass's transposed matmul output, tokens adjacent in memory: the loops then run
    along the tokens (along the head dimension, every element was a cache line of its own)."""
    T, n_heads, hd = x.shape
    half = hd // 2
    if x.strides[0] < x.strides[2]:
        for j in range(n_heads):
            for i in range(half):
                i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                for t in range(T):
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])
    else:
        for t in range(T):
            for j in range(n_heads):
                for i in range(half):
                    i0, i1 = (2 * i, 2 * i + 1) if pairs else (i, i + half)
                    _rotate(x, t, j, i0, i1, cos[t, i], sin[t, i])


@njit(**EXACT)  # each float op as written: rope_turn_store gives a decode step's rows its bits
def rope(x, cos, sin, pairs):
    """Rotate x [T, heads, hd] in place by cos/sin [T, hd/2]: the adjacent pairs (2i, 2i+1)
    (llama.cpp's "normal" order) when pairs, else the halves (NEOX order). One kernel for both
    orders: each compiled kernel costs a start its own cache load."""
    _rope(x, cos, sin, pairs)


@njit(**EXACT)
def rope_turn_store(qkv, cos, sin, pairs, kvh, signs, n, scale, t0, t1, slots, krows, vrows, kq4, vq4):
    """A decode step's few rows of qkv [T, H + 2 kvh, hd] after their projection, in one call
    where there were four: RoPE on the q and k heads (rope's), the heads t0 .. t1 - 1 turned in
    place (hadamard_few's, for a quantized pool: kv/rotation), then K and V written to their
    pool rows at slots (encode_rows's bytes; krows, vrows: the layers' rows as uint8, kq4, vq4:
    each q4_0 or q8_0). The same functions in the same order as those kernels, so their bits;
    why: each call of a decode step costs several microseconds on a layer's path."""
    T, heads, hd = qkv.shape
    H = heads - 2 * kvh
    _rope(qkv[:, : H + kvh], cos, sin, pairs)
    if t1 > t0:
        turn = qkv[:, t0:t1]
        for gi in range(-(-(T * (t1 - t0)) // 8)):  # a group's rows are read before it writes them
            _hadamard_group(turn, signs, n, scale, False, turn, gi)
    for t in range(T):
        for side in range(2):  # one call site: the encoder is compiled once, not once a side
            _encode_token(qkv, slots, vrows if side else krows, vq4 if side else kq4, t, H + side * kvh, kvh)


@register_jitable
def _hadamard_group(x, signs, n, scale, undo, out, gi):
    """Rows gi * 8 ... of hadamard_rows, one per vector lane."""
    T, heads, d = x.shape
    R = T * heads
    buf = np.empty((d, 8), np.float32)  # [value, row]
    for lane in range(8):
        r = min(gi * 8 + lane, R - 1)  # a last group short of 8 repeats its last row
        t, hh = r // heads, r % heads
        for i in range(d):
            buf[i, lane] = x[t, hh, i] if undo else x[t, hh, i] * signs[i]
    for b0 in range(0, d, n):
        h = 1
        while h < n:
            for g in range(b0, b0 + n, 2 * h):
                for j in range(g, g + h):
                    a, c = fload(buf, j * 8), fload(buf, (j + h) * 8)
                    fstore(buf, j * 8, fadd(a, c))
                    fstore(buf, (j + h) * 8, fsub(a, c))
            h *= 2
    for lane in range(min(8, R - gi * 8)):
        t, hh = (gi * 8 + lane) // heads, (gi * 8 + lane) % heads
        for i in range(d):
            out[t, hh, i] = buf[i, lane] * scale * signs[i] if undo else buf[i, lane] * scale


@njit(**EXACT_PAR)
def hadamard_rows(x, signs, n, scale, undo, out):
    """out = M x for rows x [T, heads, hd] (compiled.hadamard passes them contiguous), or M^T x when undo:
    kv/rotation's transform, the same butterflies in the same order (each float op as written),
    so its bits. Eight rows at a time, one per vector lane, so that every butterfly is one
    vector add and one subtract; the groups of eight in parallel."""
    T, heads, d = x.shape
    for gi in prange(-(-(T * heads) // 8)):
        _hadamard_group(x, signs, n, scale, undo, out, gi)


@njit(**EXACT)
def hadamard_few(x, signs, n, scale, undo, out):
    """hadamard_rows on the calling thread, group by group (the same bits): for a decode step's
    few rows, where starting the parallel workers costs more than the rows."""
    T, heads, d = x.shape
    for gi in range(-(-(T * heads) // 8)):
        _hadamard_group(x, signs, n, scale, undo, out, gi)


@self_check("base", cost=1.3)
def check() -> bool:
    """The kernels for the array kinds the model passes (a read-only norm weight, a strided qkv
    view, both layouts of SwiGLU's input) against numpy."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    w.flags.writeable = False
    out = np.empty_like(x)
    rmsnorm(x, w, 1e-5, out)
    ok = np.allclose(out, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * w, rtol=1e-4, atol=1e-5)
    qkv = rng.standard_normal((2, 3, 4), dtype=np.float32)
    cos, sin = np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)
    want = qkv.copy()
    for x in (qkv[:, :2], qkv[:1, :2]):  # many rows: a strided view; one (a decode step): contiguous
        for pairs in (False, True):
            rope(x, cos[: len(x)], sin[: len(x)], pairs)  # angle 0: unchanged
    gu = rng.standard_normal((3, 16), dtype=np.float32) * 20  # past exp's range both ways
    g, u = gu[:, :8].astype(np.float64), gu[:, 8:]
    act = g / (1 + np.exp(-g)) * u
    for by_rows in (False, True):  # a decode step's [T, 2f] and a prefill pass's transposed [2f, T]
        got = np.empty((8, 3) if by_rows else (3, 8), np.float32)
        silu_mul(np.ascontiguousarray(gu.T) if by_rows else gu, 8, got, by_rows)
        ok = ok and np.allclose(got.T if by_rows else got, act, rtol=1e-5, atol=1e-6)
    return ok and np.array_equal(qkv, want)


@self_check("kv", cost=5.8)  # a quantized pool's (a float pool's compiles nothing)
def check_pool_rows(k_fmt: str, v_fmt: str) -> bool:
    """A quantized K or V's rows quantized as they are written (kv_format.encode's bytes), and
    rotated first (kv/rotation: only a quantized pool's rows turn)."""
    rng = np.random.default_rng(0)
    ok = True
    x = rng.standard_normal((3, 2, 64), dtype=np.float32)  # [tokens, kv heads, head dim]
    slots = np.array([4, 0, 7], np.int64)
    quantized = {f for f in (kv_format.FORMATS[k_fmt], kv_format.FORMATS[v_fmt]) if f.quantized}
    for fmt in quantized:
        want = kv_format.encode(x, fmt).view(np.uint8)
        for kernel in (encode_rows, encode_rows_par):  # a decode step's, a prefill pass's
            rows = np.zeros((8 * 2, fmt.row_bytes(64)), np.uint8)  # a layer of 8 slots' rows
            kernel(x, slots, rows, fmt is kv_format.Q4_0)
            ok = ok and np.array_equal(rows.reshape(8, 2, -1)[slots], want)
    kf, vf = kv_format.FORMATS[k_fmt], kv_format.FORMATS[v_fmt]
    if kf.quantized and vf.quantized:  # the pools a decode step writes with rope_turn_store
        ok = ok and _fused_ok(rng, kf, vf)
    return ok and (not quantized or _hadamard_ok(rng))


def _fused_ok(rng, kf, vf) -> bool:
    """rope_turn_store against numpy's RoPE, rotation and encoder (each float op as written,
    the same bits as the kernels, which their own checks hold): the same q rows and the same
    K/V bytes (two tokens, 2 q and 1 kv heads, every head turned). numpy's, so that this check
    compiles nothing but the kernel."""
    from localkv.kv.rotation import Rotation

    qkv = rng.standard_normal((2, 4, 64), dtype=np.float32)
    cos, sin = rng.standard_normal((2, 32), dtype=np.float32), rng.standard_normal((2, 32), dtype=np.float32)
    rot = Rotation.for_formats(True, True, 64)
    slots = np.array([3, 1], np.int64)
    want = qkv.copy()
    x1, x2 = want[:, :3, :32].copy(), want[:, :3, 32:].copy()  # NEOX halves
    c, s = cos[:, None, :], sin[:, None, :]
    want[:, :3, :32], want[:, :3, 32:] = x1 * c - x2 * s, x2 * c + x1 * s
    want = rot.apply(want)
    rows = [np.zeros((4, f.row_bytes(64)), np.uint8) for f in (kf, vf)]
    args = (1, rot.signs, rot.block, rot.scale, 0, 4, slots, *rows, kf is kv_format.Q4_0, vf is kv_format.Q4_0)
    rope_turn_store(qkv, cos, sin, False, *args)
    ok = np.array_equal(qkv, want)
    for f, got, head in ((kf, rows[0], 2), (vf, rows[1], 3)):
        ok = ok and np.array_equal(got[slots], kv_format.encode(want[:, head], f).view(np.uint8))
    return ok


def _hadamard_ok(rng) -> bool:
    """Both rotation kernels on contiguous rows (compiled.hadamard passes no other): M e_0 is
    the first sign times the scale everywhere, and undo turns a row back."""
    signs = np.where(rng.random(16) < 0.5, -1.0, 1.0).astype(np.float32)
    rows = np.zeros((9, 2, 16), np.float32)
    rows[:, :, 0] = 1
    ok = True
    for kernel in (hadamard_rows, hadamard_few):
        turned = np.empty((9, 2, 16), np.float32)
        kernel(rows, signs, 16, np.float32(0.25), False, turned)
        back = np.empty_like(turned)
        kernel(turned, signs, 16, np.float32(0.25), True, back)
        ok = ok and bool((turned == signs[0] * np.float32(0.25)).all()) and np.allclose(back, rows, atol=1e-6)
    return ok


@njit(**EXACT)  # each float op as written: fast-math would turn x / 127 into x * (1 / 127)
def encode_rows(x, slots, pool, q4):
    """pool (a layer's rows as uint8 [blocks * bs * kvh, row bytes]) at the rows of slots [T]
    and every kv head = x [T, kvh, hd] in q8_0 (q4 False) or q4_0, as kv_format.encode writes
    them: the same scale, the same rounding of each value."""
    for t in range(x.shape[0]):
        _encode_token(x, slots, pool, q4, t, 0, x.shape[1])


@njit(**EXACT_PAR)
def encode_rows_par(x, slots, pool, q4):
    """encode_rows with the tokens shared out over the threads (a prefill pass's): the same bytes."""
    for t in prange(x.shape[0]):
        _encode_token(x, slots, pool, q4, t, 0, x.shape[1])


@register_jitable
def _encode_token(x, slots, pool, q4, t, h0, kvh):
    """Token t's heads h0 .. h0 + kvh - 1 of x [T, heads, hd] (C-contiguous: the blocks are
    read at flat offsets) into the pool rows of slots[t]."""
    hd = x.shape[2]
    for h in range(h0, h0 + kvh):
        row = slots[t] * kvh + h - h0
        for b in range(hd // QK):
            if q4:
                _q4_0(x, t, h, b * QK, pool, row, b * Q4_0_BYTES)
            else:
                _q8_0(x, t, h, b * QK, pool, row, b * Q8_0_BYTES)


@register_jitable
def _inverse(d):
    return np.float32(1) / d if d != 0 else np.float32(0)


@register_jitable
def _scale(pool, row, at, d):
    bits = half_bits(d)
    pool[row, at], pool[row, at + 1] = bits & 0xFF, bits >> 8


@register_jitable
def _fit(x, base, ref, q4):
    """kv_format.fit's scale of the block at x's flat offset base (ref: its reference value):
    every divisor tried in order, its codes and their stored error 16 values a step
    (x16.fit_error32: the same operations in the same order), the first least error kept."""
    divisors = _Q4_DIVISORS if q4 else _Q8_DIVISORS
    best_d, best_err = np.float32(0), np.float32(0)
    for k in range(len(divisors)):
        d = ref / divisors[k]
        stored = as_half(d)
        if q4:
            err = fit_error32(x, base, _inverse(stored), stored, True)
        else:
            err = fit_error32(x, base, _inverse(stored), stored, False)
        if k == 0 or err < best_err:
            best_d, best_err = d, err
    return best_d


@register_jitable
def _q8_0(x, t, h, d0, pool, row, at):
    """One block: d = max |x| / c for the divisor c that fits it best (_fit), each value over
    f16(d) rounded halves away from zero."""
    top = np.float32(0)
    for i in range(QK):
        top = max(top, abs(x[t, h, d0 + i]))
    base = (t * x.shape[1] + h) * x.shape[2] + d0
    d = _fit(x, base, top, False)
    store_codes32(x, base, _inverse(as_half(d)), False, pool, row * pool.shape[1] + at + 2)
    _scale(pool, row, at, d)


@register_jitable
def _q4_0(x, t, h, d0, pool, row, at):
    """One block: d = the value of largest magnitude (the first such, sign kept) / c for the
    divisor c that fits it best (_fit); each value to trunc(x / f16(d) + 8.5) in [0, 15], value i
    < 16 in byte i's low nibble, i + 16 its high."""
    best, top = 0, abs(x[t, h, d0])
    for i in range(1, QK):
        if abs(x[t, h, d0 + i]) > top:
            best, top = i, abs(x[t, h, d0 + i])
    base = (t * x.shape[1] + h) * x.shape[2] + d0
    d = _fit(x, base, x[t, h, d0 + best], True)
    store_codes32(x, base, _inverse(as_half(d)), True, pool, row * pool.shape[1] + at + 2)
    _scale(pool, row, at, d)
