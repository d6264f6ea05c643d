#!/usr/bin/env bash
# Installs everything the build and the tests need (Debian packages, Python test tools) and
# configures + builds into ./build. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PKGS=(build-essential cmake pkg-config git python3 python3-pip
  nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev
  libgtest-dev libgmock-dev libbenchmark-dev libomp-dev)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

if [ "${DS_SKIP_PIP:-0}" != "1" ]; then
  if ! python3 -c "import pytest, tokenizers, transformers, jinja2, numpy, safetensors, openai" 2>/dev/null; then
    echo "setup: installing Python test tools (requirements-test.txt)"
    python3 -m pip install -q -r requirements-test.txt 2>/dev/null ||
      python3 -m pip install -q --break-system-packages -r requirements-test.txt
  fi
fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${DS_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)"
