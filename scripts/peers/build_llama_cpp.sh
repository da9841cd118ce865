#!/usr/bin/env bash
# Builds llama.cpp's llama-server once, from the llama.cpp vendored in llama-cpp-python's sdist,
# into $XENC_LAB_CACHE/peers/llama.cpp/<version>; later runs find it there and return at once.
# Usage: scripts/peers/build_llama_cpp.sh [python]   (prints the build folder on its last line)
set -euo pipefail
VERSION=0.3.36
PY=${1:-python}
CACHE=${XENC_LAB_CACHE:-$HOME/.cache/xenc_lab}
ROOT="$CACHE/peers/llama.cpp/$VERSION"
SRC="$ROOT/src"
BIN="$ROOT/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$ROOT"; exit 0; fi
mkdir -p "$ROOT"
exec 9>"$ROOT/.build.lock"
flock 9  # a second peers run waits for the build in progress rather than starting its own
if [ -x "$BIN" ]; then echo "$ROOT"; exit 0; fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  TMP=$(mktemp -d)
  "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$TMP" >&2
  tar -xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
  rm -rf "$SRC"
  cp -r "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  rm -f "$SRC/.git"  # a dangling gitlink in the sdist; cmake's version step trips on it
  rm -rf "$TMP"
fi
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF >&2
cmake --build "$ROOT/build" --target llama-server -j "${BUILD_JOBS:-2}" >&2
echo "$ROOT"
