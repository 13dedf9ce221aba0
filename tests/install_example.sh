#!/usr/bin/env bash
# Installs libkvcache from BUILD_DIR into a temporary prefix, builds examples/engine against it
# with find_package(kvcache), and runs it: the path a downstream engine takes.
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src/examples/engine" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/build" -j2 >/dev/null
"$tmp/build/engine_example"
