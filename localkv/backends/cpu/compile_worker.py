"""A worker process of the kernels' first compile (warmup): `python -m
localkv.backends.cpu.compile_worker KEY...` compiles those jobs into numba's cache."""

import sys

from localkv.backends.cpu import build

if __name__ == "__main__":
    sys.exit(build.run_in_worker(sys.argv[1:]))
