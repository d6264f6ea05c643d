#!/usr/bin/env bash
# Session 7's device call (one run): unpack the carried binaries, the GPU tests of the changed
# code (attention decode merge, the CUDA engine paths), the decode A/B of this session's switches,
# a prefill A/B of DS_PREFILL_FOLD, a sustained-load GEMM ceiling through torch, and the decode
# profile with the new default. Everything goes to $OUT; the last lines are the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-s7-out}
mkdir -p "$OUT"
B=$(mktemp -d /tmp/ds-bins.XXXXXX)
tar -C "$B" -xJf .carry/bins.tar.xz || exit 1
export DS_CUPTI_LIB=$B/libcupti.so.13
echo "binaries of $(head -1 "$B/bin/COMMIT")"
for t in cuda_attention_decode_test cuda_backend_test cuda_engine_test cuda_batch_invariance_test \
         cuda_specialisation_test cuda_decode_pipeline_test cuda_gemv_norm_test; do
  timeout 240 "$B/tests/$t" > "$OUT/t_$t.log" 2>&1
  echo "test $t rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/t_$t.log" | tr '\n' ' ')"
done | tee "$OUT/tests.txt"
grep -h "serial merge\|one-trip" "$OUT/t_cuda_attention_decode_test.log" | head -12
BIN=$B/bin/deltaserve OUT=$OUT/ab bash scripts/gpu_decode_ab.sh --rounds 2 \
  --cases 1@4096,2@4096,1@32768,16@4096 - DS_ATTN_MERGE=serial DS_FUSED_NORM_ROLES=mlp \
  DS_GEMV_BULK_SLOTS=20 DS_GEMV_BULK_SLOTS=12 "DS_FUSED_NORM_ROLES=mlp DS_GEMV_BULK_SLOTS=20" \
  > "$OUT/ab.txt" 2>&1
tail -9 "$OUT/ab.txt"
for r in 1 2; do
  for a in all mixer; do
    echo "== prefill round $r DS_PREFILL_FOLD=$a"
    DS_PREFILL_FOLD=$a timeout 120 "$B/bin/deltaserve" bench prefill --prompt 4096 --repeats 3 2>&1 |
      grep -E "^prefill +4096|bf16 GEMM 8192" | head -4
  done
done > "$OUT/prefill_ab.txt" 2>&1
cat "$OUT/prefill_ab.txt"
PYTHONUNBUFFERED=1 timeout 60 python3 - > "$OUT/gemm_sustained.txt" 2>&1 <<'PY'
import torch, time, subprocess
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
flop = 2 * n ** 3
for _ in range(5): a @ b
torch.cuda.synchronize()
t_end = time.time() + 12
print("window  TFLOP/s   (8192^3 bf16, torch.matmul, back to back)")
w = 0
while time.time() < t_end:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(50): a @ b
    e.record(); e.synchronize()
    tf = 50 * flop / (s.elapsed_time(e) / 1e3) / 1e12
    q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    print(f"{w:4d}  {tf:8.1f}   {q}")
    w += 1
PY
cat "$OUT/gemm_sustained.txt"
DS_PROFILE=1 timeout 100 "$B/tests/cuda_decode_profile_test" --gtest_filter=DecodeProfile.Synthetic27bInGraph \
  > "$OUT/profile.log" 2>&1
grep -E "in-graph span|attn_merge|attn_split|rope_kv" "$OUT/profile.log" | head -16
