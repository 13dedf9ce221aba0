# KVCACHE_SANITIZE: AddressSanitizer + UndefinedBehaviorSanitizer (with float-cast-overflow, which
# -fsanitize=undefined leaves out) on every target of the project; any report aborts the program.
# KVCACHE_FUZZ: the libFuzzer targets of fuzz/, with the library instrumented for coverage.
# Both need clang (libFuzzer; one compiler-rt for ASan, UBSan and libFuzzer) and
# KVCACHE_OPENMP=OFF: clang's -fopenmp links libomp, which would load beside LibTorch's libgomp
# (at::parallel_for then runs serially, which is fine for sanitizing). See docs/ci.md.
set(KVCACHE_SANITIZERS address,undefined,float-cast-overflow)
if(KVCACHE_SANITIZE OR KVCACHE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KVCACHE_SANITIZE / KVCACHE_FUZZ need clang (e.g. -DCMAKE_CXX_COMPILER=clang++-14), "
                        "not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  if(KVCACHE_OPENMP)
    message(FATAL_ERROR "KVCACHE_SANITIZE / KVCACHE_FUZZ need -DKVCACHE_OPENMP=OFF (clang's libomp must not load "
                        "beside LibTorch's libgomp)")
  endif()
endif()
if(KVCACHE_SANITIZE OR KVCACHE_FUZZ)
  # One baseline build of the quantizer kernels instead of target_clones (simd.h): the ifunc
  # resolvers run while the loader relocates libkvcache.so, and instrumented ones jumped through
  # a not-yet-relocated GOT entry (SIGSEGV before main). The kernels' source is the same.
  add_compile_definitions(KVCACHE_NO_TARGET_CLONES)
endif()
if(KVCACHE_SANITIZE)
  add_compile_options(-fsanitize=${KVCACHE_SANITIZERS} -fno-sanitize-recover=all -fno-omit-frame-pointer
                      -gline-tables-only)
  add_link_options(-fsanitize=${KVCACHE_SANITIZERS})
endif()

# Sanitizer/coverage usage requirements of the library target.
function(kvcache_sanitize_library target)
  if(KVCACHE_SANITIZE)
    # The instrumented shared library needs the sanitizer runtime in the program that loads it:
    # downstream links (find_package(kvcache), examples/engine) get the flag with the target.
    target_link_options(${target} INTERFACE -fsanitize=${KVCACHE_SANITIZERS})
  endif()
  if(KVCACHE_FUZZ)
    target_compile_options(${target} PRIVATE -fsanitize=fuzzer-no-link)
  endif()
endfunction()
