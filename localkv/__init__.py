"""localkv: local LLM inference over a paged KV cache."""

import os as _os

# OpenBLAS's idle workers spin for about 0.1 s after each call (2^28 cycles) before they sleep.
# On a 2-core machine that spin steals the second core from the decode kernels' OpenMP workers
# (cpu_kernels) right after a prefill: a kernel start then waited up to 4 ms instead of 5 us.
# 2^20 cycles (about 0.4 ms) keeps the workers warm between a prefill's matmuls (pp512: no
# measurable change) and out of the way soon after. Read when numpy loads OpenBLAS, so it only
# takes effect when localkv is imported first (as the `localkv` command does); a value the
# user set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

__version__ = "0.1.0"
