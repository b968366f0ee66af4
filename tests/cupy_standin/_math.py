"""CuPy's ufuncs and array functions on stand-in arrays: numpy on the unwrapped arrays, device
arrays only (a numpy array among the operands raises, as in CuPy).

matmul of float16 arrays accumulates in float32 and rounds the result once to float16, as
cuBLAS's half-precision gemm does with float32 compute (CuPy's default for float16)."""

from __future__ import annotations

import numpy as np

from cupy_standin._array import ndarray, operand, unsupported, wrap


def _ufunc(f):
    def call(*args, out=None, **kwargs):
        if out is not None:
            kwargs["out"] = operand(out)
        return wrap(f(*(operand(a) for a in args), **kwargs))

    call.__name__ = f.__name__
    return call


exp = _ufunc(np.exp)
log = _ufunc(np.log)
sqrt = _ufunc(np.sqrt)
tanh = _ufunc(np.tanh)
abs = absolute = _ufunc(np.absolute)
negative = _ufunc(np.negative)
add = _ufunc(np.add)
subtract = _ufunc(np.subtract)
multiply = _ufunc(np.multiply)
divide = true_divide = _ufunc(np.true_divide)
maximum = _ufunc(np.maximum)
minimum = _ufunc(np.minimum)
where = _ufunc(np.where)
isfinite = _ufunc(np.isfinite)
isnan = _ufunc(np.isnan)
rint = _ufunc(np.rint)


def _arrays(seq) -> list[np.ndarray]:
    out = []
    for a in seq:
        if not isinstance(a, ndarray):
            raise unsupported(a)
        out.append(a._a)
    return out


def matmul(a, b, out=None, dtype=None):
    x, y = operand(a), operand(b)
    if not (isinstance(a, ndarray) and isinstance(b, ndarray)):
        raise unsupported(b if isinstance(a, ndarray) else a)
    if x.dtype == np.float16 and y.dtype == np.float16 and dtype is None:
        r = np.matmul(x.astype(np.float32), y.astype(np.float32)).astype(np.float16)
    else:
        r = np.matmul(x, y, dtype=dtype)
    if out is not None:
        out._a[...] = r
        return out
    return wrap(r)


def dot(a, b, out=None):
    return matmul(a, b, out=out)


def triu(m, k=0):
    return wrap(np.triu(operand(m), k))


def tril(m, k=0):
    return wrap(np.tril(operand(m), k))


def stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return wrap(np.stack(_arrays(arrays), axis=axis, dtype=dtype, casting=casting))


def concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    return wrap(np.concatenate(_arrays(arrays), axis=axis, dtype=dtype, casting=casting))


def take(a, indices, axis=None, out=None):
    return wrap(np.take(operand(a), operand(indices), axis=axis))


def _reduce(name):
    def call(a, axis=None, dtype=None, out=None, keepdims=False):
        if not isinstance(a, ndarray):
            raise unsupported(a)
        return getattr(a, name)(axis=axis, out=out, keepdims=keepdims, **({} if dtype is None else {"dtype": dtype}))

    call.__name__ = name
    return call


sum = _reduce("sum")
mean = _reduce("mean")
amax = max = _reduce("max")
amin = min = _reduce("min")


def argmax(a, axis=None, dtype=None, out=None, keepdims=False):
    return a.argmax(axis=axis, out=out, keepdims=keepdims)


def reshape(a, newshape, order="C"):
    return a.reshape(newshape, order=order)


def transpose(a, axes=None):
    return a.transpose(*(axes or ()))


def copy(a, order="K"):
    return a.copy()
