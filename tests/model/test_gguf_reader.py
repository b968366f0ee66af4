"""localkv.model.gguf: hostile files end in one ModelError line; valid files read back as gguf-py reads them."""

import json
import os
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hostile_gguf import ARR, STR, Parts, hostile_cases, kv, valid_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localkv import gguf_py
from localkv.errors import ModelError
from localkv.model.gguf import PLAIN_DTYPES, open_gguf
from localkv.model.gguf_strings import _decode_each, _decode_joined

MEMORY_BOUND = 4 << 20  # the test files are a few KB: no claim in them may cost more than this


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _one_error_line(path: Path) -> str:
    with pytest.raises(ModelError) as info:  # any other exception type fails the test
        open_gguf(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path.name}: ")
    return msg


@pytest.mark.parametrize("case", hostile_cases(), ids=lambda c: c.name)
def test_hostile_file_gives_one_telling_line(case, tmp_path, traced):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(case.data)
    tracemalloc.reset_peak()
    msg = _one_error_line(path)
    assert case.expect in msg
    assert tracemalloc.get_traced_memory()[1] < MEMORY_BOUND


def test_missing_file_folder_and_fifo(tmp_path):
    with pytest.raises(ModelError, match="^nope.gguf: model file not found"):
        open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match="folder"):
        open_gguf(tmp_path)
    os.mkfifo(tmp_path / "fifo.gguf")  # opening it must not block waiting for a writer
    with pytest.raises(ModelError, match="not a regular file"):
        open_gguf(tmp_path / "fifo.gguf")


