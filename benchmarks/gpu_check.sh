#!/usr/bin/env bash
# The prepared device check for a GPU machine (H200): kernel tests compiled for the GPU (the
# attention kernel on float pools, then on quantized int8/fp8 pools), the quantized decode
# comparison (issue 6's goal: >= 1.6x the bfloat16 decode throughput at ctx >= 4k), the other
# kernels' tests, then the paged-attention benchmark, then the host tier's moves (issue 11:
# device->host and host->device of 64 blocks against one device_put to/from pinned_host, GB/s
# each, and the one-block fetch p50/p99). Runs from the repository root, installs nothing, keeps
# going after a failing step and records every step's exit code and seconds in $OUT/steps.tsv.
#
#   bash benchmarks/gpu_check.sh               # on the GPU machine; results in ${OUT:-./gpu_results}
#   bash benchmarks/gpu_check.sh --cpu-smoke   # here: same steps, CPU-sized, to exercise the script
#
# Step time limits add up to 480 s (550 s with the kill grace), under 9.5 minutes; each
# paged-attention benchmark also stops starting new cases after its --budget-s. $OUT receives
# at most 9 files: env.txt, tests.log, bench.log, bench_quant.json, bench_quant.md, bench.json,
# bench.md, bench_tiers.log, steps.tsv.
set -u

MODE=gpu
if [[ "${1:-}" == "--cpu-smoke" ]]; then MODE=cpu-smoke; fi

cd "$(dirname "$0")/.."
if [[ "$MODE" == cpu-smoke ]]; then
  OUT="${OUT:-$(mktemp -d /tmp/gpu_check_smoke.XXXXXX)}"
  PY="${PYTHON:-.venv/bin/python}"
  GPU_TEST_ARGS=(-k "work_item or rejects or lowers or group_not")
  QUANT_TEST_ARGS=(-k "lowers or write or copies")
  OTHER_TEST_ARGS=(-k "num_seqs_zero or rejects")
  QUANT_BENCH_ARGS=(--quick --rounds 2 --budget-s 30)
  BENCH_ARGS=(--quick --rounds 3 --budget-s 60)
  TIERS_ARGS=(--host-only --quick)
  LIMITS=(60 240 240 240 240 240 120)
else
  OUT="${OUT:-./gpu_results}"
  PY="${PYTHON:-python3}"
  GPU_TEST_ARGS=()
  QUANT_TEST_ARGS=()
  OTHER_TEST_ARGS=()
  QUANT_BENCH_ARGS=(--budget-s 50)
  BENCH_ARGS=(--budget-s 80 --sweep)
  # 1 MiB blocks (16 layers, 8 KV heads, page 16, head_dim 128, bf16): 64 MiB per move
  TIERS_ARGS=(--host-only --quick --repeats 10 --num-layers 16 --num-kv-heads 8)
  # env, float-pool kernel tests, quantized kernel tests, quantized bench, other kernels, bench,
  # host tier moves
  LIMITS=(15 115 60 85 55 110 40)
fi
mkdir -p "$OUT"
export PYTHONPATH=.
: > "$OUT/steps.tsv"
FAILED=0

# run_step NAME LIMIT_S LOGFILE CMD...: runs CMD under a time limit, appending to LOGFILE.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S)): $*" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  printf '%s\t%s\t%ss\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
  if [[ $rc -ne 0 ]]; then FAILED=$((FAILED + 1)); fi
  echo "$name: exit $rc after $((SECONDS - start))s"
}

# Test files that exist among the kernel tests; the GPU kernel's own files run first, alone.
GPU_TESTS=tests/test_paged_attention_gpu.py
QUANT_TESTS=tests/test_paged_attention_gpu_quant.py
other_tests=()
for f in tests/test_paged_attention_*.py tests/test_kv_write*.py tests/test_block_copy*.py; do
  if [[ -f "$f" && "$f" != "$GPU_TESTS" && "$f" != "$QUANT_TESTS" ]]; then other_tests+=("$f"); fi
done

run_step env "${LIMITS[0]}" "$OUT/env.txt" bash -c \
  "command -v nvidia-smi >/dev/null && nvidia-smi; $PY -c 'import jax, sys; \
print(sys.version); print(jax.__version__, jax.default_backend(), jax.devices())'"
run_step pytest_gpu_kernel "${LIMITS[1]}" "$OUT/tests.log" \
  "$PY" -m pytest -q -rfEs --durations=10 -p no:cacheprovider \
  "$GPU_TESTS" "${GPU_TEST_ARGS[@]}"
run_step pytest_gpu_quant "${LIMITS[2]}" "$OUT/tests.log" \
  "$PY" -m pytest -q -rfEs --durations=10 -p no:cacheprovider \
  "$QUANT_TESTS" "${QUANT_TEST_ARGS[@]}"
run_step bench_quant_decode "${LIMITS[3]}" "$OUT/bench.log" \
  "$PY" benchmarks/bench_paged_attention.py --quant-only --out "$OUT/bench_quant.json" \
  "${QUANT_BENCH_ARGS[@]}"
if [[ ${#other_tests[@]} -gt 0 ]]; then
  run_step pytest_other_kernels "${LIMITS[4]}" "$OUT/tests.log" \
    "$PY" -m pytest -q -rfEs --durations=10 -p no:cacheprovider \
    "${other_tests[@]}" "${OTHER_TEST_ARGS[@]}"
fi
run_step bench_paged_attention "${LIMITS[5]}" "$OUT/bench.log" \
  "$PY" benchmarks/bench_paged_attention.py --out "$OUT/bench.json" "${BENCH_ARGS[@]}"
run_step bench_tiers_host "${LIMITS[6]}" "$OUT/bench_tiers.log" \
  "$PY" benchmarks/bench_tiers.py "${TIERS_ARGS[@]}"

echo "--- steps (name, exit code, seconds) in $OUT/steps.tsv"
cat "$OUT/steps.tsv"
echo "--- test summary"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 6
for md in bench_quant bench; do
  if [[ -f "$OUT/$md.md" ]]; then echo "--- $md"; cat "$OUT/$md.md"; fi
done
if [[ -f "$OUT/bench_tiers.log" ]]; then echo "--- bench_tiers (host)"; cat "$OUT/bench_tiers.log"; fi
exit $((FAILED > 0))
