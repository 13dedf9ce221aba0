#!/usr/bin/env bash
# Installs libkvcache from BUILD_DIR into a temporary prefix and builds tests/install_consumer
# against it with find_package(kvcache) (every component: kvcache::kvcache), then runs it.
# Usage: install_consumer.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S "$src/tests/install_consumer" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release \
      ${cxx:+-DCMAKE_CXX_COMPILER="$cxx"} >/dev/null
cmake --build "$tmp/build" -j2 >/dev/null
"$tmp/build/kvcache_consumer"
