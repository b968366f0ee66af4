"""Launching emulated kernels from Python the way CuPy does: `Module(code=..., options=...)` is
`cupy.RawModule`, `module.get_function(name)` a kernel called as `kernel(grid, block, args,
shared_mem=0)`, numpy arrays standing in for device arrays.

Arguments are checked against the kernel's parameter types (a GPU would read garbage instead):
a pointer takes an array (anything with __array_interface__) of the pointee's dtype, passed as the
address of its first element whatever its strides, as CuPy passes an ndarray; a scalar takes a
numpy scalar of exactly the parameter's type, or a Python bool / int / float, which CuPy passes as
bool / int64 / float64. With SETTINGS.guard (the default) every buffer the pointers reach is copied
into fresh memory between guard pages for the launch (read-only arrays into read-only memory), so
an access up to 1 MiB before or after a buffer, or a write to a read-only one, raises KernelError
naming the argument; the copies go back into the arrays afterwards."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    byte_bounds = np.byte_bounds

from . import build

_SCALARS = {
    "i1": ctypes.c_int8,
    "i2": ctypes.c_int16,
    "i4": ctypes.c_int32,
    "i8": ctypes.c_int64,
    "u1": ctypes.c_uint8,
    "u2": ctypes.c_uint16,
    "u4": ctypes.c_uint32,
    "u8": ctypes.c_uint64,
    "f4": ctypes.c_float,
    "f8": ctypes.c_double,
    "b1": ctypes.c_bool,
    "f2": ctypes.c_uint16,
}
_CTYPES = {"i4": "int", "i8": "long long", "u4": "unsigned", "u8": "unsigned long long", "f4": "float", "f8": "double"}
_CTYPES |= {"f2": "__half", "h2": "__half2", "b1": "bool", "v": "void"}
_ORDERS = {"forward": 0, "reverse": 1, "random": 2}
LAUNCHED: Counter[str] = Counter()  # launches per kernel name in this process


class KernelError(RuntimeError):
    """A launch failed: refused (code 2, bad configuration), or the kernel hit something a GPU
    leaves undefined or faults on (1: deadlock, bad collective, misalignment; 3: memory fault)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Settings:
    workers: int = min(2, os.cpu_count() or 1)  # OS threads that take blocks in parallel
    order: str = "forward"  # the order a block's threads take turns in: forward, reverse, random
    seed: int = 0  # for order="random"
    guard: bool = True  # guard-paged copies of the buffers (see the module docstring)


SETTINGS = Settings()


@contextlib.contextmanager
def settings(**changes):
    """SETTINGS with some fields changed, for the duration of a with block."""
    saved = dataclasses.replace(SETTINGS)
    for name, value in changes.items():
        setattr(SETTINGS, name, value)
    try:
        yield SETTINGS
    finally:
        for f in dataclasses.fields(Settings):
            setattr(SETTINGS, f.name, getattr(saved, f.name))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    u64, vp = ctypes.c_ulonglong, ctypes.c_void_p
    lib.lkv_emu_launch.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        u64,
        ctypes.POINTER(vp),
        ctypes.c_int,
        ctypes.c_int,
        u64,
        ctypes.c_char_p,
        u64,
        ctypes.POINTER(ctypes.c_longlong),
    ]
    lib.lkv_emu_kernel_name.restype = lib.lkv_emu_kernel_signature.restype = ctypes.c_char_p
    lib.lkv_emu_guard_alloc.argtypes = [u64, u64, ctypes.POINTER(vp), ctypes.POINTER(u64)]
    lib.lkv_emu_guard_alloc.restype = vp
    lib.lkv_emu_guard_readonly.argtypes = lib.lkv_emu_guard_free.argtypes = [vp, u64]
    lib.lkv_emu_guard_check.argtypes = [vp, u64, vp, u64]
    lib.lkv_emu_guard_check.restype = ctypes.c_longlong
    lib.lkv_emu_dyn_smem_bytes.restype = lib.lkv_emu_guard_bytes.restype = u64
    return lib


