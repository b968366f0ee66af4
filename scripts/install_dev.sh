#!/usr/bin/env bash
# Installs localkv with everything its tests need: the dev tools, the routers of the fleet tests
# and the llama-cpp-python peer
# (built from source the first time, about 8 minutes; pip caches the wheel afterwards).
#
# llama.cpp's AMX matrix multiply segfaults on some Intel Xeon (Sapphire Rapids) hosts at the
# first prompt (ggml-org/llama.cpp#20824), and a build for the host compiles it in wherever the
# CPU has AMX. On such a CPU the peer is built without the AMX instructions (otherwise the same
# build: every other extension of the host, llama.cpp's repacked weights); a wheel cached by an
# earlier build with AMX is dropped and rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
fi
pip install -e '.[dev,peer,cluster]'
has_amx() {
    python -c "import sys, llama_cpp; sys.exit('AMX_INT8 = 1' not in llama_cpp.llama_print_system_info().decode())"
}
if has_amx; then
    version=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
    echo "rebuilding llama-cpp-python $version without AMX (llama.cpp#20824)" >&2
    pip cache remove 'llama_cpp_python*' || true
    pip install --force-reinstall --no-deps "llama-cpp-python[server]==$version"
    if has_amx; then
        echo "llama-cpp-python still has AMX compiled in" >&2
        exit 1
    fi
fi
