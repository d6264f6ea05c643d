#!/usr/bin/env bash
# The README's run command: set up, build, then generate.
#   scripts/run.sh                      no checkpoint: makes a tiny random checkpoint with the
#                                       engine's own tool and generates from it (CPU, or the GPU
#                                       when there is one and the CUDA backend is built)
#   scripts/run.sh --model DIR [...]    any `deltaserve generate` flags
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=${BUILD_DIR:-build}/bin/deltaserve
device=cpu
# The GPU when there is one and the binary has the CUDA backend (it then links the CUDA runtime).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && ldd "$BIN" | grep libcudart >/dev/null; then
  device=cuda
fi
if [ $# -eq 0 ]; then
  tiny=${TINY_DIR:-build/tiny-model}
  "$BIN" make-tiny --out "$tiny" --seed 1 --force  # deterministic: same bytes every run
  echo "NOTE: this model has deterministic RANDOM weights (no checkpoint given); its text is noise."
  exec "$BIN" generate --model "$tiny" --device "$device" --prompt-ids 1,2,3,4 --max-tokens 16
fi
exec "$BIN" generate --device "$device" "$@"
