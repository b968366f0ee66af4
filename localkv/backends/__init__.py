"""Which op set the model runs on: ops_numpy on the CPU, ops_cupy on an NVIDIA GPU.

select(device) returns the backend module (ops_numpy or ops_cupy); the model, the block pool
(xp=ops.xp, dtype=ops.kv_dtype) and the weights (ops_cupy.upload_weights) follow from it.
"""

import ctypes
import importlib
import os
import sys

from localkv.backends import cpu as ops_numpy
from localkv.errors import LocalkvError

DEVICES = ("auto", "cpu", "cuda")
_NEED_CUPY = "--device cuda needs CuPy: pip install -e '.[gpu]' (CUDA 12) or '.[gpu13]' (CUDA 13)"


def select(device: str = "auto"):
    """The backend module for a --device value: "cpu", "cuda", or "auto" (cuda when CuPy
    imports and sees a GPU, else cpu). Raises LocalkvError with the reason when cuda cannot run."""
    d = (device or "auto").strip().lower()
    if d == "cpu":
        return ops_numpy
    if d == "cuda":
        return _cuda()
    if d == "auto":
        try:
            return _cuda()
        except LocalkvError:
            return ops_numpy
    raise LocalkvError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap, not a fresh mmap
TRIM_THRESHOLD = 64 << 20  # free memory the heap keeps before returning it to the OS
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep numpy's large temporaries (attention scores, FFN activations: 0.1-25 MB each) in the
    heap. glibc's default serves every allocation above 128 KiB, at first, from a fresh mmap
    and, later, from a heap it trims back to the OS, so the same temporaries are page-faulted in
    again layer after layer: a 512-token prefill of SmolLM2 took about 5,700 minor page faults
    (23 MB) per run in steady state, and none with this tuning. What that costs depends on the
    machine: on this VM first-touch memory ran at 0.5 GB/s at times (that prefill: 1,011 ms
    without, 815-850 ms with, attention 225 -> 160 ms) and at full speed at others (no
    difference). The heap keeps at most TRIM_THRESHOLD (64 MiB) of freed memory. Linux/glibc
    only; skipped when the user set MALLOC_*_ tunables. Returns whether it applied."""
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
            f"--device cuda: CuPy failed to import ({_first_line(e)})"
            + (
                f"; {shadow} shadows NVIDIA's 'cuda' package: run from another folder or set PYTHONSAFEPATH=1"
                if shadow
                else ""
            )
        ) from None
    except Exception as e:  # installed but broken (e.g. a CUDA library it needs is missing)
        raise LocalkvError(f"--device cuda: CuPy failed to import ({type(e).__name__}: {_first_line(e)})") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, driver too old, no device
        raise LocalkvError(
            f"--device cuda: no CUDA GPU visible ({_first_line(e)}; check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        ) from None
    if n < 1:
        raise LocalkvError("--device cuda: no CUDA GPU visible (0 devices; check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    try:
        from localkv.backends import cuda as ops_cupy
    except Exception as e:
        raise LocalkvError(
            f"--device cuda: the CuPy backend failed to load ({type(e).__name__}: {_first_line(e)})"
        ) from None
    return ops_cupy


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
