#!/usr/bin/env bash
# Installs libkvcache from BUILD_DIR into a temporary prefix, builds examples/engine against it
# with find_package(kvcache), and runs it: the path a downstream engine takes.
# Usage: install_example.sh SOURCE_DIR BUILD_DIR [engine_example arguments: prompt_tokens new_tokens]
set -euo pipefail
src=$1 build=$2
shift 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
# The compiler the library was built with (clang for the sanitizer build, whose runtime the
# engine then links: the installed target carries -fsanitize=...).
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S "$src/examples/engine" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release \
      ${cxx:+-DCMAKE_CXX_COMPILER="$cxx"} >/dev/null
cmake --build "$tmp/build" -j2 >/dev/null
"$tmp/build/engine_example" "$@"
