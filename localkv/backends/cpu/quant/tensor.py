"""QTensor (one weight matrix in its GGUF encoding) and QStack (weights multiplied by the same
activations, outputs side by side: q, k, v; gate, up), with their kernel calls worked out once
when they are made, since a decode step makes about two hundred of them."""

from dataclasses import dataclass, field

import numpy as np

from localkv.backends.cpu.formats.packed import pack, packed_shape
from localkv.backends.cpu.formats.types import BLOCK_TYPES, FLOAT_TYPES, block_size

SUPPORTED: frozenset[str] = frozenset(BLOCK_TYPES + FLOAT_TYPES)
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_NO_ROWS: dict = {}  # dtype -> read-only [0, 1] array: a kernel's unused weight slots


@dataclass(frozen=True, slots=True)
class KernelRun:
    """One kernel call: up to three weights of one type, their outputs from column col."""

    qtype: str
    tensors: tuple
    datas: tuple  # three arrays as the kernel reads them, zero-row ones in unused slots
    offs: tuple  # the output column of each slot
    col: int
    rows: int
    packs: list = field(default_factory=list, compare=False)  # [packed()'s tuple], once made

    def packed(self) -> tuple:
        """The slots' packed weights (formats/packed; a [0, 1] array for unused slots), made on
        first use."""
        if not self.packs:
            made = [t.packed() for t in self.tensors]
            self.packs.append(tuple(made + [_no_rows(np.uint8)] * (3 - len(made))))
        return self.packs[0]


@dataclass(frozen=True, slots=True)
class QTensor:
    """One weight matrix in its GGUF encoding, [rows=out, cols=in]. data: block types uint8
    [rows, row_bytes] (a read-only view into an mmap); F32 float32, F16 float16, BF16 uint16,
    all [rows, cols]. Rows must be C-contiguous; writable data is replaced by a read-only view."""

    data: np.ndarray
    qtype: str
    shape: tuple[int, int]
    kdata: np.ndarray = field(init=False, repr=False, compare=False)  # what the kernels read
    runs: tuple = field(init=False, repr=False, compare=False)
    _packed: list = field(init=False, repr=False, compare=False)  # [pack(data)] once made

    def __post_init__(self):
        rows, cols = self.shape
        want = _data_shape(self.qtype, rows, cols)
        dtype = np.uint8 if self.qtype in BLOCK_TYPES else _FLOAT_DTYPES[self.qtype]
        if self.data.dtype != dtype or self.data.shape != want or not self.data.flags.c_contiguous:
            raise ValueError(
                f"{self.qtype} weight {rows}x{cols} needs C-contiguous {np.dtype(dtype).name} data of shape {want},"
                f" got {self.data.dtype.name} {self.data.shape}"
            )
        data = self.data
        if data.flags.writeable:
            data = data.view()
            data.flags.writeable = False
            object.__setattr__(self, "data", data)
        object.__setattr__(self, "kdata", data.view(np.uint16) if self.qtype == "F16" else data)
        object.__setattr__(self, "runs", _kernel_runs((self,)))
        object.__setattr__(self, "_packed", [])

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    def packed(self) -> np.ndarray:
        """The weight repacked for the 16-lane kernels (formats/packed.pack: Q4_K, Q6_K, Q4_0, Q4_1, Q8_0),
        made on first use and kept: a copy in the process's memory beside the file's pages."""
        if not self._packed:
            self.use_packed(pack(self.qtype, self.data))
        return self._packed[0]

    def use_packed(self, p: np.ndarray) -> None:
        """Take p (formats/packed.pack of this weight, e.g. mapped from a file) as the packed form."""
        want = packed_shape(self.qtype, self.rows, self.cols)
        if p.dtype != np.uint8 or p.shape != want or not p.flags.c_contiguous:
            raise ValueError(f"a packed {self.qtype} {self.shape} weight is uint8 {want}, got {p.dtype.name} {p.shape}")
        if p.flags.writeable:
            p = p.view()
            p.flags.writeable = False  # one array type in the kernel's tuple with the unused slots'
        self._packed[:] = [p]


@dataclass(frozen=True, slots=True)
class QStack:
    """Weights of the same cols multiplied by the same activations; matmul_few gives their
    outputs side by side [R, sum of rows], in one kernel call per run of up to three weights
    of one type."""

    tensors: tuple
    shape: tuple[int, int] = field(init=False)
    runs: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ts = tuple(self.tensors)
        if not ts or not all(isinstance(t, QTensor) and t.cols == ts[0].cols for t in ts):
            raise ValueError("a QStack needs one or more QTensors of the same cols")
        object.__setattr__(self, "tensors", ts)
        object.__setattr__(self, "shape", (sum(t.rows for t in ts), ts[0].cols))
        object.__setattr__(self, "runs", _kernel_runs(ts))

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]


def _data_shape(qtype: str, rows: int, cols: int) -> tuple[int, int]:
    if qtype not in SUPPORTED:
        raise ValueError(f"weight type {qtype} is not supported (supported: {', '.join(sorted(SUPPORTED))})")
    if rows < 1 or cols < 1:
        raise ValueError(f"weight shape {rows}x{cols} is empty")
    if qtype in FLOAT_TYPES:
        return rows, cols
    values, nbytes = block_size(qtype)
    if cols % values:
        raise ValueError(f"{qtype} weight rows of {cols} values are not whole blocks of {values}")
    return rows, cols // values * nbytes


def _no_rows(dtype) -> np.ndarray:
    a = _NO_ROWS.get(dtype)
    if a is None:
        a = np.zeros((0, 1), dtype)
        a.flags.writeable = False
        _NO_ROWS[dtype] = a
    return a


def _kernel_runs(ts: tuple) -> tuple:
    """Consecutive weights of one type, at most three per run."""
    groups: list[list] = []
    for t in ts:
        if groups and groups[-1][0].qtype == t.qtype and len(groups[-1]) < 3:
            groups[-1].append(t)
        else:
            groups.append([t])
    runs, col = [], 0
    for g in groups:
        datas, offs, c = [t.kdata for t in g], [], col
        for t in g:
            offs.append(c)
            c += t.rows
        while len(datas) < 3:
            datas.append(_no_rows(datas[0].dtype))
            offs.append(c)
        runs.append(KernelRun(g[0].qtype, tuple(g), tuple(datas), tuple(offs), col, c - col))
        col = c
    return tuple(runs)


def from_gguf(tensor) -> QTensor:
    """The QTensor of a 2-D gguf.GGUFReader tensor (its data stays a view into the file)."""
    cols, rows = (int(d) for d in tensor.shape)
    qtype = tensor.tensor_type.name
    data = tensor.data.view(np.uint16) if qtype == "BF16" else tensor.data
    return QTensor(data.reshape(rows, -1), qtype, (rows, cols))


def sample_weight(qtype: str, rows: int, cols: int, seed: int = 0):
    """A weight of random but valid blocks: random bytes, with bit 6 of every odd byte clear, so
    that each fp16 scale (all at even offsets, little-endian) is finite."""
    rng = np.random.default_rng(seed)
    if qtype not in BLOCK_TYPES:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        if qtype == "BF16":
            return QTensor((w.view(np.uint32) >> 16).astype(np.uint16), qtype, (rows, cols))
        return QTensor(w.astype(np.float16 if qtype == "F16" else np.float32), qtype, (rows, cols))
    values, nbytes = block_size(qtype)
    data = rng.integers(0, 256, (rows, cols // values * nbytes), dtype=np.uint8)
    data[:, 1::2] &= 0xBF
    return QTensor(data, qtype, (rows, cols))
