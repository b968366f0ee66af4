"""The packed weights (formats/packed) kept on disk, one folder per model under
LOCALKV_HOME/packed, and mapped read-only.

Why: the packed copy is as large as the weights it packs. Mapped from a file it lives in the
page cache, shared between the processes that run the model and given back under memory
pressure, not in each process's private memory; and a later start maps it instead of packing
again. A Q4_K or Q6_K file's own pages are then read only for embedding rows; Q4_0, Q4_1 and
Q8_0 read theirs in passes of more rows (quant.compiled.PACKED_ROWS: a prefill) too. Where the
folder cannot be written, the packed copy stays in the process's memory.
"""

import contextlib
import os
import re
from pathlib import Path

import numpy as np

from localkv.backends.cpu.formats.packed import FORMAT, TYPES, pack, packed_shape
from localkv.backends.cpu.quant.tensor import QStack, QTensor
from localkv.home import home, private_dir, sweep_stale

_TEMP = re.compile(r"\..+\.tmp-\d+")


def folder(fingerprint: str) -> Path:
    """Where the packed weights of the model with this fingerprint are kept."""
    return home() / "packed" / f"{fingerprint[:32]}-{FORMAT}"


def remove(fingerprint: str) -> int:
    """Delete the model's packed weights; bytes freed (0 when there were none)."""
    d, freed = folder(fingerprint), 0
    with contextlib.suppress(OSError), os.scandir(d) as it:
        for e in it:
            with contextlib.suppress(OSError):
                size = e.stat(follow_symlinks=False).st_size
                os.unlink(e.path)
                freed += size
    with contextlib.suppress(OSError):
        d.rmdir()
    return freed


def attach(weights: dict, fingerprint: str, wanted) -> None:
    """Give each tensor of a packed type (formats/packed) among weights for which wanted(qtype) holds its packed
    form: mapped from the model's folder, packed and written there first when missing; packed
    in memory when there is no fingerprint or the folder cannot be written."""
    d = folder(fingerprint) if fingerprint else None
    if d is not None:
        sweep_stale(d, _TEMP)
    for key, w in weights.items():
        tensors = w.tensors if isinstance(w, QStack) else (w,) if isinstance(w, QTensor) else ()
        for i, t in enumerate(tensors):
            if t.qtype not in TYPES or not wanted(t.qtype):
                continue
            if d is None:
                t.packed()
                continue
            path = d / f"{key}.{i}.{t.qtype.lower()}"
            shape = packed_shape(t.qtype, t.rows, t.cols)
            mapped = _mapped(path, shape)
            if mapped is None:
                made = pack(t.qtype, t.data)
                mapped = _mapped(path, shape) if _write(path, made) else None
                mapped = made if mapped is None else mapped
            t.use_packed(mapped)


def _mapped(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """The file as a read-only array of shape, or None when it is missing or of another size."""
    try:
        if path.stat().st_size != shape[0] * shape[1]:
            return None
        return np.memmap(path, np.uint8, "r", shape=shape).view(np.ndarray)
    except (OSError, ValueError):
        return None


def _write(path: Path, a: np.ndarray) -> bool:
    """a's bytes into path, whole or not at all (a temporary renamed); False when it cannot."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        private_dir(path.parent)
        with open(temp, "wb") as f:
            a.tofile(f)
        os.replace(temp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink()
        return False
