"""CUDA sources compiled for the CPU: the system C++ compiler with cuda_shim.h force-included in
front of the unchanged source, one shared library per source (as CuPy's RawModule is one module
per source), cached under a hash of everything that goes into it (compiler, flags, defines, the
source, the emulator's own files).

A preprocessing pass (-DLKV_EMU_SCAN) finds the kernels (non-template `__global__` functions), their
`__launch_bounds__` and parameter names, and the `extern __shared__` arrays; a generated translation
unit includes the source, defines those arrays and registers each kernel (emu_register.h)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNTIME = ("scheduler.cpp", "launch.cpp")
OWN_FILES = (
    *RUNTIME,
    "cuda_shim.h",
    "emu_register.h",
    "fiber.h",
    "runtime.h",
    "include/cuda_fp16.h",
    "include/cuda_runtime.h",
    "build.py",
)
FLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    "-fcf-protection=none",  # the fiber switch returns into a new stack: no shadow-stack marking
    "-U_FORTIFY_SOURCE",  # longjmp out of the fault handler crosses stacks
    "-ffp-contract=off",
    "-Wno-unknown-pragmas",
)


class BuildError(RuntimeError):
    """The C++ compiler rejected a source (the message holds its output)."""


@dataclass(slots=True, frozen=True)
class KernelInfo:
    name: str
    params: tuple[str, ...]  # parameter names as written in the source


@dataclass(slots=True, frozen=True)
class Built:
    library: Path
    kernels: dict[str, KernelInfo]


@cache
def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, c++ or clang++ on PATH; None when there is none."""
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def cache_dir() -> Path:
    if os.environ.get("LKV_CUDA_EMU_CACHE"):
        return Path(os.environ["LKV_CUDA_EMU_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localkv" / "cuda-emu"


@cache
def _compiler_id(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"{' '.join(cmd)}\n{(r.stderr or r.stdout)[-6000:]}")
    return r.stdout


def defines(options) -> tuple[str, ...]:
    """The options (NVRTC style, as CuPy takes them) that mean something on the CPU: -D and -I.
    Others (--std, -arch, --use_fast_math, ...) are dropped."""
    out = []
    for o in options:
        if o.startswith("--define-macro="):
            out.append("-D" + o.split("=", 1)[1])
        elif o.startswith("--include-path="):
            out.append("-I" + o.split("=", 1)[1])
        elif o.startswith(("-D", "-I")):
            out.append(o)
    return tuple(out)


def _base_cmd(cxx: str, extra: tuple[str, ...]) -> list[str]:
    """Our include folder first, so that <cuda_fp16.h> is the shim's even when `extra` names a
    CUDA toolkit's include folder (cuda.py passes one to NVRTC)."""
    return [cxx, *FLAGS, "-I", str(HERE / "include"), "-I", str(HERE), *extra]


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _own_files_hash() -> str:
    return _hash(*[(HERE / f).read_bytes() for f in OWN_FILES])


def _atomic_write(path: Path, produce) -> None:
    """produce(tmp_path) writes a file; it replaces `path` in one step (parallel builds are safe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    os.close(fd)
    try:
        produce(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _runtime_objects(cxx: str, extra: tuple[str, ...]) -> list[Path]:
    """scheduler.o and launch.o, which every module links (built once per compiler and flags)."""
    key = _hash(_compiler_id(cxx), FLAGS, extra, _own_files_hash())
    out = [cache_dir() / f"runtime-{key}" / f"{Path(f).stem}.o" for f in RUNTIME]

    def compile_one(src: str, obj: Path) -> None:
        _atomic_write(obj, lambda t: _run([*_base_cmd(cxx, extra), "-c", str(HERE / src), "-o", str(t)]))

    missing = [(f, o) for f, o in zip(RUNTIME, out) if not o.exists()]
    with ThreadPoolExecutor(max_workers=max(1, len(missing))) as ex:
        for f in [ex.submit(compile_one, *m) for m in missing]:
            f.result()
    return out


# ---------------------------------------------------------------- finding the kernels

_BOUNDS = r"(?:__lkv_lb__\s*\((?P<{}>(?:[^()]|\([^()]*\))*)\)\s*)?"
_KERNEL = re.compile(
    r"__lkv_global__\s+"
    + _BOUNDS.format("lb1")
    + r"void\s+"
    + _BOUNDS.format("lb2")
    + r"(?P<name>\w+)\s*\((?P<params>(?:[^()]|\([^()]*\))*)\)\s*\{"
)
_DYN_SHARED = re.compile(
    r"extern\s+__lkv_shared__\s+(?:__attribute__\s*\(\(.*?\)\)\s*)?(?P<type>[\w\s:]+?)\s+"
    r"(?:__attribute__\s*\(\(.*?\)\)\s*)?(?P<name>\w+)\s*\[\s*\]"
)
_TEMPLATE_BEFORE = re.compile(r"template\s*<[^;{}]*>\s*(?:extern\s*\"C\"\s*)?$")


def _split_top(text: str, opening: str = "([<", closing: str = ")]>") -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in opening) - (ch in closing)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur] if cur.strip() else parts


def scan(cxx: str, source: Path, defs: tuple[str, ...]) -> tuple[list[tuple[str, str, tuple[str, ...]]], dict]:
    """([(kernel, max threads expression, parameter names)], {extern __shared__ name: type})."""
    shim = str(HERE / "cuda_shim.h")
    text = _run([*_base_cmd(cxx, defs), "-E", "-P", "-x", "c++", "-DLKV_EMU_SCAN", "-include", shim, str(source)])
    kernels = []
    for m in _KERNEL.finditer(text):
        if _TEMPLATE_BEFORE.search(text[max(0, m.start() - 400) : m.start()]):
            continue  # a template kernel has no unmangled name to launch by
        bounds = m.group("lb1") or m.group("lb2")
        bounds = _split_top(bounds, "([", ")]")[0] if bounds else "1024"
        params = [p.strip() for p in _split_top(m.group("params"))]
        names = tuple(re.findall(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", p)[0] for p in params if p and p != "void")
        kernels.append((m.group("name"), bounds, names))
    dyn = {m.group("name"): " ".join(m.group("type").split()) for m in _DYN_SHARED.finditer(text)}
    return kernels, dyn


def _unit(source: Path, kernels, dyn) -> str:
    lines = [
        f"// generated by {Path(__file__).name} for {source.name}",
        f'#include "{source}"',
        '#include "emu_register.h"',
    ]
    lines += [f"alignas(16) thread_local {t} {n}[LKV_EMU_DYN_SMEM_BYTES / sizeof({t})];" for n, t in dyn.items()]
    lines += [f"LKV_EMU_KERNEL({name}, ({bounds}))" for name, bounds, _ in kernels]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- building


def build_source(code: str, name: str = "module", options=(), extra_flags: tuple[str, ...] = ()) -> Built:
    """The shared library for CUDA source `code` (built now, or found in the cache). The cache is
    keyed by content only; `name` just labels the caller's module."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    defs = (*defines(options), *extra_flags)
    key = _hash(_compiler_id(cxx), FLAGS, defs, code, _own_files_hash())
    folder = cache_dir() / f"module-{key}"  # by content only: the tests and the CuPy stand-in share builds
    lib, meta = folder / "module.so", folder / "kernels.json"
    if not (lib.exists() and meta.exists()):
        objects = _runtime_objects(cxx, extra_flags)
        src = folder / "source.cu"
        _atomic_write(src, lambda t: t.write_text(code, encoding="utf-8"))
        kernels, dyn = scan(cxx, src, defs)
        unit = folder / "unit.cpp"
        _atomic_write(unit, lambda t: t.write_text(_unit(src, kernels, dyn), encoding="utf-8"))
        obj = folder / "unit.o"
        compile_unit = [*_base_cmd(cxx, defs), "-include", str(HERE / "cuda_shim.h"), "-c", str(unit), "-o"]
        _atomic_write(obj, lambda t: _run([*compile_unit, str(t)]))
        _atomic_write(lib, lambda t: _run([cxx, "-shared", "-pthread", str(obj), *map(str, objects), "-o", str(t)]))
        _atomic_write(meta, lambda t: t.write_text(json.dumps({k: list(p) for k, _, p in kernels}), encoding="utf-8"))
    params = json.loads(meta.read_text(encoding="utf-8"))
    return Built(lib, {k: KernelInfo(k, tuple(p)) for k, p in params.items()})


def build_files(paths, options=(), extra_flags: tuple[str, ...] = ()) -> dict[str, Built]:
    """build_source() for several .cu files at once, in parallel; keyed by file name."""
    paths = [Path(p) for p in paths]
    cxx = compiler()
    if cxx is not None:
        _runtime_objects(cxx, extra_flags)  # once, before the parallel builds that link it
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as ex:
        futures = {
            p.name: ex.submit(build_source, p.read_text(encoding="utf-8"), p.stem, options, extra_flags) for p in paths
        }
        return {name: f.result() for name, f in futures.items()}
