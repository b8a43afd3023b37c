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

# NCCL's GIN device API (nccl_device.h of NCCL >= 2.28 beside the toolkit's headers): weft's GIN backend
# (src/net/gin.cpp, its nvcc-built device library and tests) is built only where it is; the host-API network
# backend needs no headers at build time.
option(WEFT_ENABLE_GIN "Build the NCCL GIN backend where NCCL's GIN device API is found" ON)
set(WEFT_HAVE_NCCL_GIN OFF)
find_file(WEFT_NCCL_HEADER nccl.h PATHS ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT WEFT_ENABLE_GIN)
  message(STATUS "weft: GIN backend: OFF (WEFT_ENABLE_GIN)")
elseif(WEFT_NCCL_HEADER)
  get_filename_component(weft_nccl_include_dir ${WEFT_NCCL_HEADER} DIRECTORY)
  file(STRINGS ${WEFT_NCCL_HEADER} weft_nccl_major REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS ${WEFT_NCCL_HEADER} weft_nccl_minor REGEX "^#define NCCL_MINOR +[0-9]+")
  string(REGEX MATCH "[0-9]+$" weft_nccl_major "${weft_nccl_major}")
  string(REGEX MATCH "[0-9]+$" weft_nccl_minor "${weft_nccl_minor}")
  if(weft_nccl_major AND EXISTS ${weft_nccl_include_dir}/nccl_device/gin.h AND
     (weft_nccl_major GREATER 2 OR (weft_nccl_major EQUAL 2 AND weft_nccl_minor GREATER_EQUAL 28)))
    set(WEFT_HAVE_NCCL_GIN ON)
  endif()
  message(STATUS "weft: NCCL ${weft_nccl_major}.${weft_nccl_minor} headers in ${weft_nccl_include_dir}; "
                 "GIN backend: ${WEFT_HAVE_NCCL_GIN}")
else()
  message(STATUS "weft: no nccl.h beside the toolkit's headers; GIN backend: OFF")
endif()

find_package(OpenSSL REQUIRED COMPONENTS Crypto)
