"""The GPU backend's kernels (cuda/*.cu) compile for sm_80 and sm_90, no GPU needed:
- with nvcc when it is on PATH (skipped otherwise);
- with NVRTC, the compiler CuPy's RawModule uses at run time, when libnvrtc can be found (skipped
  otherwise), with the options the backend passes; and every kernel name the backend launches
  (localkv/backends/cuda_kernels.py: KERNELS) is in the compiled code, unmangled (extern "C")."""

import ast
import ctypes
import ctypes.util
import glob
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "cuda").glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
NVCC = shutil.which("nvcc")


BACKEND = ROOT / "localkv" / "backends" / "cuda_kernels.py"


def _backend_constant(name: str):
    """A literal module constant of cuda_kernels.py, read without importing it (no CuPy here)."""
    tree = ast.parse(BACKEND.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"cuda_kernels.{name} not found")


KERNELS = _backend_constant("KERNELS")


def _cuda_roots() -> list[Path]:
    roots = [Path(os.environ[v]) for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    if NVCC:
        roots.append(Path(NVCC).resolve().parent.parent)
    roots.append(Path("/usr/local/cuda"))
    for sp in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        roots += [Path(p) for p in glob.glob(os.path.join(sp, "nvidia", "*"))]  # pip CUDA wheels
    return [r for r in roots if r.is_dir()]


def _include_dir() -> Path | None:
    for r in _cuda_roots():
        for inc in (r / "include", r / "targets" / "x86_64-linux" / "include"):
            if (inc / "cuda_fp16.h").is_file():
                return inc
    return None


def test_every_source_is_listed():
    assert {p.name for p in SOURCES} == set(KERNELS), "cuda/*.cu and cuda_kernels.KERNELS disagree"


# ---------------------------------------------------------------- nvcc


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(src, tmp_path):
    """For every arch of ARCHS in one nvcc run (the host side is compiled once)."""
    inc = _include_dir()
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    cmd = [
        NVCC,
        "-std=c++17",
        *gencode,
        "-c",
        str(src),
        "-o",
        str(tmp_path / f"{src.stem}.o"),
        "-Werror",
        "all-warnings",
        *(["-I", str(inc)] if inc else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / f"{src.stem}.o").stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_ptx_has_every_kernel(src, tmp_path):
    inc = _include_dir()
    ptx = tmp_path / f"{src.stem}.ptx"
    cmd = [NVCC, "-std=c++17", "-arch=sm_80", "--ptx", str(src), "-o", str(ptx), *(["-I", str(inc)] if inc else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    entries = {
        line.split()[2].split("(")[0] for line in ptx.read_text().splitlines() if line.startswith(".visible .entry")
    }
    missing = set(KERNELS[src.name]) - entries
    assert not missing, f"{src.name}: kernels the backend launches are not in the PTX: {sorted(missing)}"


# ---------------------------------------------------------------- NVRTC (what CuPy runs)


def _nvrtc():
    names = []
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    for r in _cuda_roots():
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
            names += sorted(glob.glob(str(r / lib / "libnvrtc.so*")))
    for n in names:
        if "builtins" in n or ".alt." in n:
            continue
        try:
            # libnvrtc dlopens its builtins library by name: load the one beside it first
            for b in sorted(glob.glob(os.path.join(os.path.dirname(n), "libnvrtc-builtins.so*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


NVRTC = _nvrtc()


def _nvrtc_compile(src: Path, arch: str) -> bytes:
    lib = NVRTC
    prog = ctypes.c_void_p()
    code = src.read_bytes()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), code, src.name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        inc = _include_dir()
        opts = [
            "--std=c++17",
            f"-arch={arch}",
            "--device-as-default-execution-space",
            *_backend_defines(),
            *([f"-I{inc}"] if inc else []),
        ]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        log_text = log.value.decode(errors="replace")
        assert rc == 0, f"NVRTC failed on {src.name} for {arch} ({' '.join(opts)}):\n{log_text}"
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetCUBIN(prog, cubin) == 0
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _backend_defines() -> list[str]:
    """cuda_kernels.DEFINES, rebuilt from its literal constants (-DLKV_<NAME>=<value>)."""
    tree = ast.parse(BACKEND.read_text(encoding="utf-8"))
    vals = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        target = node.targets[0]
        names = [t.id for t in target.elts] if isinstance(target, ast.Tuple) else [getattr(target, "id", "")]
        if any(n.endswith(("_WARPS", "_TILE", "_LANES")) for n in names):
            values = ast.literal_eval(node.value)
            vals.update(zip(names, values) if len(names) > 1 else [(names[0], values)])
    assert {"DECODE_WARPS", "QMV_WARPS", "QMV_LANES"} <= set(vals), "cuda_kernels' warp/tile constants not found"
    return [f"-DLKV_{k}={v}" for k, v in vals.items()]


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (CUDA toolkit or the nvidia-cuda-nvrtc wheel)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compiles_with_the_backend_options(src, arch):
    cubin = _nvrtc_compile(src, arch)
    missing = [k for k in KERNELS[src.name] if k.encode() + b"\0" not in cubin]
    assert not missing, f"{src.name}: kernels not in the NVRTC cubin: {missing}"
