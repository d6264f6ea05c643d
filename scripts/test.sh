#!/usr/bin/env bash
# The README's test command (and CI's): set up, build, run every CPU test (C++ and Python).
# GPU tests are in scripts/gpu_test.sh and run on a machine with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
export DS_BUILD_DIR="$PWD/$BUILD_DIR"
(cd "$BUILD_DIR" && ctest -LE gpu --output-on-failure -j"$(nproc)" --timeout 900)
python3 -m pytest -q tests/python
