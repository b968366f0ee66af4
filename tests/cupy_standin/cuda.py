"""cupy.cuda on the CPU: one emulated device, streams and events that order nothing (every
emulated launch runs to completion before it returns), the runtime queries localkv makes."""

from __future__ import annotations

# the emulated device: an H200's SM count, as tests/cuda_emu/host.py assumes
ATTRIBUTES = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448, "WarpSize": 32}
PROPERTIES = {"name": b"localkv CUDA emulator (CPU)", "major": 9, "minor": 0, "totalGlobalMem": 1 << 36}
RUNTIME_VERSION = 12080  # what a cupy-cuda12x wheel reports


class Device:
    def __init__(self, device=None):
        device = 0 if device is None else int(device)
        if device != 0:
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device}")
        self.id = device

    @property
    def attributes(self) -> dict:
        return dict(ATTRIBUTES)

    @property
    def compute_capability(self) -> str:
        return f"{PROPERTIES['major']}{PROPERTIES['minor']}"

    def synchronize(self) -> None:
        pass

    def use(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class Stream:
    """Accepted where CuPy takes a stream; launches on the emulator are synchronous anyway."""

    null = None

    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.ptr = ptr

    def synchronize(self) -> None:
        pass

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


Stream.null = Stream(null=True)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def get_current_stream(device_id=-1) -> Stream:
    return Stream.null


def get_cuda_path() -> str | None:
    """No CUDA toolkit behind the emulated device."""
    return None


class runtime:
    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def runtimeGetVersion() -> int:
        return RUNTIME_VERSION

    @staticmethod
    def driverGetVersion() -> int:
        return RUNTIME_VERSION

    @staticmethod
    def getDeviceProperties(device: int) -> dict:
        Device(device)
        return dict(PROPERTIES)

    @staticmethod
    def deviceSynchronize() -> None:
        pass
