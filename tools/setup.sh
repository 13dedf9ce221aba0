#!/usr/bin/env bash
# Installs libkvcache's build/run dependencies from Debian packages and builds the project.
# Idempotent and non-interactive. Usage: tools/setup.sh [--no-install] [--debug] [--sanitize] [TARGET...]
#   TARGET      build only these targets (e.g. `tools/setup.sh kv_study`, what tools/main_job.sh
#               runs); without any, everything (what ctest runs)
#   --sanitize  also install clang-14 + libclang-rt-14-dev and build the sanitizer + fuzz tree
#               instead (ASan + UBSan, libFuzzer targets; default BUILD_DIR build-asan; docs/ci.md)
#   BUILD_DIR   build directory (default: build)
#   JOBS        parallel build jobs (default: nproc)
#   KVCACHE_CMAKE_ARGS  extra cmake arguments
#   KVCACHE_CCACHE=0    compile without ccache (default: through ccache, whose cache in
#                       ~/.cache/ccache makes a clean clone's rebuild of unchanged sources cheap)
set -euo pipefail
cd "$(dirname "$0")/.."

install=1
build_type=Release
sanitize=0
targets=()
names=()
for arg in "$@"; do
  case "$arg" in
    --no-install) install=0 ;;
    --debug) build_type=Debug ;;
    --sanitize) sanitize=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "setup.sh: unknown option '$arg' (expected --no-install, --debug, --sanitize or target names)" >&2; exit 2 ;;
    *) targets+=(--target "$arg"); names+=("$arg") ;;
  esac
done

PACKAGES=(
  build-essential cmake pkg-config git ccache
  libtorch-dev libopenblas0-openmp   # LibTorch 1.13; OpenBLAS (else the reference BLAS: ~7x slower GEMM)
  libeigen3-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libpcre2-dev
  libxxhash-dev                      # snapshot checksums (XXH3-64)
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy python3-matplotlib
)
# clang (ASan/UBSan with float-cast-overflow, libFuzzer); its OpenMP runtime is not used.
[[ $sanitize -eq 1 ]] && PACKAGES+=(clang-14 libclang-rt-14-dev)

if [[ $install -eq 1 ]]; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "setup.sh: installing ${missing[*]}" >&2
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

extra=()
if [[ $sanitize -eq 1 ]]; then
  BUILD_DIR=${BUILD_DIR:-build-asan}
  # -O1: the usual optimisation for sanitizers (faster to build than -O3, still fast to run).
  # No benchmarks; OpenMP off (docs/ci.md).
  extra=(-DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 -DKVCACHE_SANITIZE=ON -DKVCACHE_FUZZ=ON -DKVCACHE_OPENMP=OFF
         -DKVCACHE_BUILD_BENCH=OFF "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG")
fi
# ccache: the precompiled header (<ATen/ATen.h>) needs pch_defines,time_macros to be cacheable;
# base_dir makes the cache hit from another clone's path.
if [[ ${KVCACHE_CCACHE:-1} != 0 ]] && command -v ccache >/dev/null; then
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  export CCACHE_BASEDIR=$PWD
  extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="$build_type" -DKVCACHE_PYTHON=/usr/bin/python3 \
      "${extra[@]}" ${KVCACHE_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
echo "setup.sh: built ${names[*]:-everything} in $BUILD_DIR ($build_type$([[ $sanitize -eq 1 ]] && echo ", ASan+UBSan, fuzz targets"))" >&2
