# SPDX-License-Identifier: MIT
# Warning flags for weft's own host code (never applied to third-party targets).
function(weft_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
                              -Woverloaded-virtual -Wnull-dereference -Wformat=2>)
endfunction()
