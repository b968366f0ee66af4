"""GGUF and Hugging Face loading: quant types, the safetensors weight cache, bad files."""

import os

import numpy as np
import pytest

from localkv.errors import ModelError
from localkv.model.loader import load_model
from tiny_model import tiny_weights, write_gguf


@pytest.mark.parametrize("quant,tol", [("F32", 1e-7), ("F16", 1e-3), ("Q8_0", 0.02), ("Q4_0", 0.3), ("Q4_1", 0.3)])
def test_dequantized_weights_match_source(tmp_path, quant, tol):
    lm = load_model(write_gguf(tmp_path / f"{quant}.gguf", quant=quant))
    w, _ = tiny_weights()
    got = lm.weights["1.w_down"]
    want = w["model.layers.1.mlp.down_proj.weight"]
    assert np.abs(got - want).mean() <= tol * np.abs(want).mean() + 1e-7
    assert lm.config.quant == quant and lm.config.n_layers == 2 and lm.config.n_kv_heads == 2


def test_second_load_memory_maps_the_cache(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", quant="Q8_0")
    first = load_model(path)
    second = load_model(path)
    assert not first.cache_hit and second.cache_hit
    assert second.config == first.config
    for k, v in first.weights.items():
        assert np.array_equal(v, second.weights[k]), k
    assert not second.weights["0.wqkv"].flags.owndata  # a view of the mapped file, not a copy


def test_changed_source_invalidates_cache(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", seed=1)
    load_model(path)
    write_gguf(path, seed=2)
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    again = load_model(path)
    assert not again.cache_hit
    w, _ = tiny_weights(seed=2)
    np.testing.assert_allclose(again.weights["tok_embd"], w["model.embed_tokens.weight"])


def test_corrupt_cache_is_rebuilt_not_trusted(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    good = load_model(path)
    cache = next(tmp_path.glob("*.safetensors"))
    cache.write_bytes(cache.read_bytes()[:1000])
    again = load_model(path)
    assert not again.cache_hit
    np.testing.assert_array_equal(again.weights["out_norm"], good.weights["out_norm"])


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ModelError, match="corrupt or truncated"):
        load_model(path)
    assert not list(tmp_path.glob("*.safetensors"))  # nothing half-written


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"hello world, not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(write_gguf(tmp_path / "g.gguf", arch="gpt2"))


def test_untied_output_weights(tmp_path):
    lm = load_model(write_gguf(tmp_path / "u.gguf", tied=False))
    assert not lm.config.tied_embeddings and lm.weights["output"].shape == (64, 261)


def test_a_new_cache_removes_other_format_versions(tmp_path):
    from localkv.model.loader import CACHE_VERSION

    path = write_gguf(tmp_path / "m.gguf")
    stale = tmp_path / f"m.gguf.localkv-v{CACHE_VERSION + 7}.safetensors"
    stale.write_bytes(b"an old format's weights")
    unrelated = tmp_path / "other.gguf.localkv-v1.safetensors"
    unrelated.write_bytes(b"another model's cache")
    assert not load_model(path).cache_hit
    assert not stale.exists() and unrelated.exists()
    assert (tmp_path / f"m.gguf.localkv-v{CACHE_VERSION}.safetensors").exists()
