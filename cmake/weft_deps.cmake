# SPDX-License-Identifier: MIT
# Locates the CUDA toolkit pieces weft links: cudart (static), NVRTC, nvJitLink, cuBLAS(Lt), NCCL.
# The driver API is resolved at run time through cudart's entry-point query, so nothing links libcuda
# and CPU-only machines can run the unit tests.
find_library(WEFT_NVJITLINK_LIBRARY nvJitLink HINTS ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
add_library(weft_nvjitlink SHARED IMPORTED)
set_target_properties(weft_nvjitlink PROPERTIES IMPORTED_LOCATION ${WEFT_NVJITLINK_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${CUDAToolkit_INCLUDE_DIRS})

find_library(WEFT_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
if(WEFT_NCCL_LIBRARY)
  add_library(weft_nccl SHARED IMPORTED)
  set_target_properties(weft_nccl PROPERTIES IMPORTED_LOCATION ${WEFT_NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${CUDAToolkit_INCLUDE_DIRS})
endif()

find_package(GTest REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
