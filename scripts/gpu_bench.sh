#!/usr/bin/env bash
# The whole benchmark set in ONE device call (device time is scarce): ceilings, every kernel
# family, the per-kernel profile, prefill TTFT, decode TPOT, the concurrency-1 serving workload,
# then the plots; optionally the peers (HF transformers + flash-linear-attention, torch kernels).
#
# Run on the GPU machine from the repository root, with the binary built here and carried:
#   cmake -S . -B build-bench -DDS_CUDA=ON && cmake --build build-bench -j2 --target deltaserve
#   git rev-parse HEAD > build-bench/bin/COMMIT      (the commit measured; the device has no .git)
#   device call: carry [build-bench/bin] (+ .whl for --peers), command: bash scripts/gpu_bench.sh
#
# Flags: --peers (also run bench/peers/peers.py; needs the carried .whl/ wheels of fla-core and
#        flash-linear-attention), --quick (fewer shapes, fewer steps: a smoke run), --budget S
#        (seconds for the deltaserve bench, default 240), --total S (seconds for the whole script,
#        default 340: the peers get what is left), --http (also the serving workload over HTTP
#        against `deltaserve serve --synthetic 27b`, by bench/serve_http.py with the very prompt
#        lengths of the in-process run: serve_http.json), --bench all|serve|ceilings (which
#        deltaserve bench: default all; `serve` = ceilings + the in-process serving workload only),
#        --requests N (serving requests per bucket: default 3, 1 with --quick), --tokenizer DIR
#        (for --http: the server detokenizes and streams text, so serve_http.py needs no logprobs,
#        which cost the server a log-softmax per token; make one here with
#        `python3 tools/make_qwen35_test_tokenizer.py ../shared/data/tokenizers/qwen3.5 DIR`
#        into a carried folder; without it the HTTP TPOT includes that logprob cost).
# Output under $OUT (default ./bench-out), at most 8 files: bench.json, bench.log, tpot.png,
# ttft.png, profile.png, with --peers peers.json, peers.log, with --http serve_http.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
BIN=${BIN:-build-bench/bin/deltaserve}
peers=0
quick=0
http=0
budget=240
total=340
bench_cmd=all
requests=
tokenizer=
while [ $# -gt 0 ]; do
  case "$1" in
    --peers) peers=1 ;;
    --http) http=1 ;;
    --quick) quick=1 ;;
    --budget) budget=$2; shift ;;
    --total) total=$2; shift ;;
    --bench) bench_cmd=$2; shift ;;
    --requests) requests=$2; shift ;;
    --tokenizer) tokenizer=$2; shift ;;
    *) echo "gpu_bench.sh: unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
if [ ! -x "$BIN" ]; then
  echo "gpu_bench.sh: $BIN not found (build it here and carry build-bench/bin)" >&2
  exit 2
fi
# The binary links libcudart / libcublasLt dynamically: if the loader cannot find them, look in
# the CUDA toolkit and in the Python CUDA wheels of the machine.
if ldd "$BIN" | grep "not found" >/dev/null; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c 'import nvidia.cublas, nvidia.cuda_runtime, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib", os.path.dirname(nvidia.cuda_runtime.__file__) + "/lib")' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  ldd "$BIN" | grep "not found" && echo "gpu_bench.sh: libraries still missing (above)" >&2
fi
export DS_BENCH_COMMIT=${DS_BENCH_COMMIT:-$(cat "$(dirname "$BIN")/COMMIT" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
LOG=$OUT/bench.log
{
  echo "gpu_bench.sh: commit $DS_BENCH_COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used --format=csv 2>&1
} | tee "$LOG"

# Decode cases: batch 1 at every context bucket (the PERF.md targets), batch 4 up to 8K, batch 16
# at 4K: the KV cache is filled by real prefill, and 16 x 32K tokens of it would take most of the
# call (`deltaserve bench decode --batch 1,4,16` runs the full grid when time allows).
[ -n "$requests" ] || { [ $quick = 1 ] && requests=1 || requests=3; }
case "$bench_cmd" in
  all)
    if [ $quick = 1 ]; then
      args=(--profile --quick --cases 1@4096,4@4096,1@32768 --prompt 4096,32768 --repeats 1,1 --steps 32)
    else
      args=(--profile --cases 1@4096,4@4096,16@4096,1@8192,4@8192,1@16384,1@32768
            --prompt 4096,8192,16384,32768 --steps 128)
    fi
    args+=(--requests "$requests") ;;
  serve) args=(--requests "$requests") ;;
  ceilings) args=() ;;
  *) echo "gpu_bench.sh: --bench must be all, serve or ceilings" >&2; exit 2 ;;
esac
# --max-seconds bounds each engine bench; `timeout` bounds the whole (JSON is saved after each part).
args+=(--max-seconds $((budget * 3 / 10)))
timeout --signal=INT $((budget + 30)) "$BIN" bench "$bench_cmd" --json "$OUT/bench.json" \
 "${args[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "gpu_bench.sh: bench $bench_cmd exited with $rc" | tee -a "$LOG"

if [ $http = 1 ]; then
  # The same workload through the HTTP server (client-side timings): the same prompt lengths as
  # the in-process run when bench.json has them.
  port=18000
  tok_args=()
  [ -n "$tokenizer" ] && tok_args=(--tokenizer "$tokenizer")
  "$BIN" serve --synthetic 27b --device cuda --port $port --max-batch 1 --chunk-size 8192 \
    --max-num-batched-tokens 8192 --max-kv-tokens 40000 --max-model-len 33024 "${tok_args[@]}" >>"$LOG" 2>&1 &
  spid=$!
  up=0
  for _ in $(seq 1 180); do
    kill -0 "$spid" 2>/dev/null || break
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
      up=1
      break
    fi
    sleep 1
  done
  [ $up = 1 ] || echo "gpu_bench.sh: the server did not come up (see the log above)" | tee -a "$LOG"
  http_args=(--requests "$requests")
  python3 -c "import json,sys; sys.exit(0 if json.load(open('$OUT/bench.json')).get('serve') else 1)" 2>/dev/null \
    && http_args=(--prompts-from "$OUT/bench.json")
  [ $up = 1 ] && PYTHONUNBUFFERED=1 timeout $((budget / 2 + 60)) python3 bench/serve_http.py \
    --url http://127.0.0.1:$port "${http_args[@]}" --json "$OUT/serve_http.json" 2>&1 | tee -a "$LOG"
  kill "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null
fi

plot() {
  [ -f "$OUT/bench.json" ] || return 0
  local plot_args=("$OUT/bench.json" --out "$OUT")
  [ -f "$OUT/peers.json" ] && plot_args+=(--peers "$OUT/peers.json")
  python3 bench/plot.py "${plot_args[@]}" 2>&1 | tee -a "$LOG"
}
plot  # first, so the plots exist even if the peers run out of time

left=$((total - SECONDS - 20))
if [ $peers = 1 ] && [ $left -lt 40 ]; then
  echo "gpu_bench.sh: only ${left} s left of ${total}: peers skipped" | tee -a "$LOG"
elif [ $peers = 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_bench.sh: no .whl/ wheels carried: the GDN peers and the model's FLA path are skipped" | tee -a "$LOG"
  fi
  peer_args=(--json "$OUT/peers.json" --budget $((left - 25)))
  [ $quick = 1 ] && peer_args+=(--quick)
  PYTHONUNBUFFERED=1 timeout $left python3 bench/peers/peers.py "${peer_args[@]}" 2>&1 | tee "$OUT/peers.log"
  plot
fi
echo "gpu_bench.sh: done in ${SECONDS} s" | tee -a "$LOG"
exit $rc
