// SPDX-License-Identifier: MIT
// How the benchmarks time GPU work (CUDA events on a stream, warm-up first) and rotate their inputs so that the
// L2 holds none of them. Host code: usable from .cpp (g++) and .cu files.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "weft/runtime/error.hpp"

/// Checks a CUDA runtime call in benchmark code (a weft::Error naming the call, its status and the place).
#define BENCH_CUDA(call) WEFT_CUDA_CHECK(call)

namespace weft::bench {

/// The median of `v` (the upper middle element for an even count); 0 for an empty vector.
inline double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
}

inline double mean(const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

/// Two events on a stream: start(s), the work, stop(s); then elapsed_ms() waits for the second event and returns
/// the milliseconds between them. stop_ms(s) is stop(s) then elapsed_ms().
class EventPair {
public:
    EventPair() {
        BENCH_CUDA(cudaEventCreate(&a_));
        BENCH_CUDA(cudaEventCreate(&b_));
    }
    ~EventPair() {
        cudaEventDestroy(a_);
        cudaEventDestroy(b_);
    }
    EventPair(const EventPair&) = delete;
    EventPair& operator=(const EventPair&) = delete;
    void start(cudaStream_t s) { BENCH_CUDA(cudaEventRecord(a_, s)); }
    void stop(cudaStream_t s) { BENCH_CUDA(cudaEventRecord(b_, s)); }
    double elapsed_ms() const {
        BENCH_CUDA(cudaEventSynchronize(b_));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, a_, b_));
        return ms;
    }
    double stop_ms(cudaStream_t s) {
        stop(s);
        return elapsed_ms();
    }

private:
    cudaEvent_t a_ = nullptr, b_ = nullptr;
};

/// Calls fn(i) for i = 0 .. warmup-1 untimed, then fn(warmup) .. fn(warmup + iters - 1) back to back between one
/// pair of events on `s`; returns the milliseconds per call (the batch's mean). For work whose launches must not be
/// separated by events (latencies near the launch cost). `i` lets a call pick its rotated input. `sync()` runs
/// after the last call is enqueued and must wait for `s` (the ranks' variant turns a device timeout into its
/// diagnosis there).
template <class Fn, class Sync>
double time_batch_ms(cudaStream_t s, int warmup, int iters, Fn&& fn, Sync&& sync) {
    for (int i = 0; i < warmup; ++i) fn(i);
    BENCH_CUDA(cudaGetLastError());
    EventPair ev;
    ev.start(s);
    for (int i = 0; i < iters; ++i) fn(warmup + i);
    ev.stop(s);
    BENCH_CUDA(cudaGetLastError());
    sync();
    return ev.elapsed_ms() / iters;
}

template <class Fn>
double time_batch_ms(cudaStream_t s, int warmup, int iters, Fn&& fn) {
    return time_batch_ms(s, warmup, iters, fn, [s] { BENCH_CUDA(cudaStreamSynchronize(s)); });
}

/// Times fns[0](i), fns[1](i), ... in turn every round, each between its own events on `s`, after `warmup`
/// untimed rounds; returns each function's milliseconds per round (take the median, or the mean). Alternating
/// the functions launch by launch lets them see the same clocks and temperature (a GPU that just idled boosts
/// higher; a long run throttles). fns receive the round's index (warm-up rounds first) for input rotation;
/// `sync()` waits for `s` once every round is enqueued.
template <class Sync, class... Fns>
std::array<std::vector<double>, sizeof...(Fns)> time_rounds_ms_sync(cudaStream_t s, Sync&& sync, int warmup, int iters,
                                                                    Fns&&... fns) {
    constexpr size_t kFns = sizeof...(Fns);
    for (int i = 0; i < warmup; ++i) (fns(i), ...);
    std::vector<cudaEvent_t> ev((kFns + 1) * static_cast<size_t>(iters));
    for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
    const auto record = [&](size_t at) { BENCH_CUDA(cudaEventRecord(ev[at], s)); };
    for (int i = 0; i < iters; ++i) {
        size_t at = (kFns + 1) * static_cast<size_t>(i);
        record(at);
        ((fns(warmup + i), record(++at)), ...);
    }
    BENCH_CUDA(cudaGetLastError());
    sync();
    std::array<std::vector<double>, kFns> out{};
    for (size_t f = 0; f < kFns; ++f) {
        for (int i = 0; i < iters; ++i) {
            const size_t at = (kFns + 1) * static_cast<size_t>(i) + f;
            float ms = 0;
            BENCH_CUDA(cudaEventElapsedTime(&ms, ev[at], ev[at + 1]));
            out[f].push_back(ms);
        }
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return out;
}

template <class... Fns>
std::array<std::vector<double>, sizeof...(Fns)> time_rounds_ms(cudaStream_t s, int warmup, int iters, Fns&&... fns) {
    return time_rounds_ms_sync(
        s, [s] { BENCH_CUDA(cudaStreamSynchronize(s)); }, warmup, iters, std::forward<Fns>(fns)...);
}

/// time_rounds_ms, reduced to each function's median.
template <class... Fns>
std::array<double, sizeof...(Fns)> time_rounds_median_ms(cudaStream_t s, int warmup, int iters, Fns&&... fns) {
    const auto samples = time_rounds_ms(s, warmup, iters, std::forward<Fns>(fns)...);
    std::array<double, sizeof...(Fns)> out{};
    for (size_t f = 0; f < out.size(); ++f) out[f] = median(samples[f]);
    return out;
}

/// The median milliseconds of fn(i), each call between its own events on `s`, after `warmup` untimed calls.
template <class Fn>
double time_median_ms(cudaStream_t s, int warmup, int iters, Fn&& fn) {
    return median(time_rounds_ms(s, warmup, iters, std::forward<Fn>(fn))[0]);
}

/// How many input sets a benchmark rotates through so that one pass over them moves more than 3x the L2's bytes:
/// then every launch reads its inputs from DRAM, not from the L2 a previous launch left warm. Clamped to
/// [min_sets, max_sets].
inline int cold_l2_sets(size_t set_bytes, size_t l2_bytes, int min_sets = 2, int max_sets = 32) {
    const size_t want = (3 * l2_bytes + std::max<size_t>(set_bytes, 1) - 1) / std::max<size_t>(set_bytes, 1);
    return static_cast<int>(std::clamp<size_t>(want, static_cast<size_t>(min_sets), static_cast<size_t>(max_sets)));
}

/// Slots of `item_bytes` (each 256-byte aligned) in a pool of `pool_bytes`, at most `max_slots` of them: call k
/// uses the slot at offset(k), so successive calls touch different memory and a pool larger than the L2 keeps
/// small messages out of it.
class PoolRotation {
public:
    PoolRotation(uint64_t pool_bytes, uint64_t item_bytes, uint64_t max_slots = UINT64_MAX)
        : stride_((std::max<uint64_t>(item_bytes, 1) + 255) / 256 * 256),
          slots_(std::max<uint64_t>(1, std::min(pool_bytes / stride_, max_slots))) {}
    uint64_t offset(int64_t k) const { return (static_cast<uint64_t>(k) % slots_) * stride_; }
    uint64_t slots() const { return slots_; }
    uint64_t stride() const { return stride_; }

private:
    uint64_t stride_, slots_;
};

}  // namespace weft::bench
