# Every dependency comes from Debian packages (see tools/setup.sh).
find_package(Torch REQUIRED)            # libtorch-dev (LibTorch 1.13)
find_package(Threads REQUIRED)
if(KVCACHE_OPENMP)
  find_package(OpenMP REQUIRED)         # libgomp (GCC): makes at::parallel_for parallel in our kernels
endif()
find_package(spdlog REQUIRED)           # libspdlog-dev
find_package(nlohmann_json 3 REQUIRED)  # nlohmann-json3-dev
find_package(Eigen3 3.3 REQUIRED NO_MODULE)  # libeigen3-dev (header-only): small dense math inside the kernels (GEAR power iteration and QR, KVQuant k-means)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)  # libpcre2-dev
# libxxhash-dev: the per-section checksums of cache snapshots (XXH3-64, docs/snapshot-format.md).
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
if(KVCACHE_BUILD_APPS)
  find_package(CLI11 REQUIRED)          # libcli11-dev
endif()
if(KVCACHE_BUILD_TESTS)
  find_package(GTest REQUIRED)          # libgtest-dev, libgmock-dev
endif()
if(KVCACHE_BUILD_BENCH)
  find_package(benchmark REQUIRED)      # libbenchmark-dev
endif()

# Python interpreter that has torch (Debian's python3-torch lives under /usr/bin/python3).
if(NOT KVCACHE_PYTHON)
  find_program(KVCACHE_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
endif()