class Module:
    """cupy.RawModule on the CPU: `code` (a .cu source) compiled by build.build with `options`
    (only -D/-I matter here)."""

    def __init__(self, code: str, options=(), name: str = "module", extra_flags: tuple[str, ...] = ()):
        self._init(build.build_source(code, name, options, extra_flags))

    @classmethod
    def from_built(cls, built: build.Built) -> Module:
        m = cls.__new__(cls)
        m._init(built)
        return m

    def _init(self, built: build.Built) -> None:
        self.lib = _bind(ctypes.CDLL(str(built.library)))
        self.kernels: dict[str, Kernel] = {}
        for i in range(self.lib.lkv_emu_kernel_count()):
            name = self.lib.lkv_emu_kernel_name(i).decode()
            sig = self.lib.lkv_emu_kernel_signature(i).decode()
            codes = tuple(sig.split(",")) if sig else ()
            info = built.kernels.get(name)
            params = (
                info.params if info and len(info.params) == len(codes) else tuple(f"arg{j}" for j in range(len(codes)))
            )
            self.kernels[name] = Kernel(self, name, codes, params, self.lib.lkv_emu_kernel_max_threads(i))

    def get_function(self, name: str) -> Kernel:
        if name not in self.kernels:
            raise KeyError(f"no kernel {name!r} in this module (it has {', '.join(sorted(self.kernels))})")
        return self.kernels[name]


@dataclass(slots=True)
class _Region:
    """One buffer the kernel may reach: [lo, hi) in the caller's memory, its guarded copy."""

    lo: int
    hi: int
    writable: bool
    roots: list  # the arrays whose memory this is (kept alive until the copy goes back)
    args: list  # indices of the pointer arguments that point into it
    lib: ctypes.CDLL | None = None
    copy: int = 0
    base: ctypes.c_void_p | None = None
    length: int = 0


class Kernel:
    """cupy.RawKernel on the CPU: kernel(grid, block, args, shared_mem=0)."""

    def __init__(self, module: Module, name: str, codes: tuple[str, ...], params: tuple[str, ...], max_threads: int):
        self.module, self.name, self.codes, self.params = module, name, codes, params
        self.max_threads_per_block = max_threads
        self.max_dynamic_shared_size_bytes = 48 << 10  # CuPy's attribute: raise it to opt in, as on a GPU

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None, settings: Settings | None = None):
        """Runs the kernel to completion (`stream` is accepted as CuPy takes it, and ignored)."""
        s = settings or SETTINGS
        grid, block = _dims(grid), _dims(block)
        if len(args) != len(self.codes):
            raise TypeError(
                f"{self.name} takes {len(self.codes)} arguments ({', '.join(self.params)}), got {len(args)}"
            )
        if shared_mem > self.max_dynamic_shared_size_bytes:
            limit = self.max_dynamic_shared_size_bytes
            msg = f"{shared_mem} bytes of dynamic shared memory, over max_dynamic_shared_size_bytes ({limit})"
            raise KernelError(f"{self.name}: {msg}", 2)
        arrays, values = {}, []
        for i, (code, a) in enumerate(zip(self.codes, args)):
            if code.startswith("*"):
                arrays[i] = self._array(i, code, a)
                values.append(ctypes.c_void_p(arrays[i].ctypes.data))
            else:
                values.append(self._scalar(i, code, a))
        regions = _guard(self, arrays, values) if s.guard else []
        try:
            self._launch(grid, block, shared_mem, values, s, regions)
            _check_slack(self, regions)
        finally:
            _release(regions)
        LAUNCHED[self.name] += 1

    def _launch(self, grid, block, shared_mem, values, s: Settings, regions) -> None:
        ptrs = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        err = ctypes.create_string_buffer(1024)
        fault = (ctypes.c_longlong * 2)()
        dims = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block)
        order = _ORDERS[s.order]
        rc = self.module.lib.lkv_emu_launch(
            self.name.encode(), *dims, shared_mem, ptrs, s.workers, order, s.seed, err, len(err), fault
        )
        if rc:
            msg = err.value.decode(errors="replace")
            if rc == 3:
                msg += _where(self, regions, fault[0], fault[1])
            raise KernelError(f"{self.name}{tuple(grid)}x{tuple(block)}: {msg}", rc)

    def _array(self, i: int, code: str, a) -> np.ndarray:
        if not isinstance(a, np.ndarray):
            if not hasattr(a, "__array_interface__"):
                what = f"{self.name} argument {i} ({self.params[i]})"
                raise TypeError(f"{what} is a pointer: pass an array, not {type(a).__name__}")
            a = np.asarray(a)
        want, got = code.lstrip("*c"), _code(a.dtype)
        ok = want in ("v", got) or (want == "h2" and got == "f2") or (want.startswith("x") and a.dtype.kind == "V")
        if not ok:
            raise TypeError(
                f"{self.name} argument {i} ({self.params[i]}) points to {_ctype(want)}: got a {a.dtype} array"
            )
        if not code.startswith("*c") and not a.flags.writeable:
            raise TypeError(f"{self.name} argument {i} ({self.params[i]}) is written through: got a read-only array")
        return a

    def _scalar(self, i: int, code: str, a):
        if isinstance(a, np.generic):
            got = _code(a.dtype)
        elif isinstance(a, bool):
            got = "b1"
        elif isinstance(a, int):
            got = "u8" if a >= 1 << 63 else "i8"
        elif isinstance(a, float):
            got = "f8"
        else:
            raise TypeError(f"{self.name} argument {i} ({self.params[i]}) takes {_ctype(code)}, got {type(a).__name__}")
        if got != code:
            raise TypeError(
                f"{self.name} argument {i} ({self.params[i]}) takes {_ctype(code)}, got {_ctype(got)} "
                "(CuPy passes Python int as int64, float as float64; pass e.g. np.int32(...))"
            )
        if code == "f2":
            return ctypes.c_uint16(int(np.float16(a).view(np.uint16)))
        return _SCALARS[code](a.item() if isinstance(a, np.generic) else a)


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"grid/block must have 1 to 3 dimensions, got {d}")
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


