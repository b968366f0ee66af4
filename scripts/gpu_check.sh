#!/usr/bin/env bash
# One-command GPU check of localkv's CuPy backend. No network: CuPy (pip install -e '.[gpu]' or
# '.[gpu13]') and, for the end-to-end rows, the pulled smollm2-135m model must already be there.
#
#   bash scripts/gpu_check.sh [REPORT_DIR]      # REPORT_DIR defaults to $OUT, else ./gpu_report
#
# Writes to REPORT_DIR: nvidia-smi.txt, pytest.txt (python -m pytest -m gpu -q), kernels.md and
# kernels.json (paged decode micro-benchmark), e2e.json (localkv bench on the real model, only when
# the CLI has --device), report.md (a summary of all of it). Exits non-zero when the GPU tests fail.
#
# UNVERIFIED: every GPU number this script prints is a measurement of whatever machine it ran on;
# no number in the docs or comments of this project has been measured yet (written without a GPU).
set -u
REPORT="${OUT:-${1:-./gpu_report}}"
mkdir -p "$REPORT"
REPORT="$(cd "$REPORT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
# keep the repo root off sys.path (Python >= 3.11): a cuda/__init__.py there would shadow NVIDIA's
# 'cuda' namespace package (cuda.pathfinder), which CuPy >= 14 imports
export PYTHONSAFEPATH=1
status=0

{
  echo "# localkv GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- python: $($PY -c 'import sys; print(sys.version.split()[0])')"
  echo "- cupy: $($PY -c 'import cupy; print(cupy.__version__)' 2>&1 | tail -1)"
  echo "- devices: $($PY -c 'from localkv.backends import available_devices as a; print(a())' 2>&1 | tail -1)"
} > "$REPORT/report.md"

if ! why=$($PY -c "from localkv.backends import select; select('cuda')" 2>&1); then
  echo "NO GPU BACKEND: $(echo "$why" | tail -n 1)" | tee -a "$REPORT/report.md"
  status=2  # still run the rest, so the report shows what could run
fi

echo "== nvidia-smi"
(nvidia-smi 2>&1 || echo "nvidia-smi not available") | tee "$REPORT/nvidia-smi.txt"

echo "== GPU tests: python -m pytest -m gpu -q"
$PY -m pytest -m gpu -q 2>&1 | tee "$REPORT/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && status=1
{
  echo
  echo "## GPU tests (pytest -m gpu, exit $rc)"
  echo
  echo '```'
  tail -n 25 "$REPORT/pytest.txt"
  echo '```'
} >> "$REPORT/report.md"

echo "== paged decode micro-benchmark"
$PY - "$REPORT" <<'PYEOF' 2>&1 | tee "$REPORT/kernels.log"
"""Paged decode (split-K kernel through a shuffled block table) vs the same attention over
contiguous K/V: (a) the same kernel with an identity block table over a contiguous layout, (b)
dense CuPy attention (cuBLAS batched matmuls + softmax) over [B, n, kvh, hd]. GPU time per call."""
import json
import sys

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

from localkv.backends import cuda as oc

report = sys.argv[1]
dev = cp.cuda.Device()
name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
rows = []


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


