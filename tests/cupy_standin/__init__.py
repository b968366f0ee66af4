"""A stand-in for the part of CuPy localkv uses, on the CPU, for tests only: arrays backed by
numpy (_array), ufuncs and array functions (_math), RawModule compiling CUDA sources with the
CUDA emulator (tests/cuda_emu), cupy.cuda with one emulated device. `swap.standin()` puts it
in sys.modules as `cupy` for the duration of a test module.

It emulates CuPy's contract, not localkv: what it refuses, CuPy refuses (implicit host <->
device transfers, host arrays as kernel arguments); see _array's docstring. It does not model
asynchrony (launches complete before they return), memory pools or multiple devices."""

import numpy as _np

from cupy_standin import cuda
from cupy_standin._array import (
    arange,
    array,
    asarray,
    ascontiguousarray,
    asnumpy,
    empty,
    empty_like,
    full,
    full_like,
    ndarray,
    ones,
    zeros,
    zeros_like,
)
from cupy_standin._kernel import RawKernel, RawModule
from cupy_standin._math import (
    abs,
    absolute,
    add,
    amax,
    amin,
    argmax,
    concatenate,
    copy,
    divide,
    dot,
    exp,
    isfinite,
    isnan,
    log,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    multiply,
    negative,
    reshape,
    rint,
    sqrt,
    stack,
    subtract,
    sum,
    take,
    tanh,
    transpose,
    tril,
    triu,
    true_divide,
    where,
)

__version__ = "13.3.0+localkv-standin"
STANDIN = True  # real CuPy has no such attribute

float16, float32, float64 = _np.float16, _np.float32, _np.float64
int8, int16, int32, int64 = _np.int8, _np.int16, _np.int32, _np.int64
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
bool_, dtype = _np.bool_, _np.dtype
inf, nan, newaxis, pi = _np.inf, _np.nan, None, _np.pi


def get_array_module(*args):
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


__all__ = [
    "RawKernel", "RawModule", "abs", "absolute", "add", "amax", "amin", "arange", "argmax", "array", "asarray",
    "ascontiguousarray", "asnumpy", "concatenate", "copy", "cuda", "divide", "dot", "empty", "empty_like", "exp",
    "full", "full_like", "get_array_module", "isfinite", "isnan", "log", "matmul", "max", "maximum", "mean", "min",
    "minimum", "multiply", "ndarray", "negative", "ones", "reshape", "rint", "sqrt", "stack", "subtract", "sum", "take",
    "tanh", "transpose", "tril", "triu", "true_divide", "where", "zeros", "zeros_like",
]  # fmt: skip
