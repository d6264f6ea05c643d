#!/usr/bin/env bash
# The measurements sessions 22-24 planned (docs/perf/prefill_gaps.md, "Session 23" and "Session
# 24"; run in session 24, results there and in the pages they name), and sessions 26-27's (`attn`,
# `argmax`, `tma`, `quick`: their tests and a short A/B ran on an H100 in session 29, "Session 29"
# in attn_prefill_ws.md and decode_gemv.md; `attn` on the H200 and an H100 in session 30); kept for
# re-runs after changes, one device call per step, from the binaries packed here by
# scripts/pack_gpu_binaries.sh (carry [".carry"]). Everything goes to $OUT.
#
#   bash scripts/gpu_pending.sh tests     # ~5 min: every GPU test (gpu_test.sh, logs packed)
#   bash scripts/gpu_pending.sh kernels   # ~5 min: the new kernels beside the shipped ones
#   bash scripts/gpu_pending.sh decode    # ~7 min: decode A/B of the new switches + profiles
#   bash scripts/gpu_pending.sh prompts   # ~5 min: prompt A/B of the new forms
#   bash scripts/gpu_pending.sh ncu       # ~2 min, if time is left: Nsight Compute of the fused
#                                         # GDN kernels (stall reasons: does the output pace?)
#   BUDGET=560 bash scripts/gpu_pending.sh attn  # ~7 min: the prompt attention's default
#                                         # (wgmma_ws_lazy since session 30) against wgmma_ws_lean
#                                         # (attn_prefill_ws.md): the tests, bench kernels x3 each
#                                         # way interleaved, whole prompts of 2K-32K (and ulean)
#   bash scripts/gpu_pending.sh wy        # ~1 min: session 31's WY phase stamps: their bits,
#                                         # then where one WY item's time goes (gdn_prefill.md)
#   BUDGET=560 bash scripts/gpu_pending.sh early  # ~7 min: session 32's early gdn_decode start
#                                         # ($DS_GDN_EARLY=1; decode_gemv.md): the GEMV's and the
#                                         # engine's tests, in-graph profiles at 4K both ways, the
#                                         # A/B at batch 1 (4K / 8K / 32K) and 2
#   BUDGET=300 bash scripts/gpu_pending.sh attno  # ~2-3 min: session 33's probe, attn_o off PDL
#                                         # ($DS_ATTN_O_PDL=0; decode_gemv.md): the engine's bits
#                                         # both ways, in-graph profiles at 4K both ways, the A/B
#   BUDGET=560 bash scripts/gpu_pending.sh ahead  # ~6-8 min: session 34's probe, each decode
#                                         # GEMV queueing its next stages for L2 after its wait
#                                         # ($DS_GEMV_AHEAD=KiB, off: measured in session 36;
#                                         # decode_gemv.md): the kernels' and the engine's bits
#                                         # (batch 1, 2, 16), profiles at 4K (0 / 80), the A/B
#                                         # (off / 80 / the TMA GEMV's at 40; batch 1, 2, 16)
#   BUDGET=560 bash scripts/gpu_pending.sh argmax  # ~8 min: session 27's decode head in one kernel
#                                         # ($DS_ARGMAX_FUSED=1: the argmax in lm_head's epilogue;
#                                         # $DS_HEAD_NORM=1: the final norm in its prologue;
#                                         # decode_gemv.md): the tests, in-graph profiles at 4K
#                                         # both ways (the expected gain, ~15-20 us a step, is
#                                         # below the A/B's spread), the A/B
#   BUDGET=560 bash scripts/gpu_pending.sh tma     # ~7 min: session 27's wider TMA GEMV stages
#                                         # ($DS_GEMV_TMA_KBOX=2 / 4, batch 5-16; decode_gemv.md):
#                                         # the tests both ways, bench kernels (kb rows), the
#                                         # decode A/B at batch 8 / 16 (issue 6's 1.3x gate)
#   BUDGET=560 bash scripts/gpu_pending.sh quick   # ~9 min: if ONE call is all a session gets:
#                                         # the tests of every never-run form (sessions 26-27),
#                                         # the attention kernels default vs wgmma_ws_ulean, and
#                                         # one decode A/B: the fused head and kbox 2, each alone
# A session has 30 minutes of device time: tests + attn + argmax (~20 min of steps, about
# 30 with the machine's start) fill one, tma and kernels the next; with a single call, quick.
#
#   ARCHIVE   the packed binaries (default .carry/bins.tar.xz)
#   DRY=1     print the commands instead of running them (what the pytest checks)
#   BUDGET    seconds one step may take in all (default 480; later commands are skipped)
#   SKIP_FUSED=1  leave out the fused GDN state pass + output ($DS_GDN_STATE=fused / fused2: run on
#             no GPU before; set it when the tests step saw CudaGdn.PrefillFusedBitExact fail or hang)
#   FUSED_FORM  the fused form the prompts step times (default fused; fused2 if the kernels step
#             found the two-output-warpgroup form faster)
# Keep each step under a run's 10 minutes: the steps are separate calls.
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
OUT=${OUT:-/tmp/gpu-pending-out}
ARCHIVE=${ARCHIVE:-.carry/bins.tar.xz}
case "$step" in
  tests|kernels|decode|prompts|ncu|attn|wy|early|attno|ahead|argmax|tma|quick) ;;
  *) echo "gpu_pending: step must be tests, kernels, decode, prompts, ncu, attn, wy, early, attno, ahead, argmax, tma or quick, got '$step'" >&2
     exit 2 ;;
