# SPDX-License-Identifier: MIT
# weft_cuda_target(<target> [ARCHITECTURES <arch>...])
#
# Readies a CUDA target of your own whose .cu files include weft's device headers (weft/device.cuh ...):
#   - C++20 for nvcc. CMake 3.25 does not know nvcc's C++20 flag: CUDA_STANDARD 20 alone adds no flag there, so
#     the flag is added directly (and the target's own CUDA_STANDARD cleared, so that no second -std follows);
#   - CUDA_ARCHITECTURES: the given ones, default 90a (weft's device layer is Hopper's: sm_90a);
#   - CUDA_RUNTIME_LIBRARY: the runtime weft::weft links (weft_CUDART), so that the program holds one.
# It does not link weft::weft: target_link_libraries(<target> PRIVATE weft::weft) as for any target.
# Defined by find_package(weft) and by add_subdirectory(weft) alike.
function(weft_cuda_target target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "ARCHITECTURES")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "weft_cuda_target(${target}): unexpected arguments: ${arg_UNPARSED_ARGUMENTS} "
                        "(usage: weft_cuda_target(<target> [ARCHITECTURES <arch>...]))")
  endif()
  if(NOT TARGET ${target})
    message(FATAL_ERROR "weft_cuda_target: '${target}' is not a target (call it after add_executable/add_library)")
  endif()
  if(NOT arg_ARCHITECTURES)
    set(arg_ARCHITECTURES 90a)
  endif()
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${arg_ARCHITECTURES}")
  if(CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  else()
    set_property(TARGET ${target} PROPERTY CUDA_STANDARD)  # unset: no flag of CMake's beside ours
    set_property(TARGET ${target} PROPERTY CUDA_STANDARD_REQUIRED)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # The runtime weft::weft links, recorded where every directory sees it (find_package(weft GLOBAL) in a sibling
  # directory leaves no weft_CUDART variable in this one).
  get_property(cudart GLOBAL PROPERTY WEFT_CUDART_RUNTIME)
  if(NOT cudart)
    set(cudart shared)
  endif()
  if(cudart STREQUAL "static")
    set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  else()
    set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  endif()
endfunction()
