"""CUDA kernels run on the CPU: cuda_shim.h lets the system C++ compiler build a .cu file unchanged
(build.py), launch.py launches its kernels from Python as CuPy's RawModule / RawKernel would, on
numpy arrays."""

from .build import BuildError, build_files, build_source, compiler
from .launch import LAUNCHED, SETTINGS, Kernel, KernelError, Module, Settings, settings

__all__ = [
    "LAUNCHED",
    "SETTINGS",
    "BuildError",
    "Kernel",
    "KernelError",
    "Module",
    "Settings",
    "build_files",
    "build_source",
    "compiler",
    "settings",
]