esac
mkdir -p "$OUT"

# A step must end inside one device call (600 s): each command gets what is left of BUDGET
# seconds (default 480) from the step's start, and is skipped once less than a minute is left.
START=$(date +%s)
BUDGET=${BUDGET:-480}
left() { echo $((BUDGET - ($(date +%s) - START))); }
run() {  # run (or print) one command, its output to $OUT/$1.txt
  local name=$1; shift
  if [ "${DRY:-0}" = 1 ]; then
    printf '%s:' "$name"; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  local t
  t=$(left)
  if [ "$t" -lt 60 ]; then
    echo "gpu_pending: $name skipped ($t s of the step's budget left)" | tee "$OUT/$name.txt"
    return 1
  fi
  echo "gpu_pending: $name (up to $t s)"
  timeout "$t" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -5 "$OUT/$name.txt"
  return $rc
}

if [ "${DRY:-0}" = 1 ]; then
  B=/tmp/ds-pending-bins
else
  [ -f "$ARCHIVE" ] || { echo "gpu_pending: $ARCHIVE not found (scripts/pack_gpu_binaries.sh)" >&2; exit 2; }
  B=$(mktemp -d /tmp/ds-pending.XXXXXX)
  tar -C "$B" -xJf "$ARCHIVE" || { echo "gpu_pending: cannot unpack $ARCHIVE" >&2; exit 1; }
  [ -f "$B/libcupti.so.13" ] && export DS_CUPTI_LIB=${DS_CUPTI_LIB:-$B/libcupti.so.13}
  nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader >"$OUT/gpu.txt" 2>&1
