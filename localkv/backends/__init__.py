"""The backends the model runs on: CpuBackend (numpy, OpenBLAS, numba kernels) and, with CuPy and
an NVIDIA GPU, CudaBackend (raw CUDA kernels in cuda/*.cu). select() picks one for --device.
"""

import ctypes
import importlib
import os
import sys

from localkv.backends.base import Backend
from localkv.backends.cpu import CpuBackend
from localkv.backends.vm import MMAP_THRESHOLD
from localkv.errors import LocalkvError, first_line

DEVICES = ("auto", "cpu", "cuda")
_NEED_CUPY = "--device cuda needs CuPy: pip install -e '.[gpu]' (CUDA 12) or '.[gpu13]' (CUDA 13)"


def select(device: str = "auto", threads: int = 1) -> Backend:
    """The backend for a --device value: "cpu", "cuda", or "auto" (cuda when CuPy imports and sees
    a GPU, else cpu). Raises LocalkvError with the reason when cuda cannot run."""
    d = (device or "auto").strip().lower()
    if d == "cpu":
        return CpuBackend(threads)
    if d == "cuda":
        return _cuda()()
    if d == "auto":
        try:
            return _cuda()()
        except LocalkvError:
            return CpuBackend(threads)
    raise LocalkvError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 64 << 20  # free memory the heap keeps before returning it to the OS
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep numpy's large temporaries (attention scores, FFN activations) in the heap. glibc's
    default serves every allocation above 128 KiB, at first, from a fresh mmap and, later, from a
    heap it trims back to the OS, so the same temporaries are page-faulted in again layer after
    layer (thousands of minor faults per prefill; none with this tuning, which matters where
    first-touch memory is slow). The heap keeps at most TRIM_THRESHOLD of freed memory.
    Linux/glibc only; skipped when the user set MALLOC_*_ tunables. Returns whether it applied."""
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _malloc_tuned


def available_devices() -> list[str]:
    """The devices select() can run here, "cpu" first."""
    try:
        _cuda()
    except LocalkvError:
        return ["cpu"]
    return ["cpu", "cuda"]


def _cuda():
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as e:
        if e.name in (None, "cupy"):
            raise LocalkvError(_NEED_CUPY) from None
        shadow = getattr(sys.modules.get("cuda"), "__file__", None) if e.name.startswith("cuda") else None
        raise LocalkvError(
            f"--device cuda: CuPy failed to import ({first_line(e)})"
            + (
                f"; {shadow} shadows NVIDIA's 'cuda' package: run from another folder or set PYTHONSAFEPATH=1"
                if shadow
                else ""
            )
        ) from None
    except Exception as e:  # installed but broken (e.g. a CUDA library it needs is missing)
        raise LocalkvError(f"--device cuda: CuPy failed to import ({type(e).__name__}: {first_line(e)})") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, driver too old, no device
        raise LocalkvError(
            f"--device cuda: no CUDA GPU visible ({first_line(e)}; check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        ) from None
    if n < 1:
        raise LocalkvError("--device cuda: no CUDA GPU visible (0 devices; check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    try:
        from localkv.backends.cuda import CudaBackend
    except Exception as e:
        raise LocalkvError(
            f"--device cuda: the CuPy backend failed to load ({type(e).__name__}: {first_line(e)})"
        ) from None
    return CudaBackend
