#!/usr/bin/env bash
# One-shot check of localkv's CUDA backend (CudaBackend: localkv/backends/cuda*.py, cuda/*.cu) on a
# machine with an NVIDIA GPU. Installs nothing and needs no network: CuPy (pip install -e '.[gpu]'
# or '.[gpu13]') and, for the end-to-end parts, the pulled smollm2-135m model must already be
# there. Each part has its own time limit, so the whole run stays within 8 minutes (CuPy's first
# compile of the kernels included: the first part to launch a kernel pays it).
#
#   bash scripts/gpu_check.sh [REPORT_DIR]      # REPORT_DIR defaults to $OUT, else ./gpu_report
#
# Writes to REPORT_DIR: nvidia-smi.txt; pytest.txt (the CUDA tests on the real GPU: test_gpu.py,
# test_cuda_quant.py, and test_cuda_engine.py when the model is pulled); kernels.md/.json (paged
# decode through a shuffled block table vs the same attention over contiguous K/V, and the
# quantized matvec); e2e_cuda.json, e2e_cpu.json (localkv bench speed, pp512/tg128); report.md,
# a summary of all of it. Exits 1 when a test fails, 2 when there is no usable GPU backend.
#
# UNVERIFIED: written without a GPU (the tests it runs pass on the CPU through the CuPy stand-in
# and the CUDA emulator); every GPU number it prints is a measurement of the machine it ran on.
# Targets (issue 20): paged decode >= 0.95x contiguous; SmolLM2 tg128 >= 500 t/s, pp512 >= 20,000.
set -u
REPORT="${OUT:-${1:-./gpu_report}}"
mkdir -p "$REPORT"
REPORT="$(cd "$REPORT" && pwd)"
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python}"  # one command (quoted where used)
# keep the repo root off sys.path (Python >= 3.11): its cuda/ folder would shadow NVIDIA's 'cuda'
# namespace package (cuda.pathfinder), which CuPy >= 14 imports
export PYTHONSAFEPATH=1
status=0

section() {  # section TITLE FILE: append a titled block (FILE's tail) to the report
  {
    echo
    echo "## $1"
    echo
    echo '```'
    tail -n 30 "$2"
    echo '```'
  } >> "$REPORT/report.md"
}

{
  echo "# localkv GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- python: $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  echo "- cupy: $("$PY" -c 'import cupy; print(cupy.__version__)' 2>&1 | tail -n 1)"
  echo "- devices: $("$PY" -c 'from localkv.backends import available_devices as a; print(a())' 2>&1 | tail -n 1)"
} > "$REPORT/report.md"

if ! why=$("$PY" -c "from localkv.backends import select; select('cuda')" 2>&1); then
  echo "NO GPU BACKEND: $(echo "$why" | tail -n 1)" | tee -a "$REPORT/report.md"
  status=2  # still run the rest, so the report shows what could run
fi

