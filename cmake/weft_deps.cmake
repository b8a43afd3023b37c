# SPDX-License-Identifier: MIT
# Locates the CUDA toolkit pieces weft links: cudart, NVRTC, nvJitLink, cuBLAS(Lt), NCCL; and OpenSSL.
# The driver API is resolved at run time through cudart's entry-point query, so nothing links libcuda
# and CPU-only machines can run the unit tests. GoogleTest is looked for by tests/ only.
include(${CMAKE_CURRENT_LIST_DIR}/weft_nvjitlink.cmake)
if(NOT TARGET weft::nvjitlink)
  message(FATAL_ERROR "weft: libnvJitLink not found next to the CUDA toolkit's libraries (${CUDAToolkit_LIBRARY_DIR})")
endif()

find_library(WEFT_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
if(WEFT_NCCL_LIBRARY)
  add_library(weft_nccl SHARED IMPORTED)
  set_target_properties(weft_nccl PROPERTIES IMPORTED_LOCATION ${WEFT_NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS}")
endif()

find_package(OpenSSL REQUIRED COMPONENTS Crypto)
