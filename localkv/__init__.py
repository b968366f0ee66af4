"""localkv: local LLM inference over a paged KV cache."""

import os as _os

# OpenBLAS's idle workers spin for 2^28 cycles after each call before they sleep. On a machine
# with few cores that spin steals a core from the decode kernels' OpenMP workers (cpu_kernels)
# right after a prefill, and a kernel start waits for a time slice. 2^20 cycles keeps the workers
# warm between a prefill's matmuls and out of the way soon after. Read when numpy loads OpenBLAS, so it only
# takes effect when localkv is imported first (as the `localkv` command does); a value the
# user set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
# numba's OpenMP workers (libgomp) likewise spin 300,000 rounds after each kernel before they
# sleep. In a prefill pass a kernel on every thread (causal attention) is followed by BLAS's
# matmuls, which then share the cores with that spin; 100,000 rounds still bridges the gaps
# between a decode step's kernels. Read when libgomp loads (the kernels' first load); a value
# the user set is kept.
_os.environ.setdefault("GOMP_SPINCOUNT", "100000")

__version__ = "0.1.0"
