"""The numba kernels, imported by build.load once numba has imported (not before: the rest of
the backend runs without numba). Each gives a token row the same bits whatever else shares its
pass (the one arithmetic, docs/CPU.md):
- attention: a chunk of keys at a time on 8 x 8 register tiles: a prefill pass's causal
  attention (flash-style online softmax, one softmax per SPAN of positions);
- decode_rows: one query token per sequence, every row the causal kernel's bits, a chunk the
  rows of several sequences share (forks, a system prompt) read once for all of them;
- elementwise: fused one-pass RMSNorm, RoPE and SwiGLU;
- matmul_few: the block types' matmul with activation rows in 8 lanes (int8 activations,
  integer multiply-adds: matmul_lanes), and the dequantizer;
- matmul_out: matmul_lanes' bits for 1 activation row with 8 weight rows in the lanes (decode;
  lanes_then_out: a pass's last rows in the same weight pass as its blocks of 8);
- matmul_packed: matmul_out's bits for Q4_0, Q4_1 and Q8_0 from their packed form (16 weight
  rows in the lanes, no sum across lanes: decode and passes of a few rows);
- matmul_wide: matmul_lanes' bits for 16 activation rows in 512-bit lanes (prefill with
  AVX-512 VNNI); superblock_lanes: the same for Q4_K and Q6_K (superblock.matmul_rows' bits);
  superblock_amx: those bits again with the integer dots on AMX-INT8 tiles; matmul_amx:
  matmul_wide's bits for the 32-value types with their dots on those tiles (long passes);
- superblock: Q4_K and Q6_K, a 256-value super-block at a time in integers (matmul_rows: any
  row count);
- float_few: the matmuls of F32 / F16 / BF16 weights (float FMAs, a dot per row).

Every kernel compiles with one of the option sets here, and each module registers the checks
build.load runs when it loads them (`self_check`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from localkv import kv_format

# Parallel loops (prange) on numba's OpenMP workers; SER on the calling thread; EXACT: serial,
# without fastmath, for code that must see inf and nan as they are. All with numpy's error
# model (a float division by zero is inf, not an exception): numba compiles a prange body with
# it, and a helper called there under other options compiled twice (BENCHMARKS.md, "The first
# run"); a division that may raise also does not vectorise.
PAR = dict(parallel=True, fastmath=True, boundscheck=False, cache=True, nogil=True, error_model="numpy")
SER = dict(fastmath=True, boundscheck=False, cache=True, nogil=True, error_model="numpy")
EXACT = dict(boundscheck=False, cache=True, nogil=True, error_model="numpy")
# parallel, each float op as written: the kernels every pass's rows go through (the one-answer
# rule, backends/cpu/backend.py), whose sums must not depend on the loop version LLVM picks
EXACT_PAR = dict(PAR, fastmath=False)


@dataclass(frozen=True, slots=True)
class Check:
    """A load-time check: run() compiles (or loads from the cache) the builds it names and
    compares them with numpy."""

    run: Callable[..., bool]
    # seconds its compile takes on an empty cache, on the host of BENCHMARKS.md's "first run"
    # (per weight type for "weights"): the first run's estimate and bar; 0: not counted
    cost: float


# group -> checks, in the order registered. "base" (the element-wise kernels): run() -> bool;
# "kv" (the attention kernels on a pool of one K/V format): run(format name) -> bool, for each
# format a pool uses; "weights": run(qtype) -> bool, for each weight type loaded
CHECKS: dict[str, list[Check]] = {"base": [], "kv": [], "weights": []}


def self_check(group: str, cost: float = 0.0):
    """Register the decorated function as a load-time check of `group`: it compiles (or loads
    from the cache) the builds the model calls, with the array kinds it passes, and compares
    their results with numpy's. build.load runs them; a False or an exception turns the group
    off."""

    def register(check):
        CHECKS[group].append(Check(check, cost))
        return check

    return register


def uniform_pool(name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """A pool of the K/V format `name` [..., head_dim -> row] whose every value is one, as the
    kernels read it (f16 as its uint16 bits), and the value its rows decode to: equal keys
    weigh every value alike, so an attention output is that value."""
    fmt = kv_format.FORMATS[name]
    rows = kv_format.encode(np.ones(shape, np.float32), fmt)
    value = float(kv_format.decode(rows).flat[0])
    return (rows.view(np.uint16) if rows.dtype == np.float16 else rows), value
