#!/usr/bin/env bash
# Nsight Compute on the GPU machine, in one call: profiles the kernels whose names match a regex
# in a command (a test binary, `deltaserve bench ...`), with the full section set and SASS source
# counters, and writes under $OUT: ncu_details.txt (the details page of every profiled launch),
# sass.csv.xz (the per-instruction source counters) and ncu_sass_summary.txt
# (tools/ncu_sass_summary.py: per kernel the SASS size, the never-executed count, stalls by reason
# and the hottest instructions). ncu runs each kernel alone at its base clock with caches flushed:
# compare kernels within one report, not with event timings.
#
#   bash scripts/gpu_ncu.sh [--kernels REGEX] [--count N] [--skip N] -- COMMAND [ARGS...]
#   e.g. bash scripts/gpu_ncu.sh --kernels 'wy_mma|state_slice' --count 2 -- \
#          /tmp/b/tests/cuda_gdn_test --gtest_also_run_disabled_tests \
#          --gtest_filter=CudaGdn.DISABLED_ProfileOnce
#
#   --kernels  regex of kernel names (default: every kernel)     --count  launches profiled (default 4)
#   --skip     matching launches skipped first (default 0)       $NCU     the ncu binary (default: found)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ncu-out}
kernels=""
count=4
skip=0
while (($#)); do
  case "$1" in
    --kernels) kernels=$2; shift ;;
    --count) count=$2; shift ;;
    --skip) skip=$2; shift ;;
    --) shift; break ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "gpu_ncu: unknown argument $1 (the command goes after --)" >&2; exit 2 ;;
  esac
  shift
done
(($#)) || { echo "gpu_ncu: give the command to profile after --" >&2; exit 2; }
[[ $count =~ ^[1-9][0-9]*$ && $skip =~ ^[0-9]+$ ]] ||
  { echo "gpu_ncu: --count takes a positive integer and --skip a count, got '$count' / '$skip'" >&2; exit 2; }
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[ -n "$NCU" ] && [ -x "$NCU" ] || { echo "gpu_ncu: ncu (Nsight Compute) not found; set \$NCU" >&2; exit 2; }
mkdir -p "$OUT"
rep=$(mktemp -d)/rep
filter=()
[ -n "$kernels" ] && filter=(--kernel-name "regex:$kernels")
"$NCU" "${filter[@]}" --launch-skip "$skip" --launch-count "$count" --set full --import-source no \
  -f -o "$rep" "$@" > "$OUT/ncu_run.log" 2>&1
rc=$?
[ -f "$rep.ncu-rep" ] || { echo "gpu_ncu: no report (ncu exit $rc): $(tail -3 "$OUT/ncu_run.log")" >&2; exit 1; }
"$NCU" -i "$rep.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
"$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass 2>/dev/null |
  python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.compress(sys.stdin.buffer.read()))' \
    > "$OUT/sass.csv.xz"
python3 tools/ncu_sass_summary.py "$OUT/sass.csv.xz" > "$OUT/ncu_sass_summary.txt"
cat "$OUT/ncu_sass_summary.txt"
rm -rf "$(dirname "$rep")"
exit $rc
