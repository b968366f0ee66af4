"""cupy.ndarray on the CPU: a numpy array that stays on the "device".

What it keeps from CuPy, so that host code that would fail on a GPU fails here too:
- no implicit device -> host transfer: np.asarray(a), a + numpy_array, a numpy array as a kernel
  argument or as the value of `a[key] = ...` (other than `a[:] = ...`) raise as in CuPy; `.get()`
  and cupy.asnumpy copy to the host, cupy.asarray copies from it;
- reductions and integer indexing give 0-d device arrays, never host scalars;
- cupy.empty's memory is not zeroed: it is filled with NaN (floats) or 0xA5 bytes, so a kernel
  that leaves part of its output unwritten shows;
- numpy ufuncs and functions called on these arrays dispatch to the stand-in (NEP 13/18), as
  CuPy's do; mixing in a numpy array raises.
"""

from __future__ import annotations

import numpy as np

_GARBAGE_BYTE = 0xA5


class MemoryPointer:
    """ndarray.data: the device address of the first element."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)


def garbage(shape, dtype, order: str = "C") -> np.ndarray:
    """Fresh 'device memory': NaN for floating types, 0xA5 bytes otherwise."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return np.full(shape, np.nan, dtype, order=order)
    a = np.empty(shape, dtype, order=order)
    a.reshape(-1, order="A").view(np.uint8).fill(_GARBAGE_BYTE)
    return a


def unsupported(x) -> TypeError:
    return TypeError(f"Unsupported type {type(x)}")


def operand(x):
    """A ufunc operand as numpy sees it: device arrays unwrapped, scalars as they are; a numpy
    array or a list is refused, as CuPy's ufuncs refuse them."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, (np.generic, int, float, bool, complex)) or x is None:
        return x
    raise unsupported(x)


def wrap(r):
    """A numpy result as a device result: arrays wrapped (no copy), scalars as 0-d arrays."""
    if isinstance(r, np.ndarray):
        return ndarray._of(r)
    if isinstance(r, np.generic):
        return ndarray._of(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(wrap(x) for x in r)
    return r


def _index(key):
    """An index as numpy takes it: device arrays unwrapped; numpy arrays and lists are allowed
    (CuPy copies them to the device)."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, ndarray):
        return key._a
    return key


_HALF_ACCUMULATE = {"sum", "mean"}  # CuPy sums float16 in float32 and rounds once


def _reduction(name: str):
    def method(self, axis=None, dtype=None, out=None, keepdims=False):
        a = self._a
        kw = {} if name in ("max", "min", "argmax", "argmin", "any", "all") else {"dtype": dtype}
        if name in _HALF_ACCUMULATE and dtype is None and a.dtype == np.float16:
            r = getattr(a, name)(axis=axis, dtype=np.float32, keepdims=keepdims).astype(np.float16)
        elif name in ("argmax", "argmin"):
            r = getattr(a, name)(axis=axis, keepdims=keepdims)
        else:
            r = getattr(a, name)(axis=axis, keepdims=keepdims, **kw)
        if out is not None:
            out._a[...] = r
            return out
        return wrap(r)

    method.__name__ = name
    return method


def _binary(ufunc):
    def op(self, other):
        return wrap(ufunc(self._a, operand(other)))

    def rop(self, other):
        return wrap(ufunc(operand(other), self._a))

    def iop(self, other):
        ufunc(self._a, operand(other), out=self._a)
        return self

    return op, rop, iop


