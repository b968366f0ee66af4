"""Selecting the stand-in.

`standin()`: while it is open `import cupy` returns the stand-in and localkv's CUDA backend is
imported afresh against it; on exit every module involved is put back as it was (a real CuPy and
a backend bound to it stay untouched).

`device()`: the real CuPy when it imports and sees a GPU, else the stand-in (skipping the test
when there is no C++ compiler to emulate the kernels); yields (cupy module, emulated)."""

from __future__ import annotations

import contextlib
import sys

import cuda_emu
import pytest

import cupy_standin

_OURS = ("cupy", "cupy.cuda")


def _backend_modules() -> list[str]:
    return [n for n in sys.modules if n == "localkv.backends.cuda" or n.startswith("localkv.backends.cuda_")]


@contextlib.contextmanager
def standin():
    import localkv.backends as backends

    names = [*_OURS, *_backend_modules()]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    saved_attrs = {n: getattr(backends, n) for n in dir(backends) if n == "cuda" or n.startswith("cuda_")}
    for n in names:
        sys.modules.pop(n, None)
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy_standin, cupy_standin.cuda
    try:
        yield cupy_standin
    finally:
        for n in [*_OURS, *_backend_modules()]:
            sys.modules.pop(n, None)
        for n in [n for n in dir(backends) if n == "cuda" or n.startswith("cuda_")]:
            delattr(backends, n)
        sys.modules.update(saved)
        for n, v in saved_attrs.items():
            setattr(backends, n, v)


def real_gpu_reason() -> str:
    """Why the real CuPy cannot run here ("" when it can)."""
    try:
        import cupy
    except Exception as e:
        return f"CuPy not usable ({type(e).__name__}: {e})"
    if getattr(cupy, "STANDIN", False):
        return "the CuPy stand-in is selected"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no CUDA GPU visible ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return "" if n > 0 else "no CUDA GPU visible (0 devices)"


@contextlib.contextmanager
def device():
    if not real_gpu_reason():
        import cupy

        yield cupy, False
        return
    if cuda_emu.compiler() is None:
        pytest.skip("no GPU, and no C++ compiler to emulate one")
    with standin() as cupy:
        yield cupy, True