def _reader_fields(r: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _as_python(v):
    return v.tolist() if isinstance(v, np.ndarray) else v


def _maps(arr: np.ndarray, mm) -> bool:
    """arr is a view whose memory is the map (no copy anywhere on its base chain)."""
    while isinstance(arr, np.ndarray):
        arr = arr.base
    return isinstance(arr, memoryview) and arr.obj is mm


def assert_reads_like_gguf_py(path: Path) -> None:
    r = gguf.GGUFReader(path)
    with open_gguf(path) as g:
        theirs = _reader_fields(r)
        assert g.meta.keys() == theirs.keys()
        for key, v in g.meta.items():
            assert _as_python(v) == theirs[key], key
        assert [t.name for t in r.tensors] == list(g.tensors)
        for t in r.tensors:
            info = g.tensors[t.name]
            assert (info.qtype, info.shape) == (t.tensor_type.name, tuple(int(d) for d in t.shape[::-1]))
            assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
            view = g.data(t.name)
            if info.qtype in PLAIN_DTYPES:  # gguf-py gives BF16 as bytes; we give it as uint16
                assert view.dtype == np.dtype(PLAIN_DTYPES[info.qtype]) and view.shape == info.shape
            else:
                assert view.dtype == np.uint8 and view.shape == t.data.shape
            assert view.tobytes() == t.data.tobytes()
            assert not view.flags.writeable and _maps(view, g._mm)


def _write_with_gguf_writer(path: Path, tokens: list[str]) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_rope_freq_base(500000.0)
    w.add_string("general.name", "tiny ünïcode model")
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int8("test.i8", -7)
    w.add_float64("test.f64", 1e-300)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([float(i) / 3 for i in range(len(tokens))])
    w.add_token_merges([f"{a} {b}" for a, b in zip(tokens, tokens[1:])])
    w.add_key_value("test.u16s", [1, 2, 65535], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT16)
    w.add_key_value("test.bools", [True, False, True], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("f32_1d", rng.standard_normal(64, dtype=np.float32))
    w.add_tensor("f32_3d", rng.standard_normal((2, 3, 32), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((5, 32)).astype(np.float16))
    w.add_tensor("i32", rng.integers(-9, 9, (2, 8), dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8_0", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("q4_k", rng.integers(0, 256, (3, 2 * 144), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q4_K)
    w.add_tensor("bf16", rng.integers(0, 65536, (2, 16), dtype=np.uint16), raw_dtype=GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "tokens",
    [["a", "b", "Ġc"], [f"t{i}ü" for i in range(300)] + ["", "x\0y"]],
    ids=["few tokens", "many tokens, one with NUL"],
)
def test_gguf_writer_file_reads_back_like_gguf_py(tmp_path, tokens):
    path = tmp_path / "w.gguf"
    _write_with_gguf_writer(path, tokens)
    assert_reads_like_gguf_py(path)
    with open_gguf(path) as g:
        assert g.meta["tokenizer.ggml.tokens"] == tokens
        assert g.tensors["q4_k"].shape == (3, 512) and g.data("q4_k").shape == (3, 288)
        assert g.data("f32_3d").shape == (2, 3, 32) and g.data("bf16").dtype == np.uint16
        np.testing.assert_array_equal(g.meta["test.bools"], [True, False, True])


def test_hand_written_valid_file_reads_back(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(valid_file())
    assert_reads_like_gguf_py(path)


@pytest.mark.model
def test_real_model_reads_back_like_gguf_py(real_model_path):
    assert_reads_like_gguf_py(Path(real_model_path))


def test_views_are_read_only_and_share_the_map(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(valid_file())
    with open_gguf(path) as g:
        a, b = g.data("token_embd.weight"), g.data("token_embd.weight")
        assert a.dtype == np.uint8 and a.shape == (3, 2 * 34) and np.shares_memory(a, b)
        with pytest.raises(ValueError):
            a[0, 0] = 1
        scores = g.meta["tokenizer.ggml.scores"]
        assert _maps(scores, g._mm) and not scores.flags.writeable
        w = g.data("blk.0.attn_q.weight")
        with pytest.raises(ModelError, match="no tensor 'missing'"):
            g.data("missing")
    info = g.tensors["blk.0.attn_q.weight"]  # a view handed out stays valid after close()
    expected = np.frombuffer(path.read_bytes(), np.float32, info.nbytes // 4, info.offset).reshape(info.shape)
    np.testing.assert_array_equal(w, expected)
    with pytest.raises(RuntimeError, match="closed"):
        g.data("token_embd.weight")


def test_nested_arrays_read_as_lists(tmp_path):
    p = Parts([kv("n", ARR, (ARR, [(STR, ["a", "bc"]), (ARR, [(STR, [])])]))])
    path = tmp_path / "n.gguf"
    path.write_bytes(p.build())
    with open_gguf(path) as g:
        assert g.meta == {"n": [["a", "bc"], [[]]]} and g.tensors == {}


def test_plain_dtypes_agree_with_ggml_sizes():
    for name, dtype in PLAIN_DTYPES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (1, np.dtype(dtype).itemsize)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.text(max_size=6), max_size=150))
def test_string_array_fast_path_equals_per_string_path(strings):
    blob = b"".join(struct.pack("<Q", len(s.encode())) + s.encode() for s in strings)
    starts, p = [], 0
    for s in strings:
        starts.append(p)
        p += 8 + len(s.encode())
    joined = _decode_joined(blob, 0, len(blob), starts)
    assert joined is None or joined == strings  # None: a string holds NUL, decoded one by one instead
    assert _decode_each(blob, starts, len(blob), ModelError) == strings
    assert joined is not None or any("\0" in s for s in strings)


# ---------------------------------------------------------------- fuzz

BASE = valid_file()


def _fields(data: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(offset, size) of every integer field (counts, lengths, types, dims, offsets) in `data`:
    those of the header and metadata, and those of the tensor infos."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "base.gguf").write_bytes(data)
        r = gguf.GGUFReader(Path(d) / "base.gguf")
    out: tuple[list, list] = ([], [])
    for f, where in [*((f, out[0]) for f in r.fields.values()), *((t.field, out[1]) for t in r.tensors)]:
        pos = f.offset
        for part in f.parts:
            if part.dtype in (np.uint32, np.uint64):
                where += [(pos + j * part.itemsize, part.itemsize) for j in range(part.size)]
            pos += part.nbytes
    return out


META_FIELDS, TENSOR_FIELDS = _fields(BASE)
META_END = TENSOR_FIELDS[-1][0] + 8
HUGE = [0, 1, 2, 3, 4, 5, 9, 13, 33, 64, 255, 1 << 16, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 60, 1 << 63, (1 << 64) - 1]
_mutation = st.one_of(
    st.tuples(st.just("overwrite"), st.integers(0, META_END - 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, len(BASE) - 1), st.just(0)),
    *(
        st.tuples(
            st.just("field"), st.sampled_from(fields), st.one_of(st.sampled_from(HUGE), st.integers(0, 2**64 - 1))
        )
        for fields in (META_FIELDS, TENSOR_FIELDS)
    ),
)


def _mutate(data: bytes, mutations) -> bytes:
    buf = bytearray(data)
    for kind, where, what in mutations:
        if kind == "overwrite":
            buf[where : where + len(what)] = what
        elif kind == "truncate":
            del buf[where:]
        else:
            pos, size = where
            buf[pos : pos + size] = (what % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(buf)


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "fuzz.gguf"


@settings(
    max_examples=1500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # the autouse LOCALKV_HOME one; unused here
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_fuzzed_file_loads_or_gives_one_line(fuzz_file, mutations):
    fuzz_file.write_bytes(_mutate(BASE, mutations))
    tracemalloc.start()
    try:
        g = open_gguf(fuzz_file)
    except ModelError as e:
        assert "\n" not in str(e) and str(e).startswith("fuzz.gguf: ")
    else:
        with g:
            for name, info in g.tensors.items():
                assert g.data(name).nbytes == info.nbytes
                assert info.offset + info.nbytes <= g.file_size
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MEMORY_BOUND


def test_the_type_table_is_gguf_pys_without_its_package_import():
    """gguf_py reads gguf-py's own table and dequantizer, and an engine start that uses them
    does not import the gguf package (its whole library and yaml)."""
    table = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}
    assert table == gguf_py.TYPES
    code = (
        "import json, sys; import numpy as np; from localkv import gguf_py; "
        "x = gguf_py.dequantize(np.zeros((2, 18), np.uint8), 'Q4_0'); "
        "print(json.dumps(['gguf' in sys.modules, list(x.shape), gguf_py.block_size('Q4_K')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, [2, 32], [256, 144]]
