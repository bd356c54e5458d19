#!/bin/bash
# One prepared device check for a GPU machine lent for a few minutes: the paging benchmark first
# (its table and per-variant profiles), then the -m gpu tests one file at a time (so a run cut by the
# time limit still has every finished file's failures with their reasons), then the default suite in
# the time left. Everything is written under $OUT (default ./gpu-check-out): env.txt, offload.log,
# offload-gpu.json, profiles.txt, pytest_gpu.log, pytest_suite.log.
#
#   BUDGET=420 bash benchmarks/gpu_check.sh        # seconds for the whole check
#
# Optional: BENCH_S (seconds for the benchmark, default 200: the vb variants add up to 10 untimed steps
# each, until the step inside backward is decided), BENCH_ARGS (extra offload.py flags,
# e.g. "--variants in_memory,vb_host_step"), GPU_TEST_S (seconds per test file, default 60),
# SKIP_BENCH=1, SKIP_SUITE=1, SUITE_ALONGSIDE=1 (below). Wheels in .whl/ (carried to a machine without a registry) are
# installed into /tmp/site first. The data folder is $APT_DATA_DIR, else .devrun/data if present.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-check-out}; mkdir -p "$OUT"
T0=$(date +%s); BUDGET=${BUDGET:-420}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
[ -z "${APT_DATA_DIR:-}" ] && [ -d .devrun/data ] && export APT_DATA_DIR=$PWD/.devrun/data
{ date -u; nvidia-smi -L 2>&1; python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
  lscpu | sed -n 1,16p; free -g; git log --oneline -1 2>/dev/null; } > "$OUT/env.txt" 2>&1

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  mkdir -p /tmp/gpu-check-prof
  timeout -k 15 "${BENCH_S:-200}" python3 benchmarks/offload.py --device cuda --rounds 3 --steps-per-round 2 --warmup 2 \
    --worker-timeout 150 --profile /tmp/gpu-check-prof --json "$OUT/offload-gpu.json" ${BENCH_ARGS:-} > "$OUT/offload.log" 2>&1
  echo "== benchmark rc=$? at $(( $(date +%s) - T0 ))s"; grep -A40 "^offload (GPU mode)" "$OUT/offload.log"
  for f in /tmp/gpu-check-prof/*.txt; do [ -e "$f" ] && { echo "######## $f"; cat "$f"; }; done > "$OUT/profiles.txt"
fi

# SUITE_ALONGSIDE=1: the default suite runs beside the -m gpu tests (xdist workers on the cores the
# benchmark has left), so a short lease sees both; it is stopped when the budget is spent.
SUITE_PID=
if [ "${SKIP_SUITE:-0}" != 1 ] && [ "${SUITE_ALONGSIDE:-0}" = 1 ] && python3 -c "import xdist" 2>/dev/null; then
  CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1 timeout -s INT -k 10 "$(( $(left) - 10 ))" python3 -m pytest \
    -p no:cacheprovider -q -rfE --tb=short -n $(( $(nproc) > 4 ? $(nproc) - 4 : 1 )) --dist loadfile \
    > "$OUT/pytest_suite.log" 2>&1 &
  SUITE_PID=$!
fi
: > "$OUT/pytest_gpu.log"
for f in $(grep -l "mark.gpu" tests/test_*.py); do
  [ "$(left)" -lt 20 ] && { echo "== out of time before $f" | tee -a "$OUT/pytest_gpu.log"; break; }
  echo "######## $f" >> "$OUT/pytest_gpu.log"
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout -s INT -k 10 "${GPU_TEST_S:-60}" python3 -m pytest -m gpu -p no:cacheprovider \
    -q -rA --tb=short "$f" >> "$OUT/pytest_gpu.log" 2>&1
done
echo "== gpu tests done at $(( $(date +%s) - T0 ))s: $(grep -c "^PASSED" "$OUT/pytest_gpu.log") passed"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_gpu.log" | head -40

if [ -n "$SUITE_PID" ]; then
  wait "$SUITE_PID"; echo "== default suite (alongside) rc=$? at $(( $(date +%s) - T0 ))s"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_suite.log" | tail -20
fi
R=$(left)
if [ "${SKIP_SUITE:-0}" != 1 ] && [ -z "$SUITE_PID" ] && [ "$R" -gt 40 ]; then
  WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n $(( $(nproc) > 2 ? $(nproc) - 2 : 1 )) --dist loadfile")
  CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1 timeout -s INT -k 10 "$R" python3 -m pytest -p no:cacheprovider -q \
    -rfE --tb=short $WORKERS > "$OUT/pytest_suite.log" 2>&1
  echo "== default suite rc=$? at $(( $(date +%s) - T0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_suite.log" | tail -20
fi
