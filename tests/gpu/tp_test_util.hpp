// SPDX-License-Identifier: MIT
// Helpers for the tensor-parallel op tests (ranks as threads): seeds that every rank can regenerate, device
// buffers on the rank's stream, failure collection; the host matrices, the fp64 reference and the rounding
// model's comparison are in support/tp_reference.hpp (host-only, unit-tested).
//
// NOTE: no device-synchronising call (cudaFree, cudaDeviceSynchronize, legacy-stream copies) may run while a
// peer could be waiting for this rank inside an op: buffers are made before the op and freed after it.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/tp_reference.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::tp_test {

/// A fresh base seed per test run (printed by the tests' traces).
inline uint64_t fresh_seed() {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

/// The random tests' seed: WEFT_TEST_SEED=<n> replays a run (its draws and its data), else a fresh one; printed.
inline uint64_t random_test_seed() {
    const std::optional<int64_t> fixed = env::get_int("WEFT_TEST_SEED");
    const uint64_t seed = fixed ? static_cast<uint64_t>(*fixed) : fresh_seed() >> 1;  // >> 1: read back as an int64
    std::printf("[ seed     ] WEFT_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
    return seed;
}

/// The random tests at world sizes 5, 6 and 7: per world, four cases `draw_case(draw, num_ranks, i)` (i = 0..3), run
/// as `run(num_ranks, cases, dtype, seed)`; bf16 or f16 per world (world 6 the other of world 5's). One seed (printed,
/// in every failure's trace) gives the draws and the data.
template <class Case, class DrawCase, class Run>
void run_random_worlds_5_to_7(DrawCase draw_case, Run run) {
    const uint64_t seed = random_test_seed();
    SCOPED_TRACE("WEFT_TEST_SEED=" + std::to_string(seed));
    gemm_test::RandomDraw draw(seed);
    const DType drawn = draw.uniform(0, 1) == 0 ? DType::kBF16 : DType::kF16;
    const DType dtypes[] = {drawn, drawn == DType::kBF16 ? DType::kF16 : DType::kBF16,
                            draw.uniform(0, 1) == 0 ? DType::kBF16 : DType::kF16};
    for (int w = 0; w < 3; ++w) {
        const int num_ranks = 5 + w;
        std::vector<Case> cases;
        for (int i = 0; i < 4; ++i) cases.push_back(draw_case(draw, num_ranks, i));
        run(num_ranks, cases, dtypes[w], seed);
    }
}

/// A seed for (base, role, rank, call): every rank regenerates every rank's data.
inline uint64_t seed_of(uint64_t base, int role, int rank, int call) {
    return base ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(1 + role * 1000003 + rank * 1009 + call * 7));
}

/// Device memory made before the op and freed after it (see the NOTE above).
struct DevBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit DevBuf(size_t n) : bytes(n) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 256))); }
    ~DevBuf() {
        if (ptr != nullptr) cudaFree(ptr);
    }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
};

inline void upload(const HostMat& h, void* dst, cudaStream_t s) {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.bits.data(), h.bytes(), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

inline void download(HostMat& h, const void* src, cudaStream_t s) {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.bits.data(), src, h.bytes(), cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

inline TensorView view(const HostMat& h, void* dev) {
    return TensorView(dev, h.dtype, {h.rows, h.cols}, {h.ld, 1});
}

/// Rank-thread failures collected for the main thread (gtest assertions from rank threads are allowed, but
/// an early return from one rank would leave its peers waiting in a collective).
struct Failures {
    std::mutex mutex;
    std::vector<std::string> messages;
    void add(const std::string& m) {
        std::lock_guard<std::mutex> lock(mutex);
        messages.push_back(m);
    }
    void report() {
        for (const auto& m : messages) ADD_FAILURE() << m;
    }
};

}  // namespace weft::tp_test
