"""localkv: local LLM inference over a paged KV cache."""

import os as _os

# How long idle worker threads spin before they sleep, set before the libraries read it (a value
# the user set is kept):
# - OPENBLAS_THREAD_TIMEOUT: OpenBLAS's workers spin 2^28 cycles after each call. On a machine
#   with few cores that spin steals a core from the decode kernels' OpenMP workers (backends/cpu)
#   right after a prefill, and a kernel start waits for a time slice; 2^20 keeps them warm
#   between a prefill's matmuls and out of the way soon after. Read when numpy loads OpenBLAS,
#   so it only takes effect when localkv is imported first (as the `localkv` command does).
# - GOMP_SPINCOUNT: numba's OpenMP workers (libgomp) spin 300,000 rounds after each kernel. In a
#   prefill pass a kernel on every thread (causal attention) is followed by BLAS's matmuls, which
#   then share the cores with that spin; 100,000 rounds still bridge the gaps between a decode
#   step's kernels. Read when libgomp loads (the kernels' first load).
_SPIN = {"OPENBLAS_THREAD_TIMEOUT": "20", "GOMP_SPINCOUNT": "100000"}
# the ones localkv set and the user had not: a peer engine's process (localkv bench) runs without
DEFAULTED_ENV = tuple(k for k in _SPIN if k not in _os.environ)
for _key, _value in _SPIN.items():
    _os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
