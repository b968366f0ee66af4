"""Loading in place: GGUF tensors and Hugging Face safetensors stay views of their mapped files,
nothing is written beside a model, and broken files or metadata end in one ModelError line."""

import hashlib
import json
import struct
import tracemalloc

import numpy as np
import pytest
from hostile_gguf import METADATA_CASES

from localkv.backends.cpu import quant
from localkv.backends.cpu.quant import QStack, QTensor
from localkv.errors import ModelError
from localkv.model.loader import load_model
from tiny_model import read_back, tiny_weights, write_gguf, write_hf_dir

MEMORY_BOUND = 8 << 20  # a failing load of these small files may allocate at most this much

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _shape_args(quant: str) -> dict:
    return {"dim": 256, "ffn": 512} if quant.endswith("_K") else {}


def _base(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@pytest.mark.parametrize("qtype", TYPES)
def test_weights_stay_in_the_file_encoding(tmp_path, qtype):
    kw = _shape_args(qtype)
    path = write_gguf(tmp_path / f"{qtype}.gguf", quant=qtype, **kw)
    before = sorted(p.name for p in tmp_path.iterdir())
    lm = load_model(path)
    down, qkv = lm.weights["1.w_down"], lm.weights["0.wqkv"]
    assert isinstance(down, QTensor) and down.qtype == qtype and isinstance(qkv, QStack)
    assert not down.data.flags.writeable and not down.data.flags.owndata
    assert not isinstance(_base(down.data), np.ndarray)  # the mapped file, not a copy
    ref = read_back(path, **kw)
    np.testing.assert_array_equal(quant.dequantize(down), ref["model.layers.1.mlp.down_proj.weight"].astype(np.float32))
    assert lm.config.quant == qtype and lm.config.rope_style == "normal" and lm.config.n_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written beside the model
    assert lm.config.tied_embeddings and "output" not in lm.weights


def test_untied_output_weights(tmp_path):
    lm = load_model(write_gguf(tmp_path / "u.gguf", tied=False))
    assert not lm.config.tied_embeddings and lm.weights["output"].shape == (261, 64)


def test_fingerprint_follows_the_weights(tmp_path):
    a = load_model(write_gguf(tmp_path / "a.gguf", quant="Q8_0", seed=1)).config.fingerprint
    again = load_model(write_gguf(tmp_path / "b.gguf", quant="Q8_0", seed=1)).config.fingerprint
    other = load_model(write_gguf(tmp_path / "c.gguf", quant="Q8_0", seed=2)).config.fingerprint
    assert a == again != other  # same header, other weights: another fingerprint


def test_stale_weight_caches_are_removed(tmp_path, private_home):
    path = write_gguf(tmp_path / "m.gguf")
    beside = tmp_path / "m.gguf.localkv-v4.safetensors"
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    in_home = private_home / "weights" / f"{key}-m.gguf.localkv-v3.safetensors"
    in_home.parent.mkdir(parents=True)
    unrelated = [
        tmp_path / "other.gguf.localkv-v4.safetensors",
        private_home / "weights" / "x-other.gguf.localkv-v4.safetensors",
    ]
    for p in [beside, in_home, *unrelated]:
        p.write_bytes(b"an old format's fp32 weights")
    load_model(path)
    assert not beside.exists() and not in_home.exists()
    assert all(p.exists() for p in unrelated)


def test_truncated_tensor_data_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", quant="Q8_0")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelError, match=r"^m.gguf: tensor '.*' \(Q8_0.*the file is truncated; re-download it$"):
        load_model(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_tensor_offset_outside_the_file_is_one_line(tmp_path):
    from localkv.model.gguf import open_gguf

    path = write_gguf(tmp_path / "m.gguf", quant="Q4_1")
    with open_gguf(path) as g:
        info = g.tensors["blk.1.ffn_down.weight"]
        rel = info.offset - min(t.offset for t in g.tensors.values())
    raw = bytearray(path.read_bytes())
    at = raw.index(b"blk.1.ffn_down.weight") + len("blk.1.ffn_down.weight") + 4 + 16 + 4  # n_dims, 2 dims, type
    assert struct.unpack_from("<Q", raw, at)[0] == rel
    struct.pack_into("<Q", raw, at, rel + (1 << 30))
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match=r"^m.gguf: tensor 'blk.1.ffn_down.weight' .*file ends at"):
        load_model(path)


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"hello world, not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("case", METADATA_CASES, ids=lambda c: c.name)
def test_broken_metadata_is_one_line_before_any_allocation(tmp_path, case):
    path = write_gguf(tmp_path / "bad.gguf", **case.args)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError) as info:  # any other exception fails the test
            load_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert "\n" not in msg and case.expect in msg, msg
    assert peak < MEMORY_BOUND


def test_every_metadata_case_is_a_valid_model_when_unbroken(tmp_path):
    """The cases break one thing each: the same writer without the break loads."""
    for args in ({}, {"dim": 256, "ffn": 256}):
        assert load_model(write_gguf(tmp_path / "ok.gguf", **args)).config.n_layers == 2


# ---------------------------------------------------------------- Hugging Face directories


def _save_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]):
    """name -> (dtype name, array of its bits): written by hand, so BF16 needs no torch."""
    header, blobs, off = {}, [], 0
    for name, (dtype, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_hf_directory_maps_its_tensors_as_stored(tmp_path, dtype):
    d = write_hf_dir(tmp_path / "hf")
    w, _ = tiny_weights()
    conv = {
        "F32": lambda a: a,
        "F16": lambda a: a.astype(np.float16),
        "BF16": lambda a: (a.view(np.uint32) >> 16).astype(np.uint16),
    }[dtype]
    _save_safetensors(d / "model.safetensors", {n: (dtype, conv(a)) for n, a in w.items()})
    before = {p.name: p.stat().st_size for p in d.iterdir()}
    lm = load_model(d)
    q = lm.weights["0.wqkv"].tensors[0]
    assert q.qtype == dtype and not q.data.flags.writeable and not isinstance(_base(q.data), np.ndarray)
    assert lm.config.rope_style == "neox"
    want = w["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(quant.dequantize(q), want, rtol=1e-2 if dtype == "BF16" else 1e-3, atol=1e-2)
    assert {p.name: p.stat().st_size for p in d.iterdir()} == before


def test_hf_directory_with_broken_config_or_tensors(tmp_path):
    d = write_hf_dir(tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": 0}))
    with pytest.raises(ModelError, match="num_attention_heads is 0"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 97}))
    with pytest.raises(ModelError, match=r"mlp|ffn_gate.weight' is \[96, 64\], but the metadata implies \[97, 64\]"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(cfg))
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-64])
    with pytest.raises(ModelError, match="corrupt safetensors file: tensor .* data offsets"):
        load_model(d)
