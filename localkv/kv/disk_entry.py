"""One entry of the disk cache as a file, and every check a file must pass to be loaded.

File: fixed header (magic, format version, JSON length) + JSON header + raw payload (K then
V, each in its format: the dtype field names one, or K:V). The JSON's checksum (CRC-32,
cheaper than BLAKE2b: it guards against torn writes and bit rot, not against an attacker who
can write the cache directory anyway) covers the rest of the JSON and the payload, so any
bit flip or truncation is caught. It is zlib's CRC-32, computed by ISA-L (isal): the same
values many times faster, and a warm start checks every block it reads.

The cache's contents are not trusted beyond that: only regular files are opened (no FIFO,
device or symlink; see home.open_regular), the JSON must have every field with the type this
version reads, sizes must agree before anything is allocated, and a payload holding NaN or Inf
is refused: the checksum proves the bytes are the ones written, not that they are K/V a model
could have made.
"""

import functools
import json
import math
import os
import struct
import threading
from pathlib import Path

import numpy as np
from isal import isal_zlib

from localkv import kv_format
from localkv.home import NotRegularFile, open_regular

MAGIC = b"LKVB"
VERSION = 2  # 2: CRC-32 checksum (1 used BLAKE2b; such files read as another version: a miss)
FIXED = struct.Struct("<4sHI")  # magic, format version, JSON header length
MAX_HEAD = 1 << 20  # a JSON header longer than this is damage: a block's tokens take a few KiB

# per stored dtype: its bits as signed and unsigned integers, +Inf's bits and -Inf's (see all_finite)
_NONFINITE = {
    "float16": (np.int16, np.uint16, 0x7C00, 0xFC00),
    "float32": (np.int32, np.uint32, 0x7F800000, 0xFF800000),
}
_EXP_HIGH = np.uint8(_NONFINITE["float16"][2] >> 8)  # an f16's exponent bits in its high byte


class Damaged(Exception):
    """The file at an entry's name is damaged, not an entry at all, or in a format older than
    VERSION that this version never reads: the store deletes it so it gets rewritten (a block
    whose file holds an entry is not written again, so a kept bad file would be a miss for good)."""


FIELDS = frozenset({"fingerprint", "model", "hash", "checksum", "dtype", "tokens", "shape"})
PARENT = "parent"  # optional: the hash of the block before it (a first block, or an older entry, has none)
MAX_DIM = 1 << 16  # layers, block size, KV heads or head dim beyond this is damage, not a model
MAX_TOKEN = 1 << 31  # token ids are below this in every vocabulary
_HEX = frozenset("0123456789abcdef")


def _text(x, longest: int) -> bool:
    return type(x) is str and 0 < len(x) <= longest


def _hex(x, longest: int) -> bool:
    return _text(x, longest) and _HEX.issuperset(x)


def _ints(x, low: int, high: int) -> bool:
    return type(x) is list and all(type(t) is int and low <= t < high for t in x)


def header_ok(m) -> bool:
    """The JSON header has exactly the fields this version writes, each of the type and in the
    range a real entry has. Anything else (a list where a string belongs, a bool for an int, a
    huge number, a missing or unknown field) is damage, checked before any value is used: a value
    of the wrong type must never reach code that hashes, compares or sizes it."""
    return (
        type(m) is dict
        and (m.keys() == FIELDS or (m.keys() == FIELDS | {PARENT} and _hex(m[PARENT], 32)))
        and _text(m["fingerprint"], 256)
        and _text(m["model"], 1024)
        and _hex(m["hash"], 32)
        and _hex(m["checksum"], 128)  # any version's: read_header shows older entries too
        and type(m["dtype"]) is str
        and _ints(m["shape"], 1, MAX_DIM + 1)
        and len(m["shape"]) == 4
        and layout(m["dtype"], m["shape"]) is not None
        and _ints(m["tokens"], 0, MAX_TOKEN)
        and m["shape"][1] == len(m["tokens"])
    )


