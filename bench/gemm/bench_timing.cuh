// SPDX-License-Identifier: MIT
// What weft_bench_gemm and weft_bench_stream share: a CUDA-call check that throws, and the medians of
// event-timed launches (one function, or several alternating launch by launch).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
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

/// Times fns[0](i), fns[1](i), ... in turn every round, each between its own events, after `warmup` untimed
/// rounds; returns each function's median (ms). Alternating the functions launch by launch lets them see the same
/// clocks and temperature (a GPU that just idled boosts higher; a long run throttles).
template <class... Fns>
std::array<double, sizeof...(Fns)> time_rounds_ms(int warmup, int iters, Fns&&... fns) {
    constexpr size_t kFns = sizeof...(Fns);
    for (int i = 0; i < warmup; ++i) (fns(i), ...);
    std::vector<cudaEvent_t> ev((kFns + 1) * static_cast<size_t>(iters));
    for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
    const auto record = [&](size_t at) { BENCH_CUDA(cudaEventRecord(ev[at], nullptr)); };
    for (int i = 0; i < iters; ++i) {
        size_t at = (kFns + 1) * static_cast<size_t>(i);
        record(at);
        ((fns(warmup + i), record(++at)), ...);
    }
    BENCH_CUDA(cudaDeviceSynchronize());
    std::array<double, kFns> out{};
    for (size_t f = 0; f < kFns; ++f) {
        std::vector<float> ms(static_cast<size_t>(iters));
        for (int i = 0; i < iters; ++i) {
            const size_t at = (kFns + 1) * static_cast<size_t>(i) + f;
            BENCH_CUDA(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], ev[at], ev[at + 1]));
        }
        out[f] = median(ms);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return out;
}

/// Times fn(i) per iteration with events (ms), after `warmup` untimed calls; returns the median.
template <class Fn>
double time_median_ms(int warmup, int iters, Fn&& fn) {
    return time_rounds_ms(warmup, iters, std::forward<Fn>(fn))[0];
}

}  // namespace weft::bench