def _code(dtype: np.dtype) -> str:
    return "f2" if dtype == np.float16 else f"{dtype.kind}{dtype.itemsize}"


def _ctype(code: str) -> str:
    return _CTYPES.get(code, code)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _guard(kernel: Kernel, arrays: dict[int, np.ndarray], values: list) -> list[_Region]:
    """Copies the buffers the pointer arguments reach into guard-paged memory and points the
    arguments there. Arguments sharing a buffer share one copy (overlapping buffers merge)."""
    spans = []
    for i, a in arrays.items():
        root = _root(a)
        lo, hi = byte_bounds(root)
        spans.append((lo, hi, root.flags.writeable, root, i))
    regions: list[_Region] = []
    for lo, hi, w, root, i in sorted(spans, key=lambda s: s[0]):
        if regions and lo < regions[-1].hi:
            r = regions[-1]
            r.hi, r.writable = max(r.hi, hi), r.writable and w
            r.roots.append(root)
            r.args.append(i)
        else:
            regions.append(_Region(lo, hi, w, [root], [i], kernel.module.lib))
    lib = kernel.module.lib
    try:
        for r in regions:
            n = r.hi - r.lo
            base, length = ctypes.c_void_p(), ctypes.c_ulonglong()
            align = max(16, min(256, n & -n)) if n else 256
            r.copy = lib.lkv_emu_guard_alloc(n, align, ctypes.byref(base), ctypes.byref(length))
            if not r.copy:
                raise MemoryError(f"cannot map {n} bytes with guard pages")
            r.base, r.length = base, length.value
            ctypes.memmove(r.copy, r.lo, n)
            if not r.writable:
                lib.lkv_emu_guard_readonly(base, length)
            for i in r.args:
                values[i].value = r.copy + (arrays[i].ctypes.data - r.lo)
    except BaseException:
        _release(regions)
        raise
    return regions


def _release(regions: list[_Region]) -> None:
    """Copies writable buffers back into the arrays and unmaps the copies."""
    for r in regions:
        if r.base is None:
            continue
        if r.writable:
            ctypes.memmove(r.lo, r.copy, r.hi - r.lo)
        r.lib.lkv_emu_guard_free(r.base, r.length)
        r.base = None


def _check_slack(kernel: Kernel, regions: list[_Region]) -> None:
    """Writes just outside a buffer that did not reach a guard page (the canary bytes changed)."""
    for r in regions:
        k = r.lib.lkv_emu_guard_check(r.base, r.length, r.copy, r.hi - r.lo)
        if k:
            names = ", ".join(f"argument {i} ({kernel.params[i]})" for i in r.args)
            where = f"{-k} bytes before the start" if k < 0 else f"{k - 1} bytes past the end"
            raise KernelError(f"{kernel.name}: a write {where} of the buffer of {names} ({r.hi - r.lo} bytes)", 3)


def _where(kernel: Kernel, regions: list[_Region], addr: int, write: int) -> str:
    """Which argument's buffer a faulting address belongs to."""
    addr &= (1 << 64) - 1
    guard = kernel.module.lib.lkv_emu_guard_bytes()
    for r in regions:
        n = r.hi - r.lo
        start, end = r.copy, r.copy + n
        names = ", ".join(f"argument {i} ({kernel.params[i]})" for i in r.args)
        if start <= addr < end:
            what = "a write into the read-only buffer" if write and not r.writable else "an access inside the buffer"
            return f"; {what} of {names}, byte {addr - start} of {n}"
        if end <= addr < end + guard:
            return f"; {addr - end} bytes past the end of the buffer of {names} ({n} bytes)"
        if start - guard <= addr < start:
            return f"; {start - addr} bytes before the start of the buffer of {names} ({n} bytes)"
    return "; the address is in none of the arguments' buffers"
