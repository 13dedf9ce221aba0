# Warning flags applied to the project's own targets (not to dependencies).
function(kvcache_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow=local
                         -Wno-unused-parameter)
  if(KVCACHE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
