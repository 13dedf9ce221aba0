#!/usr/bin/env bash
# The path an engine takes: installs libkvcache from BUILD_DIR into OUT/prefix, then builds
# examples/llama2c_engine against the installed core alone — find_package(kvcache COMPONENTS
# core) in a project whose only prefix is OUT/prefix: no LibTorch on its include or link path —
# checks that the executable loads no libtorch / libc10 (ldd), and runs it on stories260K for
# every scheme (bytes stored/reserved, RSS growth, tokens/s). OUT/build/llama2c_engine stays for
# the token-parity test (engine_parity_test, the ctest fixture llama2c_engine).
# Usage: install_engine.sh SOURCE_DIR BUILD_DIR OUT [engine options, e.g. --steps 8]
# Exit 0 when built, checked and run (or the model data is absent: 77, skipped), else 1.
set -euo pipefail
src=$1 build=$2 out=$3
shift 3
rm -rf "$out"
mkdir -p "$out"
cmake --install "$build" --prefix "$out/prefix" >"$out/install.log"
# The compiler the library was built with (clang for the sanitizer build, whose runtime the
# engine then links: the installed core carries -fsanitize=... in its link options).
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
if ! cmake -S "$src/examples/llama2c_engine" -B "$out/build" -DCMAKE_PREFIX_PATH="$out/prefix" \
     -DCMAKE_BUILD_TYPE=Release ${cxx:+-DCMAKE_CXX_COMPILER="$cxx"} >"$out/configure.log" 2>&1; then
  cat "$out/configure.log"
  exit 1
fi
if grep -E '^(Torch|Caffe2|c10)_DIR' "$out/build/CMakeCache.txt"; then
  echo "install_engine.sh: find_package(kvcache COMPONENTS core) looked for LibTorch" >&2
  exit 1
fi
if ! cmake --build "$out/build" -j2 >"$out/build.log" 2>&1; then
  cat "$out/build.log"
  exit 1
fi
exe="$out/build/llama2c_engine"
libs=$(ldd "$exe")
if grep -E 'libtorch|libc10' <<<"$libs"; then
  echo "install_engine.sh: $exe loads LibTorch" >&2
  exit 1
fi
grep -q 'libkvcache_core' <<<"$libs" || { echo "install_engine.sh: $exe does not load libkvcache_core" >&2; exit 1; }
echo "llama2c_engine: built against $out/prefix (COMPONENTS core); loads no libtorch/libc10"
model="$src/../shared/data/models/stories260K"
if [[ ! -f "$model/stories260K.bin" ]]; then
  echo "SKIP: $model/stories260K.bin is absent"
  exit 77
fi
"$exe" "$model/stories260K.bin" "$model/tok512.bin" "$@" | tee "$out/run.log"
# int4 of head_dim 8 (one group per token row): 4 bits + fp16 scale and zero over 8 values.
grep -qE '^int4 +8\.00 bits/value' "$out/run.log" || { echo "install_engine.sh: no 'int4 8.00 bits/value' line" >&2; exit 1; }
