#!/usr/bin/env bash
# Every `localkv bench` suite once at full size, the way BENCHMARKS.md reports them.
#
#   bash scripts/bench_all.sh [OUT_DIR] [THREADS]     # defaults: ./bench_results, all cores
#
# Writes OUT_DIR/<suite>.md (the suite's report: what, hardware, load, command, table, targets),
# OUT_DIR/<suite>.load (uptime and the busiest processes before and after)
# and, when matplotlib is installed, OUT_DIR/bench-<suite>.png. --vs llama.cpp is added when
# llama-cpp-python is installed. One suite at a time, nothing left running. evict takes the longest;
# set SUITES="memory fork" to run fewer.
#
# Each report says how much CPU other processes took during the run ("LOADED" above 10%): on a
# shared machine, rerun the suites whose numbers matter when it is quiet, and pin -t to the cores
# that are really free (BLAS threads that find their core busy spin and can run many times slower).
set -u
OUT="${1:-./bench_results}"
THREADS="${2:-}"
SUITES="${SUITES:-memory speed fork cache evict}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
VS=()
$PY -c "import llama_cpp" 2>/dev/null && VS=(--vs llama.cpp)
PLOT=()
$PY -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$OUT")
T=()
[ -n "$THREADS" ] && T=(-t "$THREADS")
status=0
for s in $SUITES; do
  extra=("${VS[@]}")
  [ "$s" = memory ] && extra=()
  [ "$s" = evict ] && extra=()
  [ "$s" = speed ] && extra+=(-d 0,4096)  # as `localkv bench all` runs it (issue 32)
  { echo "== before: $(uptime)"; ps -eo pid,pcpu,etime,args --sort=-pcpu | head -6 | cut -c1-140; } > "$OUT/$s.load"
  echo "== localkv bench $s ${T[*]} ${extra[*]}" >&2
  localkv bench "$s" "${T[@]}" "${extra[@]}" "${PLOT[@]}" > "$OUT/$s.md" || status=1
  { echo "== after: $(uptime)"; ps -eo pid,pcpu,etime,args --sort=-pcpu | head -6 | cut -c1-140; } >> "$OUT/$s.load"
  cat "$OUT/$s.md"
done
exit $status
