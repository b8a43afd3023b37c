// SPDX-License-Identifier: MIT
// Portability macros and fixed-width integers for headers compiled by g++, nvcc and NVRTC alike.
#pragma once

// weft's headers are C++20 (concepts, designated initialisers) under every compiler that reads them. nvcc defaults to
// C++17: a .cu file of yours needs -std=c++20 (CMake: weft_cuda_target(<target>), README "Use weft from your CMake
// project"). (GCC 10 reports 201709 for -std=c++20, hence the bound.)
#if __cplusplus <= 201703L
#error "weft's headers need C++20: compile with -std=c++20 (nvcc defaults to C++17; CMake: weft_cuda_target(<target>))"
#endif

// NVRTC ships no C++ standard library headers; libcu++ (the toolkit's cccl include folder, which the
// NVRTC include path must name) provides <cuda/std/cstdint>, which also declares the global names.
#if defined(__CUDACC_RTC__)
#include <cuda/std/cstdint>
#include <cuda/std/cstddef>
#else
#include <cstddef>
#include <cstdint>
#endif

/// Marks functions usable from host and device code. Plain (host-only) under g++.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define WEFT_HOST_DEVICE __host__ __device__
#define WEFT_DEVICE_INLINE __device__ __forceinline__
#else
#define WEFT_HOST_DEVICE
#endif

/// Compiled only when device code is being generated (nvcc's device pass, or NVRTC).
#if defined(__CUDA_ARCH__) || defined(__CUDACC_RTC__)
#define WEFT_DEVICE_PASS 1
#else
#define WEFT_DEVICE_PASS 0
#endif
