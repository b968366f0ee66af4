"""The memory guard: before a model loads, will its weights and KV pool fit in the memory this
machine has available? If not, one line with the sizes and what to change, instead of a
machine that swaps itself to a halt or an out-of-memory kill halfway through loading.

Weights are mapped from the file in place (a GGUF, or a directory's *.safetensors), so their
resident size is the file size; the KV pool is --kv-mem; OVERHEAD covers the interpreter,
numpy/numba and the forward pass's buffers. Available memory is /proc/meminfo's MemAvailable
(Linux); where there is none the guard does not run. LOCALKV_NO_MEMORY_GUARD=1 turns it off.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from localkv.errors import LocalkvError
from localkv.units import format_size

OVERHEAD = 512 << 20  # the process without model or KV, plus activations: measured, with margin
MEMINFO = Path("/proc/meminfo")
OFF = "LOCALKV_NO_MEMORY_GUARD"


class NotEnoughMemory(LocalkvError):
    """The model and its KV pool would not fit in the memory available."""


@dataclass(frozen=True, slots=True)
class Estimate:
    weights: int
    kv: int
    overhead: int = OVERHEAD

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead


def weights_bytes(path: Path) -> int:
    """What the model's weights occupy once mapped: the GGUF's size, or a directory's safetensors."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())
    return path.stat().st_size


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None where unknown."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "MemAvailable":
                    number, _, unit = value.strip().partition(" ")
                    return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def estimate(path: Path, kv_mem: int) -> Estimate:
    return Estimate(weights_bytes(path), kv_mem)


def check_fits(path: Path, kv_mem: int, kv_on_host: bool = True):
    """Raise NotEnoughMemory when the model at path with a KV pool of kv_mem bytes (in host
    memory unless kv_on_host is False: a GPU's pool) would not fit in the available memory."""
    if os.environ.get(OFF, "").strip() not in ("", "0"):
        return
    avail = available_memory()
    if avail is None:
        return
    need = estimate(path, kv_mem if kv_on_host else 0)
    if need.total <= avail:
        return
    raise NotEnoughMemory(
        f"{Path(path).name} needs about {_sizes(need)}, {format_size(avail)} is available: {_advice(need, avail)}"
    )


def _sizes(e: Estimate) -> str:
    kv = f" + KV pool {format_size(e.kv)}" if e.kv else ""
    return f"{format_size(e.total)} (weights {format_size(e.weights)}{kv} + {format_size(e.overhead)} runtime)"


def _advice(e: Estimate, avail: int) -> str:
    """What to change: a smaller --kv-mem when that alone is enough, else a smaller quant or model."""
    room_for_kv = avail - e.weights - e.overhead
    off = f"(or set {OFF}=1 to load anyway)"
    if e.kv and room_for_kv >= 64 << 20:
        return f"lower --kv-mem to {_round_down(room_for_kv)} or less, or use a smaller quant {off}"
    return f"use a smaller quant or model (the weights alone need {format_size(e.weights)}), free memory {off}"


def _round_down(n: int) -> str:
    """A --kv-mem value a user can type: whole MiB, or whole GiB past 4 GiB."""
    return f"{n >> 30}GiB" if n >= 4 << 30 else f"{n >> 20}MiB"
