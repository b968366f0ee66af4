"""cupy.RawModule / RawKernel on the CPU: the source compiled by the CUDA emulator
(tests/cuda_emu), kernels launched with device arrays as pointers."""

from __future__ import annotations

import cuda_emu
import numpy as np

from cupy_standin._array import ndarray, unsupported


def _arg(a):
    """A kernel argument as the emulator takes it: a device array's memory; scalars as they are.
    A numpy array is refused, as CuPy refuses host memory for a kernel."""
    if isinstance(a, ndarray):
        return a._a
    if isinstance(a, np.ndarray):
        raise unsupported(a)
    return a


class RawKernel:
    def __init__(self, kernel: cuda_emu.Kernel):
        self._k = kernel
        self.name = kernel.name

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._k.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self._k.max_dynamic_shared_size_bytes = int(value)

    @property
    def max_threads_per_block(self) -> int:
        return self._k.max_threads_per_block

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if not isinstance(args, tuple):
            raise TypeError("kernel arguments must be a tuple")
        self._k(grid, block, tuple(_arg(a) for a in args), shared_mem=int(shared_mem))


class RawModule:
    """Compiled now (the emulator caches builds on disk, as CuPy caches NVRTC's)."""

    def __init__(self, code: str | None = None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):  # fmt: skip
        if code is None:
            raise NotImplementedError("the CuPy stand-in compiles source code only (code=...)")
        self.code, self.options = code, tuple(options)
        self._m = cuda_emu.Module(code, options=self.options)

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self._m.get_function(name))
