#!/usr/bin/env bash
# Runs every GPU test (tests/cuda/cuda_*_test binaries) on a machine with an NVIDIA GPU, in one go,
# and prints one summary line at the end. Works from binaries built elsewhere and carried over
# (the device machine has no build tools for our dependencies): it checks their shared libraries
# first and points the tests at this checkout's test data.
#   BUILD_DIR   build folder holding tests/ (default build-cuda)
#   OUT         where logs go (default ./gpu-test-logs)
#   --perf      also run the synthetic-27B timing and the timing-only kernel tests (DS_PERF=1;
#               without it they skip: ~50 s of the ~400 s run on the H200 in session 30)
#   --filter F  gtest filter for every binary
#   --only A,B  run only these binaries (names without the folder, e.g. cuda_hf_compare_test)
#   --hf-compare DIR  also compare with HF transformers at the 27B shapes: cuda_hf_compare_test
#               writes our logits for 4 and 64 layers (synthetic weights made on the GPU, no
#               checkpoint: 2.1 GB of logits per layer count) and the weight fingerprint to DIR,
#               then tools/hf_compare.py rebuilds the weights in HF and compares (its JSON goes to
#               $OUT/hf_compare.json); the logits files are deleted afterwards.
#               $DS_HF_COMPARE_LAYERS picks the layer counts (default 4,64). Run it before
#               installing flash-linear-attention so that HF uses its fp32 torch GDN path.
#   --hf-fp32-control  with --hf-compare: also run HF in fp32 (108 GB of GPU memory at 64 layers)
#               and report ours and HF bf16 against it (how much of the gap is bf16 itself)
#   --pack FILE  also write every log of this run into one FILE.tar.gz (a device call returns at
#               most 8 files: run with OUT=/tmp/gt and --pack "$OUT/gpu_test_logs.tar.gz")
#   --server    also the server pytest suite on the CUDA engine (scripts/gpu_server_test.sh: needs
#               $BUILD_DIR/bin/deltaserve and the carried .whl-serve/ wheels of pytest + openai),
#               counted as one more entry of the summary line
#   GPU_TEST_TIMEOUT  seconds one binary may run (default 240, 900 with --perf / --hf-compare;
#               the slowest binary took 60 s in session 21): a hung kernel fails its binary
#               (rc 124) and the run goes on, instead of taking the whole device call with it
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-cuda}
LOG_DIR=${OUT:-$PWD/gpu-test-logs}
mkdir -p "$LOG_DIR"
FILTER="*"
ONLY=""
HF_ARGS=""
SERVER=0
PACK=""
while (($#)); do
  case "$1" in
    --perf) export DS_PERF=1 ;;
    --filter) FILTER="$2"; shift ;;
    --hf-compare) export DS_HF_COMPARE_DIR="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --hf-fp32-control) HF_ARGS="--fp32-control" ;;
    --server) SERVER=1 ;;
    --pack) PACK="$2"; shift ;;
    *) echo "gpu_test: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "${DS_PERF:-}${DS_HF_COMPARE_DIR:-}" ]; then per_bin=${GPU_TEST_TIMEOUT:-900}; else per_bin=${GPU_TEST_TIMEOUT:-240}; fi
export DS_TEST_DATA_DIR="$PWD/tests/data" DS_SOURCE_DIR_OVERRIDE="$PWD"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>&1 | tee "$LOG_DIR/gpu.txt"
bins=$(ls "$BUILD_DIR"/tests/cuda_*_test 2>/dev/null | sort)
if [ -n "$ONLY" ]; then
  sel=""
  for n in ${ONLY//,/ }; do
    [ -x "$BUILD_DIR/tests/$n" ] || { echo "gpu_test: --only: $BUILD_DIR/tests/$n not found"; exit 1; }
    sel="$sel $BUILD_DIR/tests/$n"
  done
  bins=$sel
fi
if [ -z "$bins" ]; then
  echo "gpu_test: no GPU test binaries in $BUILD_DIR/tests (build with -DDS_CUDA=ON)"; exit 1
fi
missing=0
for b in $bins; do
  if ldd "$b" | grep "not found" >/dev/null; then
    echo "gpu_test: $b misses shared libraries:"; ldd "$b" | grep "not found"; missing=1
  fi
done
((missing)) && exit 1
pass=0; fail=0; failed=""
for b in $bins; do
  name=$(basename "$b")
  start=$(date +%s)
  timeout -k 10 "$per_bin" "$b" --gtest_filter="$FILTER" --gtest_color=no \
    >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "gpu_test: $name ran past $per_bin s (GPU_TEST_TIMEOUT): stopped" | tee -a "$LOG_DIR/$name.log"
  fi
  secs=$(( $(date +%s) - start ))
  n_ok=$(grep -c "^\[       OK \]" "$LOG_DIR/$name.log")
  n_bad=$(grep -c "^\[  FAILED  \].*(" "$LOG_DIR/$name.log")
  grep -E "^  |^PERF|SKIPPED \]|FAILED|Failure|error" "$LOG_DIR/$name.log" | head -60
  if [ $rc -eq 0 ]; then
    pass=$((pass + 1)); echo "gpu_test: $name ok ($n_ok tests, ${secs}s)"
  else
    fail=$((fail + 1)); failed="$failed $name"
    echo "gpu_test: $name FAILED (rc $rc, $n_bad failed, ${secs}s)"; tail -30 "$LOG_DIR/$name.log"
  fi
done
if [ -n "${DS_HF_COMPARE_DIR:-}" ]; then
  if [ -f "$DS_HF_COMPARE_DIR/compare.json" ] && \
     PYTHONUNBUFFERED=1 python3 tools/hf_compare.py "$DS_HF_COMPARE_DIR" --json "$LOG_DIR/hf_compare.json" $HF_ARGS \
       2>&1 | tee "$LOG_DIR/hf_compare.log"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); failed="$failed hf_compare"
  fi
  rm -f "$DS_HF_COMPARE_DIR"/ours_L*.npy
fi
if [ "$SERVER" = 1 ]; then
  if BUILD_DIR="$BUILD_DIR" OUT="$LOG_DIR/server" bash scripts/gpu_server_test.sh 2>&1 | tail -12; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); failed="$failed gpu_server_test"
  fi
fi
summary="GPU TESTS: $pass binaries passed, $fail failed${failed:+ (}${failed# }${failed:+)} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "$summary" | tee "$LOG_DIR/summary.txt"
if [ -n "$PACK" ]; then
  mkdir -p "$(dirname "$PACK")"
  tar -C "$LOG_DIR" -czf "$PACK" . && echo "gpu_test: logs packed into $PACK"
fi
[ $fail -eq 0 ]
