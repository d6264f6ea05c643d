#!/usr/bin/env bash
# Packs the CUDA build's binaries for a device call: every tests/cuda_*_test and bin/deltaserve of
# BUILD_DIR (default build-cuda), the commit they were built from, and CUPTI (for the profile
# tests) into ONE archive, .carry/bins.tar.xz by default. The 20 test binaries each carry the
# whole CUDA library (~390 MB together); xz with a dictionary larger than one binary stores the
# shared part once (~11 MB), well inside a call's 64 MiB. On the device machine:
#   mkdir -p /tmp/b && tar -C /tmp/b -xJf .carry/bins.tar.xz
#   BUILD_DIR=/tmp/b OUT=/tmp/gt bash scripts/gpu_test.sh --server --pack "$OUT/gpu_test_logs.tar.gz"
#   BIN=/tmp/b/bin/deltaserve bash scripts/gpu_bench.sh        (or scripts/gpu_decode_ab.sh)
#   DS_CUPTI_LIB=/tmp/b/libcupti.so.13 for the profile tests
# with carry: [".carry"] (plus .whl-serve and .carry-gpuserve for --server: docs/SERVER.md).
#   BUILD_DIR   the CUDA build (configured with -DDS_CUDA=ON and built)
#   ARCHIVE     where to write (default .carry/bins.tar.xz)
#   --build     build the binaries first (cmake --build BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-cuda}
ARCHIVE=${ARCHIVE:-.carry/bins.tar.xz}
if [ "${1:-}" = "--build" ]; then
  cmake --build "$BUILD_DIR" -j"$(nproc)"
elif [ $# -gt 0 ]; then
  echo "pack_gpu_binaries: unknown argument $1" >&2; exit 2
fi
[ -x "$BUILD_DIR/bin/deltaserve" ] || { echo "pack_gpu_binaries: $BUILD_DIR/bin/deltaserve not built" >&2; exit 1; }
ldd "$BUILD_DIR/bin/deltaserve" | grep libcudart >/dev/null ||
  { echo "pack_gpu_binaries: $BUILD_DIR was built without the CUDA backend (-DDS_CUDA=ON)" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/tests"
cp "$BUILD_DIR/bin/deltaserve" "$stage/bin/"
cp "$BUILD_DIR"/tests/cuda_*_test "$stage/tests/"
git rev-parse HEAD > "$stage/bin/COMMIT"
git diff --quiet HEAD -- src tests bench CMakeLists.txt || echo "(with uncommitted changes)" >> "$stage/bin/COMMIT"
for c in /usr/local/cuda/lib64/libcupti.so.13 /usr/local/cuda/lib/libcupti.so.13 \
         /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13; do
  [ -f "$c" ] && { cp "$c" "$stage/"; break; }
done
mkdir -p "$(dirname "$ARCHIVE")"
tar -C "$stage" -cf - . | xz -T1 -6 --lzma2=dict=192MiB > "$ARCHIVE.tmp"
mv "$ARCHIVE.tmp" "$ARCHIVE"
echo "pack_gpu_binaries: $(ls "$stage/tests" | wc -l) test binaries + deltaserve ($(cat "$stage/bin/COMMIT" | tr '\n' ' ')) -> $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