fi
DS=$B/bin/deltaserve
T=$B/tests
rc=0
# inprof NAME VAR VALUE...: the batch-1 in-graph decode profile at 4K with VAR at each VALUE,
# into NAME<VALUE>.txt.
inprof() {
  local name=$1 var=$2 v
  shift 2
  for v in "$@"; do
    run "$name$v" env "$var=$v" DS_PROFILE=1 DS_PROFILE_BATCHES=1 DS_PROFILE_CONTEXT=4096 \
      "$T/cuda_decode_profile_test" --gtest_filter=DecodeProfile.Synthetic27bInGraph || rc=1
  done
}
# decode_ab CASES ROUNDS ARM...: the decode A/B (scripts/gpu_decode_ab.sh) in what is left of the
# step's budget, skipped below 70 s; DRY prints it, arms with spaces in double quotes.
decode_ab() {
  local cases=$1 rounds=$2 arms="" a
  shift 2
  for a in "$@"; do
    case "$a" in *" "*) arms+=" \"$a\"" ;; *) arms+=" $a" ;; esac
  done
  if [ "${DRY:-0}" = 1 ]; then
    echo "decode_ab: BIN=$DS bash scripts/gpu_decode_ab.sh --cases $cases --rounds $rounds$arms"
    return 0
  fi
  [ "$(left)" -ge 70 ] && BIN="$DS" OUT="$OUT" timeout $(($(left) - 10)) bash scripts/gpu_decode_ab.sh \
    --cases "$cases" --rounds "$rounds" "$@" || rc=1
  rm -f "$OUT/decode_ab.full.log"
}
# The prompt attention's TMA forms switched off in turn (dispatch order since session 30:
# ws_lazy, ws_lean, ws3_lean, ws3, ws, ws3_persist, ws3_lean_persist, ws_ulean, m128): LEAN runs
# wgmma_ws_lean (the session-25 default, the A/B reference of session 30's), PLAIN the plain forms
# (the lean forms' fallbacks), PERSIST the persistent ones, ULEAN wgmma_ws_ulean.
LEAN="DS_DISABLE_KERNELS=attn_prefill.wgmma_ws_lazy"
PLAIN="$LEAN,attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws_lean"
PERSIST="$PLAIN,attn_prefill.wgmma_ws3,attn_prefill.wgmma_ws"
ULEAN="$PERSIST,attn_prefill.wgmma_ws3_persist,attn_prefill.wgmma_ws3_lean_persist"
case "$step" in
  tests)
    if [ "${DRY:-0}" = 1 ]; then
      echo "tests: BUILD_DIR=$B OUT=/tmp/gt bash scripts/gpu_test.sh --pack $OUT/gpu_test_logs.tar.gz"
    else
      # No outer timeout (it would leave the binary it stops running): each binary has its own
      # (GPU_TEST_TIMEOUT), and the run takes ~5 min.
      BUILD_DIR="$B" OUT=/tmp/gt GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-180} bash scripts/gpu_test.sh \
        --pack "$OUT/gpu_test_logs.tar.gz" >"$OUT/gpu_test.txt" 2>&1 || rc=1
      grep -E "^gpu_test: |^GPU TESTS" "$OUT/gpu_test.txt"
    fi
    ;;
  kernels)
    run attn_prefill "$DS" bench kernels --only attn_prefill || rc=1
    run gemm "$DS" bench kernels --only gemm || rc=1
    # (its last row is the fused GDN kernel: capped, so that a hang there costs 150 s at most)
    # (timing-only tests run with DS_PERF=1 alone)
    run gdn_stage timeout 150 env DS_PERF=1 "$T/cuda_gdn_test" \
      --gtest_filter='CudaGdn.PrefillStageTiming:CudaGdn.WyPhaseTiming' || rc=1
    # The whole GDN layer: the shipped pair, then the state pass with the output fused in.
    run gdn_layer "$DS" bench kernels --only gdn_prefill || rc=1
    if [ "${SKIP_FUSED:-0}" != 1 ]; then
      for form in fused fused2; do
        run "gdn_layer_$form" timeout 120 env DS_GDN_STATE=$form "$DS" bench kernels \
          --only gdn_prefill || rc=1
      done
    fi
    run attn_decode_timing env DS_PERF=1 "$T/cuda_attention_decode_test" \
      --gtest_filter=CudaAttentionDecode.Timing || rc=1
    ;;
  decode)
    if [ "${DRY:-0}" = 1 ]; then
      echo "decode_ab: BIN=$DS bash scripts/gpu_decode_ab.sh --cases 1@4096,1@8192,1@32768,16@4096 --rounds 2 - DS_MLP_FUSED=1 DS_MLP_FUSED=2 DS_MLP_FUSED=3 DS_GEMV_NORM_EARLY=0 DS_ATTN_DECODE=pdl_cluster"
    else
      BIN="$DS" OUT="$OUT" timeout $(($(left) - 150)) bash scripts/gpu_decode_ab.sh \
        --cases 1@4096,1@8192,1@32768,16@4096 --rounds 2 - DS_MLP_FUSED=1 DS_MLP_FUSED=2 \
        DS_MLP_FUSED=3 DS_GEMV_NORM_EARLY=0 DS_ATTN_DECODE=pdl_cluster || rc=1
    fi
    for ctx in 4096 8192; do
      run "inprof_$ctx" env DS_PROFILE=1 DS_PROFILE_BATCHES=1 DS_PROFILE_CONTEXT=$ctx \
        "$T/cuda_decode_profile_test" --gtest_filter=DecodeProfile.Synthetic27bInGraph || rc=1
    done
    run inprof_4096_mlp3 env DS_MLP_FUSED=3 DS_PROFILE=1 DS_PROFILE_BATCHES=1 \
      DS_PROFILE_CONTEXT=4096 "$T/cuda_decode_profile_test" \
      --gtest_filter=DecodeProfile.Synthetic27bInGraph || rc=1
    ;;
  prompts)
    # The fused GDN form last in the arms, and only without SKIP_FUSED.
    FUSED=DS_GDN_STATE=${FUSED_FORM:-fused}
    case "$FUSED" in DS_GDN_STATE=fused|DS_GDN_STATE=fused2) ;;
      *) echo "gpu_pending: FUSED_FORM must be fused or fused2" >&2; exit 2 ;; esac
    [ "${SKIP_FUSED:-0}" = 1 ] && FUSED=
    if [ "${DRY:-0}" = 1 ]; then
      echo "prefill_ab: BIN=$DS bash scripts/gpu_decode_ab.sh --prefill 4096,32768 --repeats 3,1 --rounds 2 - DS_GDN_STATE=tight $PLAIN $PERSIST $FUSED"
    else
      # (each arm's process at most 90 s: a hang costs that arm, not the whole step)
      ARM_TIMEOUT=90 BIN="$DS" OUT="$OUT" timeout "$(left)" bash scripts/gpu_decode_ab.sh \
        --prefill 4096,32768 \
        --repeats 3,1 --rounds 2 - DS_GDN_STATE=tight "$PLAIN" "$PERSIST" $FUSED || rc=1
    fi
    ;;
  ncu)
    # One launch of each fused form in CudaGdn.DISABLED_ProfileOnce (slice_scan_wg's launch runs
    # the form $DS_GDN_STATE names), full sections and SASS counters (scripts/gpu_ncu.sh).
    for form in fused fused2; do
      run "ncu_$form" env DS_GDN_STATE=$form OUT="$OUT/ncu_$form" bash scripts/gpu_ncu.sh \
        --kernels gdn_state_out_fused --count 1 -- "$T/cuda_gdn_test" \
        --gtest_also_run_disabled_tests --gtest_filter=CudaGdn.DISABLED_ProfileOnce || rc=1
    done
    ;;
  attn)
    # Bit-identity of wgmma_ws_ulean and the tolerance of wgmma_ws_lazy against wgmma_m128 and
    # the fp32 reference, on every fixture, and the default dispatch (wgmma_ws_lazy since session
    # 30). (each capped, so that a hang costs minutes, not the step)
    run attention_test timeout 150 "$T/cuda_attention_test" || rc=1
    # The same through the engine: ulean's logits bit-identical to lean's, lazy's close.
    run attention_engine_test timeout 120 "$T/cuda_specialisation_test" \
      --gtest_filter='AttnPrefillForms.*' || rc=1
    # Three processes of each dispatch, interleaved (a prompt's clock moves between processes
    # under the power cap): every variant in every case's note, the pick timed last.
    for i in 1 2 3; do
      run "attn_k_default_$i" "$DS" bench kernels --only attn_prefill || rc=1
      run "attn_k_lean_$i" env "$LEAN" "$DS" bench kernels --only attn_prefill || rc=1
    done
    # One file for the six (a device call returns at most 8 files) and the variants' table.
    if [ "${DRY:-0}" = 1 ]; then
      echo "attn_variants: python3 tools/bench_variants.py attn_kernels.txt --ref wgmma_ws_lean --variants wgmma_ws_lean,wgmma_ws_ulean,wgmma_ws_lazy"
    else
      for f in "$OUT"/attn_k_*.txt; do echo "=== $(basename "$f")"; cat "$f"; done \
        >"$OUT/attn_kernels.txt" && rm -f "$OUT"/attn_k_*.txt
      python3 tools/bench_variants.py "$OUT/attn_kernels.txt" --ref wgmma_ws_lean \
        --variants wgmma_ws_lean,wgmma_ws_ulean,wgmma_ws_lazy >"$OUT/attn_variants.md" || rc=1
    fi
    if [ "${DRY:-0}" = 1 ]; then
      echo "prefill_ab: BIN=$DS bash scripts/gpu_decode_ab.sh --prefill 2048,4096,8192,16384,32768 --repeats 3,3,2,1,1 --rounds 3 - $LEAN $ULEAN"
    else
      [ "$(left)" -ge 70 ] && { ARM_TIMEOUT=60 BIN="$DS" OUT="$OUT" timeout "$(left)" \
        bash scripts/gpu_decode_ab.sh --prefill 2048,4096,8192,16384,32768 --repeats 3,3,2,1,1 \
        --rounds 3 - "$LEAN" "$ULEAN" || rc=1; }
      rm -f "$OUT/decode_ab.full.log"
    fi
    ;;
  wy)
    # Session 31's phase stamps in the WY kernel (gdn_prefill_sm90.cu, TIMED): its bits against
    # the shipped build, then where one (chunk, head) item's time goes, one block per SM and four
    # (gdn_prefill.md, "Session 31": the fused GDN design needs A and T in ~2.5 us per chunk).
    run wy_test timeout 120 "$T/cuda_gdn_test" --gtest_filter=CudaGdn.WyBalancedBitExact || rc=1
    run wy_phases timeout 120 env DS_PERF=1 "$T/cuda_gdn_test" \
      --gtest_filter=CudaGdn.WyPhaseTiming || rc=1
    ;;
  early)
    # Session 32: gdn_decode on the gdn_in GEMV's early-rows signal. The GEMV's bits and raises,
    # then the engine's logits both ways (with and without gdn_decode's PDL launch), the counters
    # reset and no block that gave up waiting.
    run early_gemv_test timeout 150 "$T/cuda_gemv_norm_test" \
      --gtest_filter='CudaGemvBulkNorm.EarlyRows*' || rc=1
    run early_engine_test timeout 200 "$T/cuda_specialisation_test" \
      --gtest_filter='Specialisations.GdnEarly*' || rc=1
    # Where the GDN layer's time goes both ways (gdn_decode's advance is what should shrink).
    inprof inprof_4096_early DS_GDN_EARLY 0 1
    # (on by default since session 32: the arms are off, then the default; session 33's first run
    # of this step compared the default with DS_GDN_EARLY=1, i.e. on with on)
    decode_ab 1@4096,1@8192,1@32768,2@4096 3 DS_GDN_EARLY=0 -
    ;;
  attno)
    # Session 33's probe: attn_o launched plainly after the attention merge ($DS_ATTN_O_PDL=0).
    # An H200 profile with every decode GEMV off PDL put the merge's advance at 3.6 us against
    # 7.7 beside attn_o's ring fill. The engine's bits both ways, the profiles both ways, the A/B.
    run attno_test timeout 150 "$T/cuda_specialisation_test" \
      --gtest_filter='Specialisations.AttnOPdl*' || rc=1
    inprof inprof_4096_attn_o_pdl DS_ATTN_O_PDL 1 0
    decode_ab 1@4096,1@8192,1@32768,2@4096 3 - DS_ATTN_O_PDL=0
    ;;
  ahead)
    # Session 34's probe: after its griddepcontrol.wait each decode bulk GEMV (gdn_in, attn_qkv,
    # gate_up + SiLU with their norms, gdn_out / attn_o) queues its next stages for L2, so that HBM
    # streams while the consumers wait for x with the ring full (the norm prologue's ~2.4 us).
    # The kernel's bits at every count, the engine's both ways, the profiles, the A/B.
    # Batch 5-16 runs the TMA GEMV (gate_up + SiLU, gdn_in, attn_qkv), and down at batch 1-2 the
    # narrow one: both got the same prefetch.
    # Session 36 (run on an H100, twice): faster at 1@4096 only, slower at 1@16384 / 1@32768 and
    # 2@4096, so both stay off; the TMA GEMV's part has its own switch ($DS_GEMV_TMA_AHEAD). The
    # A/B: off (the default) against 80 KiB at batch 1-2 and the TMA part at 40 KiB.
    run ahead_gemv_test timeout 150 "$T/cuda_gemv_norm_test" \
      --gtest_filter='CudaGemvBulkNorm.L2Ahead*' || rc=1
    run ahead_tma_test timeout 150 "$T/cuda_gemv_test" \
      --gtest_filter='CudaGemvTma.L2Ahead*:CudaGemvNarrow.L2Ahead*' || rc=1
    run ahead_engine_test timeout 200 "$T/cuda_specialisation_test" \
      --gtest_filter='Specialisations.GemvAhead*' || rc=1
    inprof inprof_4096_ahead DS_GEMV_AHEAD 0 80
    decode_ab 1@4096,1@8192,1@16384,1@32768,2@4096,16@4096 3 - DS_GEMV_AHEAD=80 DS_GEMV_TMA_AHEAD=40
    ;;
  argmax)
    # The kernels against lm_head (+ the norm before it) and the separate argmax (logits and
    # residual bits, tokens, ties, NaN / inf, back-to-back launches, a graph), then the engine's
    # greedy decode with each fusion on and off.
    run argmax_gemv_test timeout 150 "$T/cuda_gemv_test" \
      --gtest_filter='CudaGemvBulk.ArgmaxFused*' || rc=1
    run argmax_norm_test timeout 150 "$T/cuda_gemv_norm_test" \
      --gtest_filter='CudaGemvBulkNorm.ArgmaxNorm*' || rc=1
    run argmax_engine_test timeout 150 "$T/cuda_specialisation_test" \
      --gtest_filter='Specialisations.FusedHead*' || rc=1
    # What the step's profile says: final norm + gather + lm_head + argmax (four kernels) against
    # the head in one kernel.
    for on in 0 1; do
      run "inprof_4096_head$on" env DS_ARGMAX_FUSED=$on DS_HEAD_NORM=$on DS_PROFILE=1 \
        DS_PROFILE_BATCHES=1,2 DS_PROFILE_CONTEXT=4096 "$T/cuda_decode_profile_test" \
        --gtest_filter=DecodeProfile.Synthetic27bInGraph || rc=1
    done
    # The last arm adds the cluster argmax (8 blocks per row) where the fused one does not apply:
    # batch 16, whose 16 one-block argmaxes took ~15.6-16.5 us in session 8's profiles. Batch 16
    # must stay within 1.3x of batch 1 as batch 1 gets faster.
    decode_ab 1@4096,2@4096,16@4096 3 - DS_ARGMAX_FUSED=1 "DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1" "DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1 DS_ARGMAX_CLUSTER=1"
    ;;
  tma)
    # Every config (now with kbox 2 / 4) against fp64 and each other, the 27B shapes bit-identical
    # across kbox; then the whole binary's TMA tests with the switch at 2 and 4 (the config
    # functions hand out the wider stages: the 27B shapes vs cuBLASLt, batch invariance, PDL
    # chains), and the engine's batch invariance with kbox 4.
    run tma_test timeout 150 "$T/cuda_gemv_test" --gtest_filter='CudaGemvTma.*' || rc=1
    for kb in 2 4; do
      run "tma_test_kb$kb" env DS_GEMV_TMA_KBOX=$kb timeout 120 "$T/cuda_gemv_test" \
        --gtest_filter='CudaGemvTma.*:-*OddShapes*' || rc=1
    done
    run tma_invariance_kb4 env DS_GEMV_TMA_KBOX=4 timeout 120 "$T/cuda_batch_invariance_test" \
      || rc=1
    run tma_gemm "$DS" bench kernels --only gemm || rc=1
    decode_ab 1@4096,8@4096,16@4096 3 - DS_GEMV_TMA_KBOX=2 DS_GEMV_TMA_KBOX=4
    ;;
  quick)
    # Correctness of the forms no GPU has run (each binary capped), then their speed: the prompt
    # attention's kernels with wgmma_ws_ulean picked against the default, and the decode step
    # with the fused head and the wider TMA stages (batch 16: the 1.3x gate as batch 1 gets
    # faster).
    run q_attention_test timeout 120 "$T/cuda_attention_test" || rc=1
    run q_gemv_test timeout 120 "$T/cuda_gemv_test" \
      --gtest_filter='*ArgmaxFused*:*InterleaveBitExact*:CudaGemvTma.*' || rc=1
    run q_gemv_norm_test timeout 90 "$T/cuda_gemv_norm_test" || rc=1
    run q_engine_test timeout 150 "$T/cuda_specialisation_test" \
      --gtest_filter='AttnPrefillForms.*:Specialisations.FusedHead*' || rc=1
    run q_attn_k_default "$DS" bench kernels --only attn_prefill || rc=1
    run q_attn_k_ulean env "$ULEAN" "$DS" bench kernels --only attn_prefill || rc=1
    decode_ab 1@4096,1@8192,16@4096 2 - "DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1" DS_GEMV_TMA_KBOX=2
    ;;
esac
exit $rc
