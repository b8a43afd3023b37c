// SPDX-License-Identifier: MIT
// What the tensor-parallel examples (05, 06) share besides weft itself: random bf16 data, the slowest rank's time per
// call, a relative error, and the cuBLAS GEMM of their baseline. Examples include nothing from bench/ or tests/.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "weft/weft.hpp"

namespace weft_example {

// Uniform values in [-1, 1) from a hash of (seed, index): random data, never zeros (a GEMM on zeros runs faster).
__global__ void fill_random(__nv_bfloat16* p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        uint64_t x = (seed ^ static_cast<uint64_t>(i)) * 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
        p[i] = __float2bfloat16_rn(static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
    }
}

// What every rank reports; rank threads agree on the slowest (largest) value.
struct Slowest {
    std::mutex mutex;
    std::vector<double> value;
    double max(weft::World& w, double v) {
        {
            std::lock_guard<std::mutex> lock(mutex);
            value[static_cast<size_t>(w.rank())] = v;
        }
        w.barrier();
        const double m = *std::max_element(value.begin(), value.end());
        w.barrier();  // nobody overwrites a value before every rank has read them
        return m;
    }
};

// Milliseconds per call of `body`, the slowest rank's: two untimed calls, a barrier, then CUDA events around
// `iters` calls on every rank at once.
inline double time_ms(weft::World& w, Slowest& slowest, cudaStream_t s, int iters, const std::function<void()>& body) {
    body();
    body();
    w.sync_and_check(s);
    w.barrier();
    weft::Event start(true), stop(true);
    start.record(s);
    for (int i = 0; i < iters; ++i) body();
    stop.record(s);
    w.sync_and_check(s);
    return slowest.max(w, stop.elapsed_ms(start) / iters);
}

// ||x - y|| / ||y|| of two bf16 [rows, cols] device matrices.
inline double relative_error(const void* x, const void* y, int64_t count, cudaStream_t s) {
    std::vector<__nv_bfloat16> hx(static_cast<size_t>(count)), hy(hx.size());
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    double num = 0, den = 0;
    for (size_t i = 0; i < hx.size(); ++i) {
        const double a = __bfloat162float(hx[i]), b = __bfloat162float(hy[i]);
        num += (a - b) * (a - b);
        den += b * b;
    }
    return std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
}

// Row-major C[m, n] = A[m, k] * B[n, k]^T in bf16 with fp32 accumulation: cuBLAS is column-major, so it computes
// C^T = B * A^T from the same bytes.
inline void cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k) {
    const float alpha = 1.f, beta = 0.f;
    const cublasStatus_t st =
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                     b, CUDA_R_16BF, static_cast<int>(k), a, CUDA_R_16BF, static_cast<int>(k), &beta, c, CUDA_R_16BF,
                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    WEFT_CHECK(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx returned status " << static_cast<int>(st));
}


}  // namespace weft_example
