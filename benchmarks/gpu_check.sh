#!/bin/bash
# One prepared device check for a GPU machine lent for a few minutes, in the order that fitted a
# 15-minute lease on 2026-11-27:
#   1. the -m gpu tests, each test file in its own process, several at a time (each file's log kept,
#      so a file cut by its time limit still leaves the others' failures with their reasons), with
#      the default suite beside them (xdist workers on the cores left; SKIP_SUITE=1 leaves it out);
#   2. the paging benchmark (its table, per-variant profiles and the bytes written by kind), alone
#      on the machine, in the time left.
# Everything is written under $OUT (default ./gpu-check-out): env.txt, pytest_gpu.log,
# pytest_suite.log, offload.log, offload-gpu.json, profiles.txt.
#
#   BUDGET=480 bash benchmarks/gpu_check.sh        # seconds for the whole check
#
# Optional: GPU_TEST_S (seconds per test file and for the suite, default 200), GPU_TEST_JOBS (test
# files at once, default 6; the suite takes the cores beyond 8), BENCH_ARGS (offload.py
# flags, default "--layers 8": seven variants of the 12-block model do not start within a few
# minutes, each worker taking 15-40 s; the A/B of one copy stream per direction is
# BENCH_ARGS="--layers 8 --variants in_memory,vb_all_paged,vb_all_paged_one_stream,fsdp2_cpu_offload"),
# SKIP_BENCH=1, SKIP_SUITE=1. Wheels in .whl/ (carried to a
# machine without a registry) are installed into /tmp/site first. The data folder is
# $APT_DATA_DIR, else .devrun/data if present.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-check-out}; mkdir -p "$OUT"
T0=$(date +%s); BUDGET=${BUDGET:-480}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
[ -z "${APT_DATA_DIR:-}" ] && [ -d .devrun/data ] && export APT_DATA_DIR=$PWD/.devrun/data
{ date -u; nvidia-smi -L 2>&1; python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
  lscpu | sed -n 1,16p; free -g; git log --oneline -1 2>/dev/null; } > "$OUT/env.txt" 2>&1

# 1. the -m gpu test files at once, the default suite beside them
T=$(( $(left) - 20 < ${GPU_TEST_S:-200} ? $(left) - 20 : ${GPU_TEST_S:-200} ))
LOGS=$(mktemp -d)
export T LOGS
grep -l "mark.gpu" tests/test_*.py | xargs -P "${GPU_TEST_JOBS:-6}" -I{} sh -c \
  'CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout -s INT -k 10 "$T" python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
     --tb=short "{}" > "$LOGS/$(basename "{}" .py).log" 2>&1' &
if [ "${SKIP_SUITE:-0}" != 1 ]; then
  WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n $(( $(nproc) > 8 ? $(nproc) - 8 : 1 )) --dist loadfile")
  CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1 timeout -s INT -k 10 "$T" python3 -m pytest -p no:cacheprovider -q \
    -rfE --tb=short $WORKERS > "$OUT/pytest_suite.log" 2>&1 &
fi
wait
for f in "$LOGS"/*.log; do echo "######## $(basename "$f" .log)"; cat "$f"; done > "$OUT/pytest_gpu.log"
echo "== gpu tests and suite done at $(( $(date +%s) - T0 ))s: $(grep -c "^PASSED" "$OUT/pytest_gpu.log") gpu tests passed"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_gpu.log" | head -40
[ -f "$OUT/pytest_suite.log" ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_suite.log" | tail -20

# 2. the paging benchmark, alone, in the time left
if [ "${SKIP_BENCH:-0}" != 1 ] && [ "$(left)" -gt 60 ]; then
  mkdir -p /tmp/gpu-check-prof
  timeout -k 15 "$(( $(left) - 15 ))" python3 benchmarks/offload.py --device cuda --rounds 3 --steps-per-round 2 --warmup 2 \
    --worker-timeout 150 --profile /tmp/gpu-check-prof --json "$OUT/offload-gpu.json" ${BENCH_ARGS:---layers 8} \
    > "$OUT/offload.log" 2>&1
  echo "== benchmark rc=$? at $(( $(date +%s) - T0 ))s"; grep -v -e SyntaxWarning -e '"""Config' "$OUT/offload.log" | tail -40
  for f in /tmp/gpu-check-prof/*.txt; do [ -e "$f" ] && { echo "######## $f"; cat "$f"; }; done > "$OUT/profiles.txt"
fi