def _unique(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):  # json.loads would keep the last silently: not a file we wrote
        raise ValueError("duplicate key")
    return d


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


# made once: json.loads and json.dumps with options build a new coder per call, which costs
# more than the header it reads (a warm start checks one per block)
_DECODER = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_constant)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def parse_header(raw: bytes) -> dict:
    """The JSON header of raw bytes, checked by header_ok; Damaged for anything else."""
    try:
        m = _DECODER.decode(raw.decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise Damaged(f"bad header: {type(e).__name__}") from None
    if not header_ok(m):
        raise Damaged("bad header")
    return m


def _canon(meta: dict) -> bytes:
    return _ENCODER.encode(meta).encode()


def digest(meta: dict, payload) -> str:
    return f"{isal_zlib.crc32(payload, isal_zlib.crc32(_canon(meta))):08x}"


def encode(meta: dict, payload) -> list:
    """The file's bytes, in chunks: fixed header, JSON header with its checksum, payload."""
    head = _canon({**meta, "checksum": digest(meta, payload)})
    return [FIXED.pack(MAGIC, VERSION, len(head)), head, payload]


def layout(dtype: str, shape: list) -> tuple[tuple[kv_format.KvFormat, tuple], ...] | None:
    """K's and V's (format, array shape) in an entry whose dtype field is `dtype` (one stored
    name, or K:V as kv_format.pair_stored writes it) and whose shape is K's [layers,
    block_size, kv_heads, row_len]; None when no pool holds such rows (a name no format has, a
    row that is not whole blocks, a head V's format cannot split)."""
    pair = kv_format.pair_by_stored(dtype)
    return None if pair is None else _layout(pair, tuple(shape))


# remembered by formats (not by the header's text, which a damaged file makes any size): a read
# asks three times (the header's check, the size, the halves), a warm start once a block
@functools.lru_cache(maxsize=64)
def _layout(pair: tuple, shape: tuple) -> tuple[tuple[kv_format.KvFormat, tuple], ...] | None:
    k, v = pair
    if shape[3] * k.dtype.itemsize % k.block_bytes:
        return None
    head_dim = k.head_dim(shape[3])
    if head_dim % v.block:
        return None
    return (k, shape), (v, (*shape[:3], v.row_len(head_dim)))


def payload_size(meta: dict) -> int:
    return sum(math.prod(shape) * fmt.dtype.itemsize for fmt, shape in layout(meta["dtype"], meta["shape"]))


def halves(meta: dict, payload) -> tuple[np.ndarray, np.ndarray] | None:
    """(K, V) of a decoded entry as arrays in their formats (views of payload), or None when
    either holds NaN or Inf (see all_finite)."""
    out, at = [], 0
    view = memoryview(payload).cast("B")
    for fmt, shape in layout(meta["dtype"], meta["shape"]):
        n = math.prod(shape) * fmt.dtype.itemsize
        part = view[at : at + n]
        if not all_finite(part, fmt.stored):
            return None
        out.append(np.frombuffer(part, fmt.dtype).reshape(shape))
        at += n
    return out[0], out[1]


def decode(data: bytes) -> tuple[dict, memoryview] | None:
    """(meta, payload) of a verified file of this version; None for a newer format version (not
    ours to judge: a newer localkv may share the folder); Damaged for anything else."""
    if data[:4] != MAGIC:
        raise Damaged("not an entry")  # zeros, foreign bytes, or cut inside the magic
    if len(data) < FIXED.size:
        raise Damaged("truncated")
    _, version, n = FIXED.unpack_from(data)
    if version > VERSION:
        return None
    if version < VERSION:  # an older localkv's: never read again, so it must make way for a rewrite
        raise Damaged(f"format {version}, older than {VERSION}")
    if n > MAX_HEAD:
        raise Damaged("header too long")
    meta = parse_header(bytes(data[FIXED.size : FIXED.size + n]))
    check = meta.pop("checksum")
    payload = memoryview(data)[FIXED.size + n :]
    if len(payload) != payload_size(meta) or digest(meta, payload) != check:
        raise Damaged("size or checksum mismatch")
    return meta, payload


class ReadBuffer(threading.local):
    """A buffer per thread that read_file reads into: a warm start reads every block of a
    prompt, and a new buffer per file costs more in page faults than the read itself."""

    def __init__(self):
        self.data = bytearray()

    def take(self, n: int) -> bytearray:
        """At least n bytes; a new buffer when too small (views of the old one may live on)."""
        if len(self.data) < n:
            self.data = bytearray(n)
        return self.data


def read_file(path: Path, limit: int, into: ReadBuffer | None = None) -> bytes | memoryview | None:
    """The bytes of a regular file of at most limit bytes, None if absent; Damaged for a
    special file, a symlink or a file too big to be an entry. With into, a view of its
    buffer, valid until this thread's next read."""
    try:
        fd = open_regular(path)
    except NotRegularFile:
        raise Damaged("not a regular file") from None
    if fd is None:
        return None
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise Damaged("larger than the cache may grow")
        if into is None:
            return f.readall()
        view, n = memoryview(into.take(size + 1)), 0
        while got := f.readinto(view[n:]):  # one byte past size: a file that grew reads longer
            n += got
        return view[:n]


def read_header(path: Path) -> dict | None:
    """The JSON header of an entry with our magic (any format version) if it has the fields
    this version shows, with their types, and (in this version) the file its size says; None
    for anything else; FileNotFoundError if gone."""
    try:
        fd = open_regular(path)
        if fd is None:
            raise FileNotFoundError(path)
        with open(fd, "rb") as f:
            magic, version, n = FIXED.unpack(f.read(FIXED.size))
            if magic != MAGIC or n > MAX_HEAD:
                return None
            m = parse_header(f.read(n))
            size = os.fstat(fd).st_size
    except FileNotFoundError:
        raise
    except (NotRegularFile, OSError, struct.error, Damaged):
        return None
    if version == VERSION and size != FIXED.size + n + payload_size(m):
        return None
    return m


def holds_entry(path: Path) -> bool | None:
    """True when path starts like an entry of this format version or a newer one (its checksum
    is checked when it is read), False when something else is there, None when nothing is."""
    try:
        fd = open_regular(path)
    except NotRegularFile:
        return False
    if fd is None:
        return None
    with open(fd, "rb") as f:
        head = f.read(FIXED.size)
    if len(head) < FIXED.size:
        return False
    magic, version, _ = FIXED.unpack(head)
    return magic == MAGIC and version >= VERSION


def all_finite(payload, dtype: str) -> bool:
    """No NaN or Inf in payload, from two max-reductions over its bits, which read the payload
    but write nothing (this runs for every block of a warm start; np.isfinite on float16 is
    slower). Read as signed integers, a positive NaN/Inf is at least the all-ones
    exponent, and no finite value is; read as unsigned, every negative NaN/Inf is at least the
    sign bit plus that exponent, and no finite value is."""
    fmt = kv_format.by_stored(dtype)
    if fmt.quantized:  # the integers are finite; a block's f16 scale may not be
        # a scale is NaN or Inf when its exponent bits are all ones: bits 2-6 of its high byte
        # (little-endian, as GGUF lays out a block), read in place (a copy of the scales cost more)
        high = np.frombuffer(payload, np.uint8).reshape(-1, fmt.block_bytes)[:, 1]
        return int((high & _EXP_HIGH).max(initial=0)) < _EXP_HIGH
    signed, unsigned, exp, neg = _NONFINITE[dtype]
    if len(payload) == 0:
        return True
    return int(np.frombuffer(payload, signed).max()) < exp and int(np.frombuffer(payload, unsigned).max()) < neg
