"""Write GGUF files byte by byte, broken ones included, and a catalog of hostile cases.

Every value is packed with struct by hand (no gguf.GGUFWriter) so that a case can lie about any
count, length, type, shape or offset. `valid_parts()` is a small correct file; each hostile case
changes one thing in it and names the substring the reader's error line must contain.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<B",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
# ggml tensor types used here: id, elements per block, bytes per block
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
Q8_0_BLOCK, Q8_0_BYTES = 32, 34


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def value(vtype: int, v) -> bytes:
    """v for ARR is (element type, items); a nested array's items are (type, items) pairs again."""
    if vtype == STR:
        return gstr(v)
    if vtype == ARR:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(value(etype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def kv(key: str | bytes, vtype: int, v) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + value(vtype, v)


def array_header(key: str, etype: int, count: int) -> bytes:
    """An array entry's key, type and length, without elements: for lengths that lie."""
    return gstr(key) + struct.pack("<IIQ", ARR, etype, count)


@dataclass
class Tensor:
    name: str | bytes
    ne: tuple[int, ...]  # ggml order: row length first
    type_id: int = GGML_F32
    payload: bytes = b""
    offset: int | None = None  # relative to the data section; None: next aligned spot


@dataclass
class Parts:
    """A GGUF file as its pieces; `build()` lays them out, honouring any lie told here."""

    kvs: list[bytes] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    n_kv: int | None = None
    n_tensors: int | None = None
    alignment: int = 32  # used for the layout; the file states it only if a kv says so
    version_format: str = "<I"

    def build(self) -> bytes:
        infos, blob = [], bytearray()
        for t in self.tensors:
            off = t.offset
            if off is None:
                off = _align(len(blob), self.alignment)
            if t.payload:  # an empty payload can claim any offset without building a huge file
                blob.extend(b"\0" * max(0, off + len(t.payload) - len(blob)))
                blob[off : off + len(t.payload)] = t.payload
            name = t.name.encode() if isinstance(t.name, str) else t.name
            infos.append(gstr(name) + struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.type_id, off))
        n_tensors = len(self.tensors) if self.n_tensors is None else self.n_tensors
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        head = self.magic + struct.pack(self.version_format, self.version) + struct.pack("<QQ", n_tensors, n_kv)
        head += b"".join(self.kvs) + b"".join(infos)
        head += b"\0" * (_align(len(head), self.alignment) - len(head))
        return head + bytes(blob)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 0 else n


def f32_tensor(name: str, rows: int, cols: int, seed: int = 0) -> Tensor:
    vals = [((i * 7 + seed) % 13) / 4.0 for i in range(rows * cols)]
    return Tensor(name, (cols, rows), GGML_F32, struct.pack(f"<{len(vals)}f", *vals))


def q8_tensor(name: str, rows: int, blocks_per_row: int) -> Tensor:
    payload = bytes((i * 31 + 7) % 256 for i in range(rows * blocks_per_row * Q8_0_BYTES))
    return Tensor(name, (Q8_0_BLOCK * blocks_per_row, rows), GGML_Q8_0, payload)


TOKENS = ["<s>", "</s>", "hello", "Ġworld", "ĊĊ", "日本", ""] + [f"tok{i}" for i in range(70)]


def valid_parts() -> Parts:
    """A small, correct file: scalars of several types, string and numeric arrays, F32 and Q8_0 tensors."""
    kvs = [
        kv("general.architecture", STR, "llama"),
        kv("general.alignment", U32, 32),
        kv("llama.block_count", U32, 1),
        kv("llama.rope.freq_base", F32, 10000.0),
        kv("tokenizer.ggml.add_bos_token", BOOL, 1),
        kv("tokenizer.ggml.tokens", ARR, (STR, TOKENS)),
        kv("tokenizer.ggml.token_type", ARR, (I32, [1] * len(TOKENS))),
        kv("tokenizer.ggml.scores", ARR, (F32, [float(-i) for i in range(len(TOKENS))])),
    ]
    return Parts(
        kvs,
        [
            f32_tensor("output_norm.weight", 1, 8),
            q8_tensor("token_embd.weight", 3, 2),
            f32_tensor("blk.0.attn_q.weight", 8, 8, seed=3),
        ],
    )


def valid_file() -> bytes:
    return valid_parts().build()


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    expect: str  # a substring of the error line


def _with(**changes) -> Parts:
    return replace(valid_parts(), **changes)


def _tensors(*change: tuple[int, dict]) -> Parts:
    p = valid_parts()
    for i, c in change:
        p.tensors[i] = replace(p.tensors[i], **c)
    return p


def _kvs(*extra: bytes, drop_alignment: bool = False) -> Parts:
    p = valid_parts()
    if drop_alignment:
        p.kvs = [k for k in p.kvs if b"general.alignment" not in k]
    p.kvs = p.kvs + list(extra)
    return p


def hostile_cases() -> list[Case]:
    good = valid_file()
    meta_end = len(valid_parts().build()) - sum(len(t.payload) for t in valid_parts().tensors)
    big = 1 << 60
    cases = [
        Case("empty file", b"", "shorter than the 24-byte header"),
        Case("truncated header", good[:20], "shorter than the 24-byte header"),
        Case("truncated header counts", good[:200], "more than the remaining 176 bytes can hold"),
        Case("truncated metadata", good[:400], "truncated or corrupt"),
        Case("truncated in a string array", good[:900], "starts past the end of the file"),
        Case("truncated tensor infos", good[: meta_end - 40], "truncated or corrupt"),
        Case("truncated tensor data", good[:-10], "the file is truncated"),
        Case("wrong magic", b"GGUX" + good[4:], "bad magic"),
        Case("version 1", _with(version=1).build(), "version 1 is not supported"),
        Case("version 99", _with(version=99).build(), "version 99 is not supported"),
        Case("big-endian", _with(version_format=">I").build(), "big-endian"),
        Case("absurd kv count", _with(n_kv=1 << 62).build(), "metadata entries"),
        Case("absurd tensor count", _with(n_tensors=1 << 40).build(), "more than the remaining"),
        Case("one kv too many", _with(n_kv=len(valid_parts().kvs) + 1).build(), "corrupt"),
        Case("key length of 10^9", _kvs(gstr("x", length=10**9)).build(), "1000000000 bytes long (at most 65535"),
        Case("key length past the end", _kvs(gstr("x", length=60000)).build(), "metadata key #8 at byte"),
        Case(
            "key longer than the spec allows",
            _kvs(gstr("k" * 70000) + struct.pack("<IB", U8, 1)).build(),
            "at most 65535",
        ),
        Case("empty key", _kvs(kv("", U8, 1)).build(), "is empty"),
        Case("key not utf-8", _kvs(kv(b"bad\xff", U8, 1)).build(), "not valid UTF-8"),
        Case(
            "string value past the end",
            _kvs(gstr("s") + struct.pack("<I", STR) + gstr("abc", length=big)).build(),
            "value of 's'",
        ),
        Case("array of 2^60 uint32", _kvs(array_header("a", U32, big)).build(), "of 1152921504606846976 uint32"),
        Case("array of 2^60 strings", _kvs(array_header("a", STR, big)).build(), "more than localkv's limit"),
        Case("array of strings past the end", _kvs(array_header("a", STR, 100_000)).build(), "of 100000 entries"),
        Case(
            "string in an array past the end",
            _kvs(array_header("a", STR, 3) + gstr("ok") + gstr("x", big)).build(),
            "string #2 of 3 starts past the end",
        ),
        Case(
            "long string array, last string past the end",
            _kvs(array_header("a", STR, 80) + b"".join(gstr(f"s{i}") for i in range(79)) + gstr("x", 1 << 20)).build(),
            "string #79 of 80 runs past the end",
        ),
        Case(
            "string array not utf-8",
            _kvs(kv("a", ARR, (STR, [f"s{i}" for i in range(70)] + [b"\xc3("]))).build(),
            "string #70 is not valid",
        ),
        Case(
            "string array holding 0xFF",
            _kvs(kv("a", ARR, (STR, [f"s{i}" for i in range(70)] + [b"x\xffy"]))).build(),
            "string #70 is not valid",
        ),
        Case(
            "nested array of 2^60",
            _kvs(array_header("n", ARR, 1) + struct.pack("<IQ", U8, big)).build(),
            "array 'n' of 1152921504606846976 uint8",
        ),
        Case(
            "arrays nested too deep",
            _kvs(kv("n", ARR, (ARR, [(ARR, [(ARR, [(ARR, [(ARR, [])])])])]))).build(),
            "nests arrays more than 4 deep",
        ),
        Case("unknown value type", _kvs(gstr("u") + struct.pack("<IB", 13, 0)).build(), "unknown value type 13"),
        Case("unknown array element type", _kvs(array_header("u", 77, 1) + b"\0").build(), "unknown element type 77"),
        Case(
            "bool that is not 0 or 1", _kvs(kv("b", U8, 0)[:-5] + struct.pack("<IB", BOOL, 2)).build(), "bool value 2"
        ),
        Case(
            "duplicate key", _kvs(kv("llama.block_count", U32, 2)).build(), "duplicate metadata key 'llama.block_count'"
        ),
        Case("alignment 0", _kvs(kv("general.alignment", U32, 0), drop_alignment=True).build(), "not a power of two"),
        Case("alignment 3", _kvs(kv("general.alignment", U32, 3), drop_alignment=True).build(), "not a power of two"),
        Case("alignment not uint32", _kvs(kv("general.alignment", U64, 32), drop_alignment=True).build(), "not uint32"),
        Case(
            "unknown tensor type id",
            _tensors((0, {"type_id": 99})).build(),
            "tensor 'output_norm.weight' has unknown ggml type id 99",
        ),
        Case("removed tensor type id 4 (Q4_2)", _tensors((0, {"type_id": 4})).build(), "unknown ggml type id 4"),
        Case("0 dims", _tensors((0, {"ne": ()})).build(), "has 0 dimensions"),
        Case("5 dims", _tensors((0, {"ne": (8, 1, 1, 1, 1)})).build(), "has 5 dimensions"),
        Case("absurd dim count", _tensors((0, {"ne": (8,) + (1,) * 40})).build(), "has 41 dimensions"),
        Case("zero dim", _tensors((0, {"ne": (8, 0)})).build(), "zero dimension"),
        Case("dim of 2^63", _tensors((0, {"ne": (8, 1 << 63)})).build(), "past 2^63"),
        Case("element count overflow", _tensors((0, {"ne": (1 << 32, 1 << 32)})).build(), "overflows 64 bits"),
        Case("element count huge", _tensors((0, {"ne": (1 << 31, 1 << 30)})).build(), "the file is truncated"),
        Case(
            "row not a multiple of the block",
            _tensors((1, {"ne": (48, 2)})).build(),
            "row length 48 is not a multiple of Q8_0's block size 32",
        ),
        Case("misaligned offset", _tensors((2, {"offset": 36})).build(), "not a multiple of the alignment 32"),
        Case("offset past the end", _tensors((2, {"offset": 1 << 40, "payload": b""})).build(), "file ends at"),
        Case("overlapping tensors", _tensors((2, {"offset": 0})).build(), "overlap"),
        Case(
            "duplicate tensor name",
            _tensors((2, {"name": "output_norm.weight"})).build(),
            "duplicate tensor name 'output_norm.weight'",
        ),
        Case("empty tensor name", _tensors((1, {"name": ""})).build(), "empty name"),
        Case("tensor name too long", _tensors((1, {"name": "t" * 100})).build(), "at most 64"),
    ]
    return cases


# ---------------------------------------------------------------- metadata that lies about the tensors


@dataclass(frozen=True)
class MetaCase:
    """A real small model (tests/tiny_model.write_gguf with these arguments) whose metadata, or
    tensor set, is broken; the loader's error line must contain `expect`."""

    name: str
    args: dict
    expect: str


L = "llama."
METADATA_CASES = [
    MetaCase("zero heads", {"meta": {L + "attention.head_count": 0}}, "head_count is 0: outside 1..4096"),
    MetaCase("zero KV heads", {"meta": {L + "attention.head_count_kv": 0}}, "head_count_kv is 0: outside"),
    MetaCase("KV heads not dividing heads", {"meta": {L + "attention.head_count_kv": 3}}, "cannot share 3 KV heads"),
    MetaCase("NaN rope base", {"meta": {L + "rope.freq_base": float("nan")}}, "freq_base is nan: not a finite"),
    MetaCase("negative rope base", {"meta": {L + "rope.freq_base": -1.0}}, "freq_base is -1.0"),
    MetaCase("infinite rms eps", {"meta": {L + "attention.layer_norm_rms_epsilon": float("inf")}}, "epsilon is inf"),
    MetaCase("zero rms eps", {"meta": {L + "attention.layer_norm_rms_epsilon": 0.0}}, "epsilon is 0.0"),
    MetaCase("negative FFN width", {"meta": {L + "feed_forward_length": -5}}, "feed_forward_length is -5"),
    MetaCase("zero FFN width", {"meta": {L + "feed_forward_length": 0}}, "feed_forward_length is 0"),
    MetaCase("FFN width off", {"meta": {L + "feed_forward_length": 128}}, "the metadata implies [128, 64]"),
    MetaCase("key length of 10^9", {"meta": {L + "attention.key_length": 10**9}}, "key_length is 1000000000"),
    MetaCase(
        "key length off",
        {"meta": {L + "attention.key_length": 8, L + "rope.dimension_count": 8}},
        "the metadata implies [32, 64]",
    ),
    MetaCase(
        "odd key length",
        {"meta": {L + "attention.key_length": 15, L + "rope.dimension_count": 15}},
        "head width 15 is odd",
    ),
    MetaCase("value length differs", {"meta": {L + "attention.value_length": 8}}, "value_length is 8: differs"),
    MetaCase("partial rope", {"meta": {L + "rope.dimension_count": 8}}, "dimension_count is 8: differs"),
    MetaCase("width not divisible by heads", {"meta": {L + "attention.head_count": 3}}, "does not divide"),
    MetaCase(
        "width off",
        {"meta": {L + "embedding_length": 128, L + "attention.key_length": 16}},
        "the metadata implies [261, 128]",
    ),
    MetaCase("zero context", {"meta": {L + "context_length": 0}}, "context_length is 0"),
    MetaCase("context of 2^40", {"meta": {L + "context_length": 1 << 40}}, "context_length is 1099511627776"),
    MetaCase("negative block count", {"meta": {L + "block_count": -1}}, "block_count is -1"),
    MetaCase("block count as text", {"meta": {L + "block_count": "2"}}, "block_count is '2': not an integer"),
    MetaCase("more blocks than layers", {"meta": {L + "block_count": 3}}, "says 3 layers (block_count) but the file"),
    MetaCase("fewer blocks than layers", {"meta": {L + "block_count": 1}}, "says 1 layers (block_count) but the file"),
    MetaCase("vocab size off", {"meta": {L + "vocab_size": 1000}}, "vocab_size is 1000: differs from the 261"),
    MetaCase("no head count", {"meta": {L + "attention.head_count": None}}, "has no llama.attention.head_count"),
    MetaCase("no width", {"meta": {L + "embedding_length": None}}, "has no llama.embedding_length"),
    MetaCase("no token list", {"meta": {"tokenizer.ggml.tokens": None}}, "no tokenizer.ggml.tokens"),
    MetaCase("no merges", {"meta": {"tokenizer.ggml.merges": None}}, "has no tokenizer.ggml.merges"),
    MetaCase("token types short", {"meta": {"tokenizer.ggml.token_type": [1] * 5}}, "token_type holds 5 entries"),
    MetaCase("missing tensor", {"drop": ("blk.1.ffn_up.weight",)}, "missing tensor 'blk.1.ffn_up.weight'"),
    MetaCase("missing output norm", {"drop": ("output_norm.weight",)}, "missing tensor 'output_norm.weight'"),
    MetaCase(
        "unsupported tensor type",
        {"types": {"blk.0.ffn_up.weight": "TQ1_0"}, "dim": 256, "ffn": 256},
        "tensor 'blk.0.ffn_up.weight' is TQ1_0, which localkv cannot compute on",
    ),
    MetaCase("another architecture", {"arch": "gpt2"}, "unsupported architecture 'gpt2'"),
]
