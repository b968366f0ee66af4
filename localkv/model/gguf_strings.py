"""Decode a GGUF array of length-prefixed UTF-8 strings (a tokenizer's tokens and merges).

Decoding strings one by one costs a Python call each, and tokenizers store ~100k of them. Only
the walk over the length prefixes must be sequential; the decoding is done once for the whole
array: each 8-byte prefix becomes a NUL separator (first byte) plus seven 0xFF marker bytes,
the markers are deleted, and one decode + split yields every string. 0xFF never occurs in valid
UTF-8, so a marker cannot be confused with content; an array whose strings hold NUL or 0xFF,
or fail to decode, falls back to one decode per string, which also names the bad string.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from localkv.errors import ModelError

_U64 = struct.Struct("<Q")
JOINED_MIN = 64  # below this the per-string path is as fast and allocates less


def read_string_array(buf, pos: int, count: int, fail: Callable[[str], ModelError]) -> tuple[list[str], int]:
    """The `count` strings starting at byte `pos` of `buf`, and the position after them.

    The caller has checked that `count` prefixes fit in the buffer, so `starts` is bounded by its size.
    """
    starts = [0] * count
    unpack = _U64.unpack_from
    p, i = pos, 0
    try:
        for i in range(count):
            starts[i] = p
            p += 8 + unpack(buf, p)[0]
    except (struct.error, OverflowError):  # a length sent the walk past the end of the buffer
        raise fail(
            f"string #{i} of {count} starts past the end of the file: the file is truncated or corrupt; re-download it"
        ) from None
    if p > len(buf):
        raise fail(
            f"string #{count - 1} of {count} runs past the end of the file: the file is truncated or "
            "corrupt; re-download it"
        )
    strings = _decode_joined(buf, pos, p, starts) if count >= JOINED_MIN else None
    if strings is None:
        strings = _decode_each(buf, starts, p, fail)
    return strings, p


def _decode_joined(buf, pos: int, end: int, starts: list[int]) -> list[str] | None:
    count = len(starts)
    region = np.frombuffer(buf, np.uint8, end - pos, pos).copy()
    rel = np.array(starts, dtype=np.intp) - pos
    region[rel] = 0
    for k in range(1, 8):
        region[rel + k] = 0xFF
    joined = region.tobytes()
    del region
    kept = joined.translate(None, b"\xff")
    if len(kept) != len(joined) - 7 * count:
        return None  # some string holds 0xFF itself
    try:
        parts = kept.decode("utf-8").split("\0")
    except UnicodeDecodeError:
        return None
    if len(parts) != count + 1:
        return None  # some string holds NUL itself
    del parts[0]
    return parts


def _decode_each(buf, starts: list[int], end: int, fail: Callable[[str], ModelError]) -> list[str]:
    out: list[str] = []
    for i, (s, e) in enumerate(zip(starts, [*starts[1:], end])):
        try:
            out.append(str(buf[s + 8 : e], "utf-8"))
        except UnicodeDecodeError:
            raise fail(f"string #{i} is not valid UTF-8: the file is corrupt") from None
    return out
