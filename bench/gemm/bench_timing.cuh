// SPDX-License-Identifier: MIT
// What weft_bench_gemm and weft_bench_stream share: a CUDA-call check that throws, and the median of
// event-timed launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#define BENCH_CUDA(call)                                                                                     \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
    } while (0)

namespace weft::bench {

inline double median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

/// Times fn(i) per iteration with events (ms), after `warmup` untimed calls; returns the median.
template <class Fn>
double time_median_ms(int warmup, int iters, Fn&& fn) {
    for (int i = 0; i < warmup; ++i) fn(i);
    std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
    for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
    for (int i = 0; i < iters; ++i) {
        BENCH_CUDA(cudaEventRecord(ev[2 * i], nullptr));
        fn(warmup + i);
        BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], nullptr));
    }
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<float> ms(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (auto& e : ev) cudaEventDestroy(e);
    return median(ms);
}

}  // namespace weft::bench
