"""A strict reader of GGUF model files over one read-only memory map.

Nothing in the file is trusted: every count, length, type and byte range is checked against the
bytes actually present before anything is allocated for it, and anything wrong ends in one
ModelError line. Tensor data is never copied: `data()` hands out read-only numpy views of the map,
still quantized (block types as uint8 rows). Metadata numeric arrays are views too; string arrays
are decoded in one pass (see gguf_strings.py) because tokenizers store ~100k of them.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv.errors import ModelError
from localkv.gguf_py import BY_NAME as _QTYPES_BY_NAME
from localkv.gguf_py import TYPES as _QTYPES  # ggml type id -> (name, elements per block, bytes per block)
from localkv.model.gguf_strings import read_string_array

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 1 had 32-bit counts; 3 only added big-endian files, which we refuse
DEFAULT_ALIGNMENT = 32
MAX_KEY_BYTES = 65535  # GGUF spec limit for metadata keys
MAX_NAME_BYTES = 64  # GGUF spec limit for tensor names (ggml's GGML_MAX_NAME)
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4
# Strings and nested arrays become Python objects several times their size in the file: cap one
# array's entries so a hostile file cannot make us allocate many GB (real vocabularies hold <= ~260k).
MAX_OBJECT_ARRAY = 1 << 22
INT64_MAX = (1 << 63) - 1
HEADER_BYTES = 24  # magic, version u32, tensor count u64, kv count u64
MIN_KV_BYTES = 13  # key length u64 + value type u32 + a 1-byte value
MIN_TENSOR_BYTES = 33  # name length u64 + 1-byte name + n_dims u32 + one dim u64 + type u32 + offset u64

# GGUF value type id -> (name, struct format, numpy dtype); 8 = string, 9 = array
_SCALARS = {
    0: ("uint8", "<B", "u1"),
    1: ("int8", "<b", "i1"),
    2: ("uint16", "<H", "<u2"),
    3: ("int16", "<h", "<i2"),
    4: ("uint32", "<I", "<u4"),
    5: ("int32", "<i", "<i4"),
    6: ("float32", "<f", "<f4"),
    7: ("bool", "<B", "u1"),
    10: ("uint64", "<Q", "<u8"),
    11: ("int64", "<q", "<i8"),
    12: ("float64", "<d", "<f8"),
}
_STRUCTS = {t: struct.Struct(fmt) for t, (_, fmt, _) in _SCALARS.items()}
STRING, ARRAY, BOOL, UINT32 = 8, 9, 7, 4
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# types that data() returns typed, in their numpy dtype; every other type is uint8 blocks
PLAIN_DTYPES = {
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "F64": "<f8",
    "I8": "i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: str  # ggml type name, e.g. "Q4_K", "F32"
    shape: tuple[int, ...]  # numpy order (rows, cols): ggml's ne reversed
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        _, block, size = _QTYPES_BY_NAME[self.qtype]
        return self.shape[-1] // block * size


@dataclass(eq=False, slots=True)
class GGUFFile:
    path: Path
    version: int
    alignment: int
    file_size: int
    meta: dict[str, object] = field(repr=False)
    tensors: dict[str, TensorInfo] = field(repr=False)
    _mm: mmap.mmap | None = field(repr=False)

    def data(self, name: str) -> np.ndarray:
        """A read-only view of one tensor's bytes in the map (typed for plain types, uint8 rows for blocks)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelError(
                f"{self.path.name}: the model has no tensor {name!r}; the file is incomplete or not "
                "the architecture it claims"
            )
        if self._mm is None:
            raise RuntimeError(f"{self.path.name} is closed: data() after close() is a bug in the caller")
        dtype = PLAIN_DTYPES.get(info.qtype)
        if dtype is not None:
            count = info.nbytes // np.dtype(dtype).itemsize
            return np.frombuffer(self._mm, dtype, count, info.offset).reshape(info.shape)
        rows = info.nbytes // info.row_bytes
        return np.frombuffer(self._mm, np.uint8, info.nbytes, info.offset).reshape(rows, info.row_bytes)

    def close(self) -> None:
        """Drop the map; views already handed out (data(), metadata arrays) keep it alive until they go."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_gguf(path: Path | str) -> GGUFFile:
    path = Path(path)
    mm = _map_file(path)
    try:
        return _Parser(mm, path).parse()
    except ModelError:
        mm.close()  # the parser creates no views before it succeeds, so nothing holds the map
        raise


def _map_file(path: Path) -> mmap.mmap:
    try:
        # O_NONBLOCK: a FIFO given as the model must fail below, not block the open forever
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ModelError(f"{path.name}: model file not found ({path})") from None
    except OSError as e:
        raise ModelError(f"{path.name}: cannot open the model file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ModelError(f"{path.name}: is a folder, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"{path.name}: is not a regular file (a pipe or device?); give the path of a .gguf file")
        if st.st_size < HEADER_BYTES:
            raise ModelError(
                f"{path.name}: truncated GGUF file: {st.st_size} bytes, shorter than the "
                f"{HEADER_BYTES}-byte header; re-download the file"
            )
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path.name}: cannot read the model file ({getattr(e, 'strerror', None) or e})") from None
    finally:
        os.close(fd)


@dataclass(slots=True)
class _Parser:
    mm: mmap.mmap
    path: Path
    pos: int = 0
    size: int = 0
    fixups: list = field(default_factory=list)  # (container, key, dtype, offset, count): numeric arrays to map

    def __post_init__(self) -> None:
        self.size = len(self.mm)

    def fail(self, msg: str) -> ModelError:
        return ModelError(f"{self.path.name}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated or corrupt GGUF file: {what} at byte {self.pos} needs {n} bytes, only "
                f"{self.size - self.pos} remain; re-download the file"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        self.pos += 4
        return _U32.unpack_from(self.mm, self.pos - 4)[0]

    def u64(self, what: str) -> int:
        self.need(8, what)
        self.pos += 8
        return _U64.unpack_from(self.mm, self.pos - 8)[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"{what} length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit} allowed): the file is corrupt")
        self.need(n, what)
        self.pos += n
        try:
            return str(self.mm[self.pos - n : self.pos], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - n} is not valid UTF-8: the file is corrupt") from None

    def parse(self) -> GGUFFile:
        magic = self.mm[:4]
        if magic != MAGIC:
            raise self.fail(f"not a GGUF file (bad magic bytes {magic!r}, expected b'GGUF')")
        self.pos = 4
        version = self.u32("version")
        if version not in VERSIONS:
            if version in (2 << 24, 3 << 24):
                raise self.fail("big-endian GGUF files are not supported; convert the model on a little-endian host")
            raise self.fail(
                f"GGUF version {version} is not supported (only 2 and 3); re-convert the model with a current llama.cpp"
            )
        n_tensors, n_kv = self.u64("tensor count"), self.u64("metadata count")
        room = self.size - self.pos
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_BYTES > room:
            raise self.fail(
                f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the "
                f"remaining {room} bytes can hold: the file is truncated or corrupt"
            )
        meta = self.metadata(n_kv)
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment < 1 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment is {alignment}, not a power of two: the file is corrupt")
        tensors = self.tensor_infos(n_tensors, alignment)
        for container, key, dtype, offset, count in self.fixups:
            container[key] = np.frombuffer(self.mm, dtype, count, offset)
        return GGUFFile(self.path, version, alignment, self.size, meta, tensors, self.mm)

    def metadata(self, n_kv: int) -> dict[str, object]:
        meta: dict[str, object] = {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}", MAX_KEY_BYTES)
            if not key:
                raise self.fail(f"metadata key #{i} is empty: the file is corrupt")
            if key in meta:
                raise self.fail(f"duplicate metadata key {key!r}: the file is corrupt")
            vtype = self.u32(f"type of {key!r}")
            if key == "general.alignment" and vtype != UINT32:
                raise self.fail(f"general.alignment has value type {vtype}, not uint32: the file is corrupt")
            meta[key] = self.value(vtype, key, meta, key, 0)
        return meta

    def value(self, vtype: int, key: str, container, slot, depth: int) -> object:
        scalar = _STRUCTS.get(vtype)
        if scalar is not None:
            self.need(scalar.size, f"value of {key!r}")
            v = scalar.unpack_from(self.mm, self.pos)[0]
            self.pos += scalar.size
            if vtype == BOOL:
                if v > 1:
                    raise self.fail(f"{key!r} holds bool value {v} (0 or 1 allowed): the file is corrupt")
                return bool(v)
            return v
        if vtype == STRING:
            return self.string(f"value of {key!r}")
        if vtype == ARRAY:
            return self.array(key, container, slot, depth + 1)
        raise self.fail(
            f"metadata key {key!r} has unknown value type {vtype}: the file is corrupt or newer than this reader"
        )

    def array(self, key: str, container, slot, depth: int) -> object:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep: the file is corrupt")
        etype, count = self.u32(f"array type of {key!r}"), self.u64(f"array length of {key!r}")
        spec = _SCALARS.get(etype)
        if spec is not None:
            itemsize = np.dtype(spec[2]).itemsize
            self.need(count * itemsize, f"array {key!r} of {count} {spec[0]}")
            if etype == BOOL and count and int(np.frombuffer(self.mm, np.uint8, count, self.pos).max()) > 1:
                raise self.fail(f"{key!r} holds a bool value other than 0 or 1: the file is corrupt")
            self.fixups.append((container, slot, np.bool_ if etype == BOOL else spec[2], self.pos, count))
            self.pos += count * itemsize
            return None  # replaced by a view of the map once the whole file has checked out
        if etype not in (STRING, ARRAY):
            raise self.fail(
                f"array {key!r} has unknown element type {etype}: the file is corrupt or newer than this reader"
            )
        if count > MAX_OBJECT_ARRAY:
            raise self.fail(f"array {key!r} has {count} entries, more than localkv's limit of {MAX_OBJECT_ARRAY}")
        self.need(count * (8 if etype == STRING else 12), f"array {key!r} of {count} entries")
        if etype == STRING:
            strings, self.pos = read_string_array(self.mm, self.pos, count, lambda msg: self.fail(f"{key!r}: {msg}"))
            return strings
        items: list[object] = [None] * count
        for j in range(count):
            items[j] = self.value(ARRAY, key, items, j, depth)
        return items

    def tensor_infos(self, n_tensors: int, alignment: int) -> dict[str, TensorInfo]:
        raw = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"name of tensor #{i}", MAX_NAME_BYTES)
            if not name:
                raise self.fail(f"tensor #{i} has an empty name: the file is corrupt")
            if name in seen:
                raise self.fail(f"duplicate tensor name {name!r}: the file is corrupt")
            seen.add(name)
            n_dims = self.u32(f"dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.fail(
                    f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed): the file is corrupt"
                )
            self.need(8 * n_dims + 12, f"shape of {name!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", self.mm, self.pos)
            type_id, offset = struct.unpack_from("<IQ", self.mm, self.pos + 8 * n_dims)
            self.pos += 8 * n_dims + 12
            raw.append((name, ne, type_id, offset))
        data_start = -(-self.pos // alignment) * alignment
        tensors = {name: self.tensor(name, ne, tid, off, alignment, data_start) for name, ne, tid, off in raw}
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise self.fail(f"tensors {a!r} and {b!r} overlap in the file: the file is corrupt")
        return tensors

    def tensor(
        self, name: str, ne: tuple[int, ...], type_id: int, offset: int, alignment: int, data_start: int
    ) -> TensorInfo:
        if min(ne) < 1:
            raise self.fail(f"tensor {name!r} has a zero dimension (shape {list(ne)}): the file is corrupt")
        if max(ne) > INT64_MAX:
            raise self.fail(f"tensor {name!r} has a dimension past 2^63 (shape {list(ne)}): the file is corrupt")
        n = 1
        for d in ne:
            n *= d
        if n > INT64_MAX:
            raise self.fail(
                f"tensor {name!r}: element count of shape {list(ne)} overflows 64 bits: the file is corrupt"
            )
        qtype = _QTYPES.get(type_id)
        if qtype is None:
            raise self.fail(
                f"tensor {name!r} has unknown ggml type id {type_id}: the file is corrupt or needs a newer localkv"
            )
        qname, block, size = qtype
        if ne[0] % block:
            raise self.fail(
                f"tensor {name!r}: row length {ne[0]} is not a multiple of {qname}'s block size "
                f"{block}: the file is corrupt"
            )
        nbytes = n // block * size
        if offset % alignment:
            raise self.fail(
                f"tensor {name!r}: data offset {offset} is not a multiple of the alignment "
                f"{alignment}: the file is corrupt"
            )
        start = data_start + offset
        if start + nbytes > self.size:
            raise self.fail(
                f"tensor {name!r} ({qname}, shape {list(ne[::-1])}) needs bytes {start}..{start + nbytes} "
                f"but the file ends at {self.size}: the file is truncated; re-download it"
            )
        return TensorInfo(name, qname, tuple(ne[::-1]), start, nbytes)
