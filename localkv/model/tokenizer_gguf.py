"""A GGUF file's key/value metadata, read without gguf.GGUFReader.

The reader builds a numpy view per array element, so a Llama 3 vocabulary (128k tokens and
280k merges) takes it tens of seconds; this walks the same bytes once and returns what
`{key: field.contents()}` would. Tensor descriptions after the metadata are not read.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from localkv.errors import ModelError

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError("metadata runs past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", "replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        end = len(buf)
        for _ in range(count):
            n = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if pos + n > end:
                raise ValueError("a string runs past the end of the file")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype == _STRING:
                return self.strings(count)
            if etype in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[etype])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown value type {vtype}")


def read_metadata(path: str | Path) -> dict:
    """{key: value} of a GGUF's metadata; ModelError for a file that is not a readable GGUF."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(memoryview(mm))
            try:
                if bytes(cur.take(4)) != b"GGUF":
                    raise ModelError(f"{path} is not a GGUF file (bad magic bytes)")
                version = cur.scalar("I")
                if version < 2:
                    raise ModelError(f"{path}: GGUF version {version} is too old (re-convert the model)")
                cur.scalar("Q")  # tensor count
                meta = {}
                for _ in range(cur.scalar("Q")):
                    key = cur.string()
                    meta[key] = cur.value(cur.scalar("I"))
                return meta
            finally:
                cur.buf.release()
    except (OSError, ValueError, struct.error) as e:
        raise ModelError(f"cannot read GGUF metadata of {path}: {e}") from None