for (H, kvh, hd) in [(32, 8, 128), (9, 3, 64)]:
    for B in (1, 32):
        for n in (1024, 4096, 16384):
            bs = 16
            nb = n // bs
            rng = np.random.default_rng(0)
            k = cp.random.standard_normal((B * nb, bs, kvh, hd), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((B * nb, bs, kvh, hd), dtype=cp.float32).astype(cp.float16)
            q = cp.random.standard_normal((B, H, hd), dtype=cp.float32).astype(cp.float16)
            lens = cp.full(B, n, cp.int32)
            shuffled = cp.asarray(rng.permutation(B * nb).reshape(B, nb).astype(np.int32))
            ident = cp.arange(B * nb, dtype=cp.int32).reshape(B, nb)
            scale = 1 / np.sqrt(hd)
            t_paged = gpu_ms(lambda: oc.paged_decode(q, k, v, shuffled, lens, scale))
            t_ident = gpu_ms(lambda: oc.paged_decode(q, k, v, ident, lens, scale))
            kc, vc = k.reshape(B, n, kvh, hd), v.reshape(B, n, kvh, hd)  # the identity layout, contiguous
            t_dense = gpu_ms(lambda: dense(q, kc, vc, scale))
            ref = dense(q, kc, vc, scale)
            err = float(cp.abs(oc.paged_decode(q, k, v, ident, lens, scale).astype(cp.float32)
                               - ref.astype(cp.float32)).max())
            gbs = 2 * B * n * kvh * hd * 2 / (t_paged * 1e-3) / 1e9
            row = dict(H=H, kvh=kvh, hd=hd, batch=B, ctx=n, paged_ms=round(t_paged, 4),
                       contiguous_table_ms=round(t_ident, 4), dense_cupy_ms=round(t_dense, 4),
                       paged_kv_GBps=round(gbs, 1), max_abs_diff_vs_dense=err)
            rows.append(row)
            print(row, flush=True)
            del k, v, kc, vc
            cp.get_default_memory_pool().free_all_blocks()

with open(f"{report}/kernels.json", "w") as f:
    json.dump({"device": name, "rows": rows}, f, indent=1)
with open(f"{report}/kernels.md", "w") as f:
    f.write(f"Paged decode on {name} (GPU ms per call, median of 20; block size 16, fp16 K/V)\n\n")
    f.write("| H/kvh/hd | batch | ctx | paged (shuffled) | paged (contiguous table) | dense CuPy | paged K+V GB/s | max diff |\n")
    f.write("|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        f.write(f"| {r['H']}/{r['kvh']}/{r['hd']} | {r['batch']} | {r['ctx']} | {r['paged_ms']:.3f} | "
                f"{r['contiguous_table_ms']:.3f} | {r['dense_cupy_ms']:.3f} | {r['paged_kv_GBps']} | "
                f"{r['max_abs_diff_vs_dense']:.1e} |\n")
PYEOF
rc=${PIPESTATUS[0]}
{
  echo
  echo "## Paged decode micro-benchmark (exit $rc)"
  echo
  if [ -f "$REPORT/kernels.md" ]; then cat "$REPORT/kernels.md"; else echo '```'; tail -n 20 "$REPORT/kernels.log"; echo '```'; fi
} >> "$REPORT/report.md"

echo "== end to end (real model)"
{
  echo
  echo "## End to end: localkv bench --device cuda, smollm2-135m, pp512 / tg128"
  echo
} >> "$REPORT/report.md"
if ! localkv bench --help 2>/dev/null | grep -q -- "--device"; then
  echo "skipped: localkv bench has no --device option yet" | tee -a "$REPORT/report.md"
elif ! $PY -c "import sys; from localkv.hub import catalog as registry; from localkv.hub.pull import is_pulled; \
sys.exit(0 if is_pulled(registry.lookup('smollm2-135m')) else 1)" 2>/dev/null; then
  echo "skipped: smollm2-135m is not pulled (no network here: run 'localkv pull' beforehand)" | tee -a "$REPORT/report.md"
else
  for dev in cuda cpu; do
    timeout 300 localkv bench --device "$dev" -m smollm2-135m -p 512 -n 128 -r 2 -o json \
      > "$REPORT/e2e_$dev.json" 2> "$REPORT/e2e_$dev.log"
    echo "- $dev: exit $? (e2e_$dev.json)" >> "$REPORT/report.md"
  done
  echo '```' >> "$REPORT/report.md"
  cat "$REPORT"/e2e_*.json >> "$REPORT/report.md"
  echo '```' >> "$REPORT/report.md"
fi

echo "== report: $REPORT/report.md"
exit $status
