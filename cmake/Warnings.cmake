# Warning flags applied to the project's own targets (not to dependencies).
function(kvcache_set_warnings target)
  # GCC's -Wshadow=local; clang's nearest is -Wshadow-uncaptured-local (the sanitizer/fuzz
  # build). Clang's -Wpedantic also flags the GNU `, ##__VA_ARGS__` of error.h's macros, and it
  # reports each `omp simd` loop it leaves scalar (-Wpass-failed): neither is a defect.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    set(shadow -Wshadow-uncaptured-local -Wno-gnu-zero-variadic-macro-arguments -Wno-pass-failed)
  else()
    set(shadow -Wshadow=local)
  endif()
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic ${shadow}
                         -Wno-unused-parameter)
  if(KVCACHE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