class ndarray:
    """A device array (see the module docstring); `_a` is the numpy array holding its memory."""

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the CuPy stand-in makes arrays from a shape and dtype only")
        self._a = garbage(shape, dtype, order)

    @classmethod
    def _of(cls, a: np.ndarray) -> ndarray:
        obj = cls.__new__(cls)
        obj._a = a
        return obj

    # ------------------------------------------------------------ attributes

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: Flags(self._a))
    data = property(lambda self: MemoryPointer(self._a.ctypes.data))
    T = property(lambda self: ndarray._of(self._a.T))
    device = property(lambda self: _device())

    def __repr__(self) -> str:
        return f"stand-in cupy {self._a!r}"

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (wrap(x) for x in self._a)

    # size-1 arrays convert to Python scalars (CuPy synchronises and copies)
    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def item(self):
        return self._a.item()

    def tolist(self):
        return self._a.tolist()

    # ------------------------------------------------------------ host transfers

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array "
            "explicitly."
        )

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape:
            raise ValueError(f"set: needs a numpy array of shape {self.shape}")
        self._a[...] = arr

    # ------------------------------------------------------------ numpy protocols (NEP 13 / 18)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = [operand(x) for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(operand(o) for o in kwargs["out"])
        return wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        import cupy_standin

        impl = getattr(cupy_standin, func.__name__, None)
        if impl is None or not callable(impl):
            raise TypeError(f"the CuPy stand-in has no {func.__name__}")
        return impl(*args, **kwargs)

    # ------------------------------------------------------------ views and copies

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and self._a.dtype == np.dtype(dtype):
            return self
        return ndarray._of(self._a.astype(dtype, order=order))

    def copy(self, order="C"):
        return ndarray._of(self._a.copy(order=order))

    def view(self, dtype=None):
        return ndarray._of(self._a.view() if dtype is None else self._a.view(dtype))

    def reshape(self, *shape, order="C"):
        return ndarray._of(self._a.reshape(*shape, order=order))

    def transpose(self, *axes):
        return ndarray._of(self._a.transpose(*axes))

    def swapaxes(self, a, b):
        return ndarray._of(self._a.swapaxes(a, b))

    def ravel(self, order="C"):
        return ndarray._of(self._a.ravel(order))

    def flatten(self):
        return ndarray._of(self._a.flatten())

    def squeeze(self, axis=None):
        return ndarray._of(self._a.squeeze(axis))

    def fill(self, value) -> None:
        self._a.fill(operand(value))

    sum = _reduction("sum")
    mean = _reduction("mean")
    max = _reduction("max")
    min = _reduction("min")
    argmax = _reduction("argmax")
    argmin = _reduction("argmin")
    any = _reduction("any")
    all = _reduction("all")

    # ------------------------------------------------------------ indexing

    def __getitem__(self, key):
        return wrap(self._a[_index(key)])

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray) and value.ndim > 0:
            # CuPy copies a host array only into the whole array (a[:] = host); anywhere else it refuses
            if not (isinstance(key, slice) and key == slice(None)):
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            self._a[:] = value
            return
        if isinstance(value, (list, tuple)):
            raise unsupported(value)
        self._a[_index(key)] = operand(value)

    # ------------------------------------------------------------ arithmetic

    __add__, __radd__, __iadd__ = _binary(np.add)
    __sub__, __rsub__, __isub__ = _binary(np.subtract)
    __mul__, __rmul__, __imul__ = _binary(np.multiply)
    __truediv__, __rtruediv__, __itruediv__ = _binary(np.true_divide)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary(np.floor_divide)
    __mod__, __rmod__, __imod__ = _binary(np.remainder)
    __pow__, __rpow__, __ipow__ = _binary(np.power)
    __and__, __rand__, __iand__ = _binary(np.bitwise_and)
    __or__, __ror__, __ior__ = _binary(np.bitwise_or)
    __xor__, __rxor__, __ixor__ = _binary(np.bitwise_xor)
    __lshift__, __rlshift__, __ilshift__ = _binary(np.left_shift)
    __rshift__, __rrshift__, __irshift__ = _binary(np.right_shift)
    __eq__ = _binary(np.equal)[0]
    __ne__ = _binary(np.not_equal)[0]
    __lt__ = _binary(np.less)[0]
    __le__ = _binary(np.less_equal)[0]
    __gt__ = _binary(np.greater)[0]
    __ge__ = _binary(np.greater_equal)[0]
    __hash__ = None

    def __matmul__(self, other):
        from cupy_standin._math import matmul

        return matmul(self, other)

    def __rmatmul__(self, other):
        from cupy_standin._math import matmul

        return matmul(other, self)

    def __neg__(self):
        return ndarray._of(-self._a)

    def __pos__(self):
        return ndarray._of(+self._a)

    def __abs__(self):
        return ndarray._of(abs(self._a))

    def __invert__(self):
        return ndarray._of(~self._a)


def _device():
    from cupy_standin.cuda import Device

    return Device(0)


# ---------------------------------------------------------------- creation and transfers


def asarray(a, dtype=None, order=None, *, blocking=False) -> ndarray:
    """A device array: `a` itself when it is one of that dtype, else a copy (from the host for
    numpy arrays, lists and scalars)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False) -> ndarray:
    if isinstance(obj, ndarray):
        return ndarray._of(np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return ndarray._of(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def ascontiguousarray(a, dtype=None) -> ndarray:
    """CuPy takes a device array only here (its parameter is typed)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy ndarray, got {type(a).__name__})")
    if a._a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return ndarray._of(np.ascontiguousarray(a._a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C") -> ndarray:
    return ndarray._of(garbage(shape, dtype, order))


def empty_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros(shape, dtype=float, order="C") -> ndarray:
    return ndarray._of(np.zeros(shape, dtype, order))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def ones(shape, dtype=float, order="C") -> ndarray:
    return ndarray._of(np.ones(shape, dtype, order))


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    return ndarray._of(np.full(shape, operand(fill_value), dtype, order))


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None) -> ndarray:
    return full(a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype)


def arange(start, stop=None, step=1, dtype=None) -> ndarray:
    return ndarray._of(np.arange(start, stop, step, dtype=dtype) if stop is not None else np.arange(start, dtype=dtype))
