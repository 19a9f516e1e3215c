#!/usr/bin/env bash
# The prepared device check for a GPU machine (H200): kernel tests compiled for the GPU (the
# attention kernel on float pools, then on quantized int8/fp8 pools, then the KV write and block
# copies through impl="pallas_gpu"), the quantized decode comparison (issue 6's goal: >= 1.6x the
# bfloat16 decode throughput at ctx >= 4k), the paged-attention benchmark, the block copies and
# KV write against XLA's (bench_pool_layout --impls), the host tier's moves (issue 11), then a
# 64-block pull between two processes on the GPU (issue 14). Runs from the repository root,
# installs nothing, keeps going after a failing step and records every step's exit code and
# seconds in $OUT/steps.tsv.
#
#   bash benchmarks/gpu_check.sh               # on the GPU machine; results in ${OUT:-./gpu_results}
#   bash benchmarks/gpu_check.sh --cpu-smoke   # here: same steps, CPU-sized, to exercise the script
#
# Time: each step has its own limit, and no step may run past TOTAL_S (default 470 s in gpu
# mode) from the start, so the whole run ends inside 8 minutes (+ one 5 s kill grace) whatever
# compiles cost. A step past its limit gets SIGINT first (pytest then still prints its
# summary), SIGKILL 5 s later. The benchmarks stop starting new cases after their --budget-s.
# $OUT receives exactly these 8 files (the device machine returns at most 8): env.txt,
# steps.tsv, tests.log, bench_quant.json, bench.json, bench.log (every benchmark's printed
# tables), bench_tiers.log (host tier and pool-layout copies), bench_remote.json.
set -u

MODE=gpu
if [[ "${1:-}" == "--cpu-smoke" ]]; then MODE=cpu-smoke; fi

cd "$(dirname "$0")/.."
if [[ "$MODE" == cpu-smoke ]]; then
  OUT="${OUT:-$(mktemp -d /tmp/gpu_check_smoke.XXXXXX)}"
  PY="${PYTHON:-.venv/bin/python}"
  TOTAL_S=${TOTAL_S:-1500}
  GPU_TEST_ARGS=(-k "work_item or rejects or lowers or group_not")
  QUANT_TEST_ARGS=(-k "lowers or write or copies")
  OTHER_TEST_ARGS=(-k "pallas_gpu and (past_the_pool or float8 or padding)")
  QUANT_BENCH_ARGS=(--quick --rounds 2 --budget-s 30)
  BENCH_ARGS=(--quick --rounds 3 --budget-s 60)
  LAYOUT_ARGS=(--num-blocks 16 --layers 2 --heads 2 --head-dim 32 --n 1,8 --repeats 3 --impls xla,pallas_gpu)
  REMOTE_ARGS=(--repeats 3 --block-kib 256 --min-gib-s 0)
  TIERS_ARGS=(--host-only --quick)
  LIMITS=(60 240 240 240 240 240 120 120 120)
else
  OUT="${OUT:-./gpu_results}"
  PY="${PYTHON:-python3}"
  TOTAL_S=${TOTAL_S:-470}
  GPU_TEST_ARGS=()
  QUANT_TEST_ARGS=()
  # The GPU implementation only: the TPU-interpreter and XLA cases are CPU-suite material (the
  # TPU interpreter alone takes minutes) and several assertions there expect backend 'cpu'.
  OTHER_TEST_ARGS=(-k "pallas_gpu and not lowers")
  QUANT_BENCH_ARGS=(--budget-s 30)
  # 4 target decode shapes (each compiles paged, dense, shipped, kernel-only), so the budget
  # still reaches the chunked prefill and part of the tuning sweep.
  BENCH_ARGS=(--budget-s 60 --sweep --batches 32,128 --contexts 4096,32768)
  LAYOUT_ARGS=(--repeats 10 --impls xla,pallas_gpu)
  REMOTE_ARGS=(--repeats 20 --block-kib 256 16)
  # 1 MiB blocks (16 layers, 8 KV heads, page 16, head_dim 128, bf16): 64 MiB per move
  TIERS_ARGS=(--host-only --quick --repeats 10 --num-layers 16 --num-kv-heads 8)
  # env, float-pool kernel tests, quantized kernel tests, other kernels' GPU tests, quantized
  # bench, bench, pool layout, host tier moves, remote pull
  LIMITS=(25 90 75 45 55 85 35 35 25)
