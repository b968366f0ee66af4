"""The CPU backend (CpuBackend: numpy, OpenBLAS and numba kernels) and everything it computes
with. Read it bottom up:
- simd/: the LLVM IR vocabulary the kernels are written in (vec: vector types and IR helpers;
  u8x32: bytes and integer dot products; f32x8: float lanes; wide: 64-byte K-quant products;
  amx: AMX tile instructions; grouped: 16 packed weight rows' super-block products);
- formats/: the weight types, the GGUF blocks decoded for the kernels, the K-quants' packed
  form (below the kernels);
- kernels/: the numba kernels (attention, decode_rows, elementwise; matmul_few and its lanes
  variants for every block type; superblock, the Q4_K / Q6_K kernels, a 256-value super-block
  at a time in integers; float_few), their option sets and self-checks; each gives a token row
  the same bits whatever shares its pass (one arithmetic: docs/CPU.md);
- quant/: weights kept in their GGUF encoding (QTensor, the numpy fallback, the entry points
  into the kernels, the packed form on disk, matmul_rows / get_rows: above the kernels);
- build: the one load() of every kernel, the LOCALKV_CPU_KERNELS switch, numba's threading
  layer, the source-hash guard over this whole tree; loaded: the one record of what loaded;
  numba_hooks: every use of numba's private parts;
- compiled: the attention and element-wise kernels called on numpy arrays; attention: the
  numpy attention over the paged pool (and where the kernels take over); threads: the cores
  other processes leave idle;
- backend: the op set and CpuBackend.

Only build imports the kernel modules (once numba has imported); everything else runs
without numba, on the numpy path.
"""

from localkv.backends.cpu.attention import gather_kv
from localkv.backends.cpu.backend import (
    CpuBackend,
    DecodeBatch,
    act_dtype,
    add_residual,
    decode,
    default_kv,
    frozen_table,
    gelu_mul,
    head_rmsnorm,
    linear,
    logits,
    paged_attention,
    rmsnorm,
    rope,
    rope_store,
    rope_tables,
    rotate,
    silu_mul,
    uses_kernels,
    write_kv,
)

__all__ = ["CpuBackend", "DecodeBatch", "act_dtype", "add_residual", "decode", "default_kv", "frozen_table",
           "gather_kv", "gelu_mul", "head_rmsnorm", "linear", "logits", "paged_attention", "rmsnorm", "rope",
           "rope_store", "rope_tables", "rotate", "silu_mul", "uses_kernels", "write_kv"]  # fmt: skip