echo "== nvidia-smi"
(timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi not available") | tee "$REPORT/nvidia-smi.txt"

model_pulled=0
if "$PY" -c "import sys; from localkv.hub import catalog; from localkv.hub.pull import is_pulled; \
sys.exit(0 if is_pulled(catalog.lookup('smollm2-135m')) else 1)" 2>/dev/null; then
  model_pulled=1
fi

echo "== CUDA tests on the GPU"
tests=(tests/backends/test_gpu.py tests/backends/test_cuda_quant.py)
if [ "$model_pulled" = 1 ]; then
  tests+=(tests/backends/test_cuda_engine.py)
else
  echo "test_cuda_engine.py skipped: smollm2-135m is not pulled (run 'localkv pull smollm2-135m' first)" \
    | tee -a "$REPORT/report.md"
fi
timeout 210 "$PY" -m pytest -q -p no:cacheprovider -m "not peer" "${tests[@]}" 2>&1 | tee "$REPORT/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=1
section "CUDA tests (${tests[*]}; exit $rc, 124: timed out)" "$REPORT/pytest.txt"

echo "== kernel micro-benchmarks"
timeout 90 "$PY" - "$REPORT" <<'PYEOF' 2>&1 | tee "$REPORT/kernels.log"
"""(1) Paged decode (split-K kernel through a shuffled block table) vs the same attention over
contiguous K/V: the same kernel with an identity block table over a contiguous layout, and
dense CuPy attention (cuBLAS batched matmuls + softmax) over [B, n, kvh, hd]. (2) The quantized
matvec of a decode step on a 4096 x 4096 weight per type, as effective GB/s of weight bytes.
GPU time per call, median of 20."""
import json
import sys

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

from localkv.backends import cuda_quant
from localkv.backends.cuda_attention import paged_decode
from localkv.backends.cpu.quant import QTensor

report = sys.argv[1]
dev = cp.cuda.Device()
name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
rows, quant_rows = [], []


def gpu_ms(fn, n=20):
    return float(np.median(benchmark(fn, n_repeat=n, n_warmup=3).gpu_times[0]) * 1e3)


def dense(q, k, v, scale):
    """q [B, H, hd]; k/v [B, n, kvh, hd] contiguous: GQA attention with batched matmuls."""
    B, H, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(B, kvh, H // kvh, hd)
    s = cp.matmul(qg, k.transpose(0, 2, 3, 1)).astype(cp.float32) * scale  # [B, kvh, g, n]
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p.astype(cp.float16), v.transpose(0, 2, 1, 3)).reshape(B, H, hd)


for H, kvh, hd in [(32, 8, 128), (9, 3, 64)]:
    for B in (1, 32):
        for n in (1024, 4096, 16384):
            bs, nb = 16, n // 16
            rng = np.random.default_rng(0)
            k = cp.random.standard_normal((B * nb, bs, kvh, hd), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((B * nb, bs, kvh, hd), dtype=cp.float32).astype(cp.float16)
            q = cp.random.standard_normal((B, H, hd), dtype=cp.float32).astype(cp.float16)
            lens = cp.full(B, n, cp.int32)
            shuffled = cp.asarray(rng.permutation(B * nb).reshape(B, nb).astype(np.int32))
            ident = cp.arange(B * nb, dtype=cp.int32).reshape(B, nb)
            scale = 1 / np.sqrt(hd)
            t_paged = gpu_ms(lambda: paged_decode(q, k, v, shuffled, lens, scale))
            t_ident = gpu_ms(lambda: paged_decode(q, k, v, ident, lens, scale))
            kc, vc = k.reshape(B, n, kvh, hd), v.reshape(B, n, kvh, hd)  # the identity layout, contiguous
            t_dense = gpu_ms(lambda: dense(q, kc, vc, scale))
            ref = dense(q, kc, vc, scale).astype(cp.float32)
            err = float(cp.abs(paged_decode(q, k, v, ident, lens, scale).astype(cp.float32) - ref).max())
            rows.append(dict(H=H, kvh=kvh, hd=hd, batch=B, ctx=n, paged_ms=round(t_paged, 4),
                             contiguous_table_ms=round(t_ident, 4), dense_cupy_ms=round(t_dense, 4),
                             paged_vs_contiguous=round(t_ident / t_paged, 3),
                             paged_kv_GBps=round(2 * B * n * kvh * hd * 2 / (t_paged * 1e-3) / 1e9, 1),
                             max_abs_diff_vs_dense=err))
            print(rows[-1], flush=True)
            del k, v, kc, vc
            cp.get_default_memory_pool().free_all_blocks()

N = K = 4096
for qtype, (values, nbytes) in {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
                                "Q6_K": (256, 210)}.items():
    blocks = np.random.default_rng(1).integers(0, 256, (N, K // values * nbytes), dtype=np.uint8)  # timing only
    w = cuda_quant.upload(QTensor(blocks, qtype, (N, K)))
    for R in (1, 4):
        x = cp.random.standard_normal((R, K), dtype=cp.float32).astype(cp.float16)
        t = gpu_ms(lambda: cuda_quant.matmul(x, w))
        quant_rows.append(dict(type=qtype, rows=R, ms=round(t, 4), weight_GBps=round(w.blocks.nbytes / (t * 1e-3) / 1e9, 1)))
        print(quant_rows[-1], flush=True)

with open(f"{report}/kernels.json", "w") as f:
    json.dump({"device": name, "paged_decode": rows, "quant_matvec": quant_rows}, f, indent=1)
with open(f"{report}/kernels.md", "w") as f:
    f.write(f"Paged decode on {name} (GPU ms per call, median of 20; block size 16, fp16 K/V; target: "
            "contiguous/paged >= 0.95)\n\n")
    f.write("| H/kvh/hd | batch | ctx | paged (shuffled) | paged (contiguous table) | contiguous/paged | dense CuPy "
            "| paged K+V GB/s | max diff |\n|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        f.write(f"| {r['H']}/{r['kvh']}/{r['hd']} | {r['batch']} | {r['ctx']} | {r['paged_ms']:.3f} | "
                f"{r['contiguous_table_ms']:.3f} | {r['paged_vs_contiguous']:.3f} | {r['dense_cupy_ms']:.3f} | "
                f"{r['paged_kv_GBps']} | {r['max_abs_diff_vs_dense']:.1e} |\n")
    f.write(f"\nQuantized matvec, 4096 x 4096 weight (GPU ms per call)\n\n| type | rows | ms | weight GB/s |\n"
            "|---|---|---|---|\n")
    for r in quant_rows:
        f.write(f"| {r['type']} | {r['rows']} | {r['ms']:.4f} | {r['weight_GBps']} |\n")
PYEOF
rc=${PIPESTATUS[0]}
if [ -f "$REPORT/kernels.md" ]; then
  { echo; echo "## Kernel micro-benchmarks (exit $rc)"; echo; cat "$REPORT/kernels.md"; } >> "$REPORT/report.md"
else
  section "Kernel micro-benchmarks (exit $rc, 124: timed out)" "$REPORT/kernels.log"
fi

echo "== end to end: localkv bench speed"
{
  echo
  echo "## End to end: localkv bench speed, smollm2-135m, pp512 / tg128 (targets on an H200: 20,000 / 500 t/s)"
  echo
} >> "$REPORT/report.md"
if [ "$model_pulled" != 1 ]; then
  echo "skipped: smollm2-135m is not pulled (no network here: run 'localkv pull smollm2-135m' beforehand)" \
    | tee -a "$REPORT/report.md"
else
  for dev in cuda cpu; do
    limit=100
    [ "$dev" = cpu ] && limit=60
    timeout "$limit" "$PY" -m localkv bench speed --device "$dev" -m smollm2-135m -p 512 -n 128 -r 2 -o json \
      > "$REPORT/e2e_$dev.json" 2> "$REPORT/e2e_$dev.log"
    echo "- $dev: exit $? (e2e_$dev.json, e2e_$dev.log; 124: timed out)" >> "$REPORT/report.md"
  done
  {
    echo '```'
    cat "$REPORT"/e2e_*.json
    echo '```'
  } >> "$REPORT/report.md"
fi

echo "== report: $REPORT/report.md"
exit $status
