#!/usr/bin/env bash
# Runs the server's Python tests (tests/python/test_server_*.py: the official openai client,
# streaming, tools, stops, logprobs, 32 concurrent clients with cancellations, the bad-input
# suite, SIGTERM drain, bench/serve_http.py) against `deltaserve serve --device cuda` on the GPU
# machine, from binaries built elsewhere and carried over (like scripts/gpu_test.sh), and prints one
# summary line at the end: `GPU SERVER TESTS: <pytest's summary> on <GPU>`.
#
# The GPU machine cannot fetch packages: pytest and the openai client (and what they need) travel
# as wheels for Python 3.12 in .whl-serve/ (ignored; `pip download` them here, see docs/SERVER.md)
# and are installed into /tmp/serve-site, which goes first on PYTHONPATH. The Qwen3 tokenizer the
# tests need does not travel with ../shared either: copy it into the carried folder (see below).
#   BUILD_DIR   build folder holding bin/deltaserve (default build-cuda)
#   OUT         where logs go (default ./gpu-server-logs): pytest.log, junit.xml, server logs
#   WHEELS      wheel folder (default .whl-serve); absent: python3 must already have pytest + openai
#   DS_QWEN3_TOKENIZER_DIR  tokenizer.json + tokenizer_config.json of Qwen3 (default: the first of
#               ../shared/data/tokenizers/qwen3 and .carry-gpuserve/tokenizers/qwen3 that exists)
#   DS_TEST_DEVICE  cuda (default; cpu checks the script itself on a machine without a GPU)
#   --timeout S   wall-clock limit of the pytest run (default 240 s; the CPU run takes ~30-60 s)
#   -k EXPR       pytest -k expression (default: every test)
#   --files F,G   test files instead of tests/python/test_server_*.py
# Exit status: pytest's (0: every test passed; skips are listed with their reasons: a test skips
# only when a timing is too fast to judge or the generated text has no usable stop string).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-cuda}
LOG_DIR=${OUT:-$PWD/gpu-server-logs}
WHEELS=${WHEELS:-.whl-serve}
SITE=/tmp/serve-site
TIMEOUT=240
KEXPR=""
FILES=""
while (($#)); do
  case "$1" in
    --timeout) TIMEOUT="$2"; shift ;;
    -k) KEXPR="$2"; shift ;;
    --files) FILES="$2"; shift ;;
    *) echo "gpu_server_test: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$LOG_DIR"
BIN="$BUILD_DIR/bin/deltaserve"
[ -x "$BIN" ] || { echo "gpu_server_test: $BIN not found (build the deltaserve target with -DDS_CUDA=ON)"; exit 1; }
if ldd "$BIN" | grep "not found" >/dev/null; then
  echo "gpu_server_test: $BIN misses shared libraries:"; ldd "$BIN" | grep "not found"; exit 1
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | tee "$LOG_DIR/gpu.txt"

# pytest + openai from the carried wheels (only ours on the path first; entry-point plugins of
# the machine's own pytest are not loaded: they may not match this pytest).
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$LOG_DIR/pip.log" 2>&1 || { echo "gpu_server_test: wheel install failed:"; tail -20 "$LOG_DIR/pip.log"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_server_test: no wheels in $WHEELS: using python3's own packages"
fi
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, pytest, openai; print("python", sys.version.split()[0], "pytest", pytest.__version__, "openai", openai.__version__)' \
  2>&1 | tee -a "$LOG_DIR/pip.log" || { echo "gpu_server_test: python3 lacks pytest or openai"; exit 1; }

if [ -z "${DS_QWEN3_TOKENIZER_DIR:-}" ]; then
  for d in ../shared/data/tokenizers/qwen3 .carry-gpuserve/tokenizers/qwen3; do
    if [ -f "$d/tokenizer.json" ]; then export DS_QWEN3_TOKENIZER_DIR="$PWD/$d"; break; fi
  done
fi
[ -f "${DS_QWEN3_TOKENIZER_DIR:-/nonexistent}/tokenizer.json" ] || {
  echo "gpu_server_test: no Qwen3 tokenizer (set DS_QWEN3_TOKENIZER_DIR or copy" \
       "../shared/data/tokenizers/qwen3/tokenizer*.json into .carry-gpuserve/tokenizers/qwen3)"; exit 1; }

export DS_BUILD_DIR="$PWD/$BUILD_DIR" DS_TEST_DEVICE=${DS_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1
[[ "$BUILD_DIR" = /* ]] && export DS_BUILD_DIR="$BUILD_DIR"
if [ -n "$FILES" ]; then files=${FILES//,/ }; else files=$(ls tests/python/test_server_*.py); fi
TMPBASE=/tmp/serve-pytest
rm -rf "$TMPBASE"
args=(-p no:cacheprovider -rsfE --durations=10 --junitxml="$LOG_DIR/junit.xml" --basetemp="$TMPBASE")
[ -n "$KEXPR" ] && args+=(-k "$KEXPR")
echo "gpu_server_test: $BIN --device $DS_TEST_DEVICE, tokenizer $DS_QWEN3_TOKENIZER_DIR, limit ${TIMEOUT}s:" $files
start=$(date +%s)
timeout --kill-after=10 "$TIMEOUT" python3 -m pytest "${args[@]}" $files 2>&1 | tee "$LOG_DIR/pytest.log"
rc=${PIPESTATUS[0]}
secs=$(( $(date +%s) - start ))
# The servers' logs (pytest's tmp folders; the tiny checkpoints stay behind).
(cd "$TMPBASE" 2>/dev/null && find . -name '*.log' -size -20M | while read -r f; do
   mkdir -p "$LOG_DIR/server-logs/$(dirname "$f")"; cp "$f" "$LOG_DIR/server-logs/$f"; done)
summary=$(grep -E "^=* ?[0-9]+ (passed|failed|error|errors|skipped|deselected).* in [0-9.]+s" "$LOG_DIR/pytest.log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
[ -n "$summary" ] || summary="no pytest summary (rc $rc$([ $rc -eq 124 ] && echo ": timed out after ${TIMEOUT}s"))"
grep -q "skipped" <<<"$summary" && echo "gpu_server_test: some tests were skipped: their reasons are in the 'short test summary info' above"
echo "GPU SERVER TESTS: $summary (${secs}s, rc $rc) on ${GPU:-no GPU}"
[ $rc -eq 0 ]