fi
mkdir -p "$OUT"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
# One compilation cache for all steps (and for a second run on a still-warm machine).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/kvjax_gpu_check_jax_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
: > "$OUT/steps.tsv"
FAILED=0
START=$SECONDS
PYTEST=("$PY" -m pytest -q -rfEs --tb=short --durations=10 -p no:cacheprovider)

# run_step NAME LIMIT_S LOGFILE CMD...: runs CMD under a time limit (cut to what TOTAL_S
# leaves), appending to LOGFILE.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((TOTAL_S - (SECONDS - START)))
  if (( left < 10 )); then
    printf '%s\tskipped\t0s\n' "$name" >> "$OUT/steps.tsv"
    echo "$name: skipped, ${left}s left of TOTAL_S=$TOTAL_S"; FAILED=$((FAILED + 1)); return
  fi
  if (( limit > left )); then limit=$left; fi
  local start=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" >> "$log"
  timeout -s INT --kill-after=5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  printf '%s\t%s\t%ss\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
  if [[ $rc -ne 0 ]]; then FAILED=$((FAILED + 1)); fi
  echo "$name: exit $rc after $((SECONDS - start))s"
}

run_step env "${LIMITS[0]}" "$OUT/env.txt" bash -c \
  "command -v nvidia-smi >/dev/null && nvidia-smi; $PY -c 'import jax, sys; \
print(sys.executable, sys.version); print(jax.__version__, jax.default_backend(), jax.devices())'"
run_step pytest_gpu_kernel "${LIMITS[1]}" "$OUT/tests.log" \
  "${PYTEST[@]}" tests/test_paged_attention_gpu.py "${GPU_TEST_ARGS[@]}"
run_step pytest_gpu_quant "${LIMITS[2]}" "$OUT/tests.log" \
  "${PYTEST[@]}" tests/test_paged_attention_gpu_quant.py "${QUANT_TEST_ARGS[@]}"
run_step pytest_gpu_copies "${LIMITS[3]}" "$OUT/tests.log" \
  "${PYTEST[@]}" tests/test_kv_write.py tests/test_block_copy.py "${OTHER_TEST_ARGS[@]}"
run_step bench_quant_decode "${LIMITS[4]}" "$OUT/bench.log" \
  "$PY" benchmarks/bench_paged_attention.py --quant-only --out "$OUT/bench_quant.json" \
  "${QUANT_BENCH_ARGS[@]}"
rm -f "$OUT/bench_quant.md"  # its tables are in bench.log; $OUT keeps 8 files
run_step bench_paged_attention "${LIMITS[5]}" "$OUT/bench.log" \
  "$PY" benchmarks/bench_paged_attention.py --out "$OUT/bench.json" "${BENCH_ARGS[@]}"
rm -f "$OUT/bench.md"
run_step bench_pool_layout "${LIMITS[6]}" "$OUT/bench_tiers.log" \
  "$PY" benchmarks/bench_pool_layout.py "${LAYOUT_ARGS[@]}"
run_step bench_tiers_host "${LIMITS[7]}" "$OUT/bench_tiers.log" \
  "$PY" benchmarks/bench_tiers.py "${TIERS_ARGS[@]}"
run_step bench_remote "${LIMITS[8]}" "$OUT/bench.log" \
  "$PY" benchmarks/bench_remote.py --json "$OUT/bench_remote.json" "${REMOTE_ARGS[@]}"

echo "--- environment"
tail -n 3 "$OUT/env.txt"
echo "--- steps (name, exit code, seconds) in $OUT/steps.tsv; $((SECONDS - START))s in all"
cat "$OUT/steps.tsv"
echo "--- test summary"
grep -iE "^(FAILED|ERROR)|passed|failed|error|no tests ran" "$OUT/tests.log" | tail -n 30
echo "--- benchmarks (full tables in bench.log, bench_tiers.log)"
grep -E "^(#|\| [0-9]|\| blocks)|goal|failed|Error" "$OUT/bench.log" | tail -n 60
grep -E "^impl=|goals|met" "$OUT/bench_tiers.log" | tail -n 10
exit $((FAILED > 0))
