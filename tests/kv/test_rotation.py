"""Rotated K/V (kv/rotation.py): an orthogonal transform whose bits depend on the row alone, the
same from numpy and from the CPU kernel; an engine that turns Q, K and V (and the output back)
computes the attention of the rows themselves; rotated rows are another prefix-cache format."""

import numpy as np
import pytest

from localkv.backends.cpu import build
from localkv.backends.cpu import compiled as cpu_kernels
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.kv.rotation import Rotation
from localkv.sequence import Sequence
from tiny_model import write_gguf

RNG = np.random.default_rng(3)


@pytest.mark.parametrize("head_dim, block", [(64, 64), (80, 16), (128, 128), (96, 32)])
def test_the_transform_is_orthogonal_and_undone(head_dim, block):
    rot = Rotation.for_formats(True, True, head_dim)
    assert rot.block == block
    m = rot.apply(np.eye(head_dim, dtype=np.float32))
    np.testing.assert_allclose(m @ m.T, np.eye(head_dim), atol=1e-6)
    x = RNG.standard_normal((7, 5, head_dim)).astype(np.float32)
    y = rot.apply(x)
    np.testing.assert_allclose(rot.undo(y), x, atol=1e-5)
    np.testing.assert_allclose(np.einsum("thd,thd->th", y, y), np.einsum("thd,thd->th", x, x), rtol=1e-5)
    assert not np.allclose(y, x)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    rot = Rotation.for_formats(True, False, 64)
    x = RNG.standard_normal((33, 6, 64)).astype(np.float32)
    whole = rot.apply(x)
    for rows in (slice(0, 1), slice(5, 14), slice(32, 33)):
        assert np.array_equal(rot.apply(x[rows]), whole[rows])


@pytest.mark.skipif(not build.load(), reason="no numba kernels")
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_the_cpu_kernel_gives_numpys_bits(head_dim, T):
    rot = Rotation.for_formats(True, True, head_dim)
    qkv = RNG.standard_normal((T, 9, head_dim)).astype(np.float32)
    view = qkv[:, 2:8]  # strided, as the model's qkv rows
    turned = cpu_kernels.hadamard(view, rot, False)
    assert np.array_equal(turned, rot.apply(view))
    assert np.array_equal(cpu_kernels.hadamard(turned, rot, True), rot.undo(turned))


def test_only_a_quantized_half_turns_and_the_tag_says_which():
    assert Rotation.for_formats(False, False, 64) is None
    assert Rotation.for_formats(True, True, 64, enabled=False) is None
    k_only, v_only = Rotation.for_formats(True, False, 64), Rotation.for_formats(False, True, 64)
    assert (k_only.k, k_only.v, v_only.k, v_only.v) == (True, False, False, True)
    assert len({k_only.tag, v_only.tag, Rotation.for_formats(True, True, 64).tag}) == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("rot") / "tiny.gguf", dim=256, ffn=768, n_heads=4, n_kv_heads=2)


def _logits(eng: Engine, ids: list[int]) -> np.ndarray:
    return eng.prefill(Sequence(list(ids)))


def test_turning_a_float_pool_changes_the_logits_by_rounding_only(tiny):
    """Q, K and V turned and the output turned back: the attention of the rows themselves (an
    f32 pool, so nothing is lost to quantizing); a wrong sign, block or undo would show."""
    ids = [int(t) for t in RNG.integers(3, 200, 70)]
    cfg = EngineConfig(model=tiny, kv_dtype="f32", disk_cache=False, threads=2, ctx=256)
    plain, turned = Engine(cfg), Engine(cfg)
    turned.model.rotation = Rotation.for_formats(True, True, turned.model_config.head_dim)
    a, b = _logits(plain, ids), _logits(turned, ids)
    assert not np.array_equal(a, b)  # it did turn
    np.testing.assert_allclose(b, a, atol=2e-4, rtol=1e-4)


def test_rotated_rows_are_another_format_in_the_cache_key(tiny):
    keys = {}
    for kv, rotate in (("q8_0", True), ("q8_0", False), ("f16", True), ("f16", False)):
        eng = Engine(EngineConfig(model=tiny, kv_dtype=kv, kv_rotate=rotate, disk_cache=False, ctx=256))
        keys[kv, rotate] = eng.kv.salt
        assert (eng.model.rotation is not None) == (rotate and kv == "q8_0")
    assert keys["q8_0", True] != keys["q8_0", False]
    assert keys["f16", True] == keys["f16", False]
