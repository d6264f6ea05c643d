#!/usr/bin/env bash
# One device call that checks and times a build: unpack the binaries packed here by
# scripts/pack_gpu_binaries.sh, run every GPU test (scripts/gpu_test.sh, logs packed into one
# file), then optionally the server suite on the CUDA engine and a same-call decode A/B
# (scripts/gpu_decode_ab.sh). Everything it writes goes to $OUT (at most 8 files come back).
#
#   device call, carry [".carry"] (+ ".whl-serve", ".carry-gpuserve" with --server):
#   bash scripts/gpu_call.sh [--server] [--filter F] [--only A,B] [--no-tests]
#                            [--ab "ARM" ...  (the rest of the line goes to gpu_decode_ab.sh)]
#   e.g. bash scripts/gpu_call.sh --server --ab --rounds 2 - DS_GEMV_L2_NEXT=16 DS_GEMV_L2_NEXT=32
#
#   ARCHIVE   the packed binaries (default .carry/bins.tar.xz)
# Budget: the tests take ~5 min, the server suite ~1 min, an A/B ~15 s per arm and round on the
# synthetic 27B: keep the whole call under a run's 10 minutes (or split it in two calls).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-call-out}
mkdir -p "$OUT"
ARCHIVE=${ARCHIVE:-.carry/bins.tar.xz}
tests=1
test_args=()
ab_args=()
while (($#)); do
  case "$1" in
    --server) test_args+=(--server) ;;
    --filter|--only) test_args+=("$1" "$2"); shift ;;
    --no-tests) tests=0 ;;
    --ab) shift; ab_args=("$@"); break ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "gpu_call: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -f "$ARCHIVE" ] || { echo "gpu_call: $ARCHIVE not found (scripts/pack_gpu_binaries.sh makes it)" >&2; exit 2; }
B=$(mktemp -d /tmp/ds-bins.XXXXXX)
tar -C "$B" -xJf "$ARCHIVE" || { echo "gpu_call: cannot unpack $ARCHIVE" >&2; exit 1; }
echo "gpu_call: binaries of $(head -1 "$B/bin/COMMIT" 2>/dev/null || echo '?') in $B"
[ -f "$B/libcupti.so.13" ] && export DS_CUPTI_LIB=${DS_CUPTI_LIB:-$B/libcupti.so.13}
rc=0
if [ $tests = 1 ]; then
  BUILD_DIR="$B" OUT="$B/test-logs" bash scripts/gpu_test.sh "${test_args[@]}" \
    --pack "$OUT/gpu_test_logs.tar.gz" 2>&1 | tee "$OUT/gpu_test.txt" | grep -E "^gpu_test: |^GPU (SERVER )?TESTS"
  grep -q "^GPU TESTS: .* 0 failed" "$OUT/gpu_test.txt" || rc=1
fi
if ((${#ab_args[@]})); then
  BIN="$B/bin/deltaserve" OUT="$OUT" bash scripts/gpu_decode_ab.sh "${ab_args[@]}" || rc=1
fi
exit $rc
