// SPDX-License-Identifier: MIT
// The JIT's self-test kernel: y = a * x + y + ctx.rank, specialised on a config struct.
//
// Small on purpose: it exercises what every real weft kernel needs from the JIT (a C++20 structural
// config as a template parameter, weft's device headers, a DeviceCtx passed by value) and gives the
// autotuner tests two configs of one kernel with clearly different speeds (`redundant_passes`).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/token.cuh"

namespace weft::kernels::jit_selftest {

/// Compile-time knobs of saxpy.
struct SaxpyConfig {
    int items_per_thread = 1;  ///< elements each thread handles per grid-stride step (1..16)
    int redundant_passes = 1;  ///< times every element is reloaded and recomputed (1 = no waste);
                               ///< > 1 makes a deliberately slow variant for autotuner tests
};

/// Shared by host heuristics and the kernel's static_assert.
__host__ __device__ constexpr bool is_valid(const SaxpyConfig& c) {
    return c.items_per_thread >= 1 && c.items_per_thread <= 16 && c.redundant_passes >= 1 &&
           c.redundant_passes <= 1024;
}

/// y[i] = a * x[i] + y[i] + ctx.rank for i < n. Any grid and block shape covers any n (grid-stride
/// loop). Adding ctx.rank lets a test prove that the DeviceCtx argument arrived intact.
template <SaxpyConfig C>
__global__ void saxpy(weft::DeviceCtx ctx, float a, const float* x, float* y, int n) {
    static_assert(is_valid(C), "SaxpyConfig: items_per_thread must be in 1..16, redundant_passes in 1..1024");
    // Data this kernel reads was written by this rank's own stream before the launch: no wait needed.
    constexpr weft::device::Token kLocal = weft::device::Token::assume_local_data();
    const float bias = static_cast<float>(ctx.rank) + static_cast<float>(kLocal.value());
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * C.items_per_thread;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x * C.items_per_thread + threadIdx.x;
    for (long long base = first; base < n; base += stride) {
#pragma unroll
        for (int k = 0; k < C.items_per_thread; ++k) {
            const long long i = base + static_cast<long long>(k) * blockDim.x;
            if (i < n) {
                float result = 0.0f;
                // Volatile loads cannot be merged, so every pass really goes to memory again.
                for (int pass = 0; pass < C.redundant_passes; ++pass) {
                    const float xv = *static_cast<const volatile float*>(x + i);
                    const float yv = *static_cast<const volatile float*>(y + i);
                    result = fmaf(a, xv, yv) + bias;
                }
                y[i] = result;
            }
        }
    }
}

}  // namespace weft::kernels::jit_selftest
