#!/usr/bin/env bash
# Same-call A/B of decode switches: each ARM is a space-separated list of VAR=value settings (or
# "-" for none) run as its own `deltaserve bench decode` process, the arms interleaved for
# --rounds rounds (so drift over the call hits every arm alike); ends with one table of TPOT p50
# per (arm, case) with every round's value and the median over rounds, and each batch's median
# against batch 1's at the same context ([16@4096 / 1@4096: 1.298x]: issue 6's scaling gate).
# Device time is scarce: one call, a few minutes (each process ~15-25 s at 3 cases x 64 steps on
# the synthetic 27B).
#
#   BIN=path/to/deltaserve bash scripts/gpu_decode_ab.sh [--cases 1@4096,2@4096,1@32768]
#       [--steps 64] [--rounds 2] [--bench-args "..."] ARM [ARM ...]
#   e.g.  ... -  DS_GEMV_L2_NEXT=16  DS_GEMV_L2_NEXT=32  "DS_GEMV_L2_NEXT=32 DS_ATTN_DECODE=pdl_early"
#
# --bench-args: more `bench decode` flags for every arm (e.g. "--device cpu --synthetic tiny" for
# a dry run without a GPU, as tests/python/test_bench_scripts.py does).
# --prefill PROMPTS [--repeats R]: the same for prompts instead: each arm runs `bench prefill
# --prompt PROMPTS [--repeats R]` and the table holds TTFT p50 (ms) per prompt length (a prompt
# process on the synthetic 27B: ~25 s for 4096,32768 with repeats 3,1).
# ARM_TIMEOUT: seconds one arm's process may run (default 3600; a process stopped by it counts as
# failed, and the other arms go on).
# Output: $OUT/decode_ab.log (the table and each process's decode / prefill table),
# $OUT/decode_ab.full.log (everything the processes printed). Exit status 1 if any process
# failed (its arm shows FAIL).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build-bench/bin/deltaserve}
OUT=${OUT:-ab-out}
mkdir -p "$OUT"
cases=1@4096,2@4096,1@32768
steps=64
rounds=2
extra=""
prompts=""
repeats=""
arms=()
while (($#)); do
  case "$1" in
    --cases) cases=$2; shift ;;
    --steps) steps=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --bench-args) extra=$2; shift ;;
    --prefill) prompts=$2; shift ;;
    --repeats) repeats=$2; shift ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) arms+=("$1") ;;
  esac
  shift
done
((${#arms[@]})) || { echo "gpu_decode_ab: give at least one ARM (\"-\" = no settings)" >&2; exit 2; }
[ -x "$BIN" ] || { echo "gpu_decode_ab: $BIN not found" >&2; exit 2; }
for a in "${arms[@]}"; do
  [ "$a" = "-" ] && continue
  for kv in $a; do
    [[ $kv =~ ^[A-Z_][A-Z0-9_]*=[^\ ]*$ ]] ||
      { echo "gpu_decode_ab: arm '$a': '$kv' is not VAR=value" >&2; exit 2; }
  done
done
if [ -n "$prompts" ]; then
  [[ $prompts =~ ^[0-9]+(,[0-9]+)*$ ]] ||
    { echo "gpu_decode_ab: --prefill takes prompt lengths like 4096,32768, got '$prompts'" >&2; exit 2; }
  cases=$prompts
  bench=(bench prefill --prompt "$prompts")
  [ -n "$repeats" ] && bench+=(--repeats "$repeats")
  # prefill table rows: prompt runs p50 min max ...
  row_re='^[0-9]+ +[0-9]+ +[0-9]+\.[0-9]+ +[0-9.]+ +[0-9.]+ '
  what="TTFT p50 ms"
else
  [ -z "$repeats" ] || { echo "gpu_decode_ab: --repeats goes with --prefill" >&2; exit 2; }
  bench=(bench decode --cases "$cases" --steps "$steps")
  # decode table rows: batch context actual steps p50 p99 ...
  row_re='^[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9.]+ '
  what="TPOT p50 ms"
fi
LOG=$OUT/decode_ab.log
FULL=$OUT/decode_ab.full.log
: >"$LOG"
: >"$FULL"
declare -A tpot  # "arm|case" -> space-separated p50 per round (case: b@ctx, or the prompt length)
failed=0
for ((r = 1; r <= rounds; ++r)); do
  for i in "${!arms[@]}"; do
    a=${arms[$i]}
    settings=()
    [ "$a" != "-" ] && read -r -a settings <<<"$a"
    echo "== round $r arm $i: ${a} ($(date -u +%H:%M:%S))" | tee -a "$LOG" >>"$FULL"
    # shellcheck disable=SC2086  # extra: flags split on spaces on purpose
    out=$(timeout "${ARM_TIMEOUT:-3600}" env "${settings[@]}" "$BIN" "${bench[@]}" $extra 2>&1)
    rc=$?
    echo "$out" >>"$FULL"
    rows=$(echo "$out" | grep -E "$row_re")
    [ -n "$rows" ] && echo "$rows" >>"$LOG"
    if [ $rc -ne 0 ] || [ -z "$rows" ]; then
      failed=1
      echo "   FAILED (rc $rc): $(echo "$out" | tail -3)" | tee -a "$LOG"
    fi
    if [ -n "$prompts" ]; then
      while read -r prompt _ p50 _; do
        [ -n "${prompt:-}" ] || continue
        tpot["$i|$prompt"]+="$p50 "
      done <<<"$rows"
    else
      while read -r b ctx _ _ p50 _; do
        [ -n "${b:-}" ] || continue
        tpot["$i|$b@$ctx"]+="$p50 "
      done <<<"$rows"
    fi
  done
done
{
  echo
  if [ -n "$prompts" ]; then
    echo "$what per round, median of rounds (prompts $prompts${repeats:+, repeats $repeats}, $rounds rounds)"
  else
    echo "$what per round, median of rounds (cases $cases, $steps steps, $rounds rounds)"
  fi
  for i in "${!arms[@]}"; do
    line="arm $i [${arms[$i]}]:"
    declare -A med=()
    for c in ${cases//,/ }; do
      v=${tpot["$i|$c"]:-}
      if [ -z "$v" ]; then
        line+="  $c FAIL"
        continue
      fi
      med[$c]=$(printf '%s\n' $v | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')
      line+="  $c: ${v% } (median ${med[$c]})"
    done
    # Decode: each batch against batch 1 at the same context (issue 6: batch 16 <= 1.3x).
    if [ -z "$prompts" ]; then
      for c in ${cases//,/ }; do
        b=${c%@*} ctx=${c#*@}
        [ "$b" != 1 ] && [ -n "${med[$c]:-}" ] && [ -n "${med[1@$ctx]:-}" ] &&
          line+="  [$c / 1@$ctx: $(awk -v x="${med[$c]}" -v y="${med[1@$ctx]}" 'BEGIN {printf "%.3f", x / y}')x]"
      done
    fi
    unset med
    echo "$line"
  done
} | tee -a "$LOG"
exit $failed
