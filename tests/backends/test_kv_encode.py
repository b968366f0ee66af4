"""The CPU kernel that quantizes K/V rows as they are written: kv_format.encode's bytes."""

import numpy as np
import pytest

from localkv import kv_format
from localkv.backends.cpu import build
from localkv.backends.cpu import compiled as cpu_kernels

pytestmark = pytest.mark.skipif(not build.load(), reason="no numba kernels")


def rows(rng) -> np.ndarray:
    """[T, kvh, hd] rows with the cases that move a rounding: zeros, exact halves of a step,
    equal magnitudes of either sign, values near a half float's limits."""
    x = rng.standard_normal((1000, 2, 64)).astype(np.float16).astype(np.float32)  # as a model's
    x[0] = 0
    x[1, 0, :32] = np.arange(32, dtype=np.float32) - 16  # q4_0: ties at x / d + 8.5
    x[2, 0, :32] = np.arange(32, dtype=np.float32) - np.float32(15.5)  # q8_0: d = 1, every value a tie
    x[2, 0, 0] = 127
    x[3, 1, :32] = 1.0
    x[3, 1, 5] = -1.0  # the largest magnitude twice, the first negative
    x[4] *= np.float32(2e4)
    x[5] *= np.float32(1e-6)
    return x


@pytest.mark.parametrize("tokens", [6, 1000])  # a decode step's few rows (serial), a prefill's (threads)
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_the_kernel_writes_the_bytes_of_kv_format_encode(name, tokens):
    rng = np.random.default_rng(5)
    fmt = kv_format.FORMATS[name]
    x = rows(rng)[:tokens]
    layer = np.zeros((70, 16, 2, fmt.row_len(64)), fmt.dtype)
    slots = rng.permutation(1120)[:tokens]
    cpu_kernels.encode_rows(layer, slots, x)
    want = np.zeros_like(layer)
    want.reshape(1120, 2, -1)[slots] = kv_format.encode(x, fmt)
    assert np.array_equal(layer.view(np.uint8), want.view(np.uint8))
