// SPDX-License-Identifier: MIT
// Helpers shared by the device-layer GPU tests: per-rank streams and buffers, world sweeps, hashing.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "weft/device.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"

namespace weft::test {

/// World sizes every device test sweeps (ranks share the visible GPUs; 3, 5, 7 are not powers of two).
inline const std::vector<int> kWorldSizes = {1, 2, 3, 4, 5, 6, 7, 8};

/// Small heaps (8 ranks may share one GPU) and a bounded timeout well above any test's needs.
inline WorldOptions device_test_options(uint64_t heap_bytes = 64ull << 20) {
    WorldOptions o;
    o.heap_bytes = heap_bytes;
    o.timeout = std::chrono::milliseconds(20000);
    return o;
}

/// Runs `fn` on `num_ranks` ranks; a failure on any rank becomes a test failure with its message.
inline void run_world(int num_ranks, const std::function<void(World&)>& fn,
                      const WorldOptions& options = device_test_options()) {
    try {
        run_local(num_ranks, fn, options);
    } catch (const std::exception& e) {
        ADD_FAILURE() << "world of " << num_ranks << " ranks failed: " << e.what();
    }
}

/// A seed that differs every run (printed by the tests so that a failure can be replayed).
inline uint64_t fresh_seed() {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

/// splitmix64: the hash every test derives its data from, identical on host and device.
__host__ __device__ inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/// Byte i of rank `rank`'s source data under `seed`.
__host__ __device__ inline uint8_t pattern_byte(uint64_t seed, int rank, uint64_t i) {
    return static_cast<uint8_t>(mix64(seed ^ (static_cast<uint64_t>(rank) << 48) ^ i) >> 24);
}

/// Sleeps the calling thread a pseudo-random 0..max_ns nanoseconds (shakes the interleavings).
__device__ inline void random_delay(uint64_t seed, uint64_t salt, uint32_t max_ns) {
    const uint32_t ns = static_cast<uint32_t>(mix64(seed ^ salt) % (max_ns + 1));
    if (ns > 0) {
        weft::ptx::nanosleep(ns);
    }
}

/// A stream of this rank's own (non-blocking: ranks' kernels must run concurrently).
class RankStream {
public:
    RankStream() { WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
    ~RankStream() { cudaStreamDestroy(stream_); }
    RankStream(const RankStream&) = delete;
    RankStream& operator=(const RankStream&) = delete;
    operator cudaStream_t() const { return stream_; }

private:
    cudaStream_t stream_ = nullptr;
};

/// Plain (non-symmetric) device memory, zeroed, freed with its owner. Stream-ordered (cudaMallocAsync /
/// cudaFreeAsync on the rank's stream): cudaMalloc/cudaFree may synchronise the whole device, i.e. wait
/// for another rank's kernel that is spinning on this rank's next launch.
template <class T>
class DeviceArray {
public:
    DeviceArray(size_t count, cudaStream_t stream) : count_(count), stream_(stream) {
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), count * sizeof(T) + 16, stream));
        WEFT_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, count * sizeof(T) + 16, stream));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    ~DeviceArray() { cudaFreeAsync(ptr_, stream_); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    T* get() const { return ptr_; }
    std::vector<T> to_host() const {
        std::vector<T> out(count_);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(out.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost, stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return out;
    }

private:
    T* ptr_ = nullptr;
    size_t count_;
    cudaStream_t stream_;
};

/// Copies `count` elements of device memory to the host, ordered on `stream`.
template <class T>
std::vector<T> to_host(const T* device, size_t count, cudaStream_t stream) {
    std::vector<T> out(count);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(out.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return out;
}

/// Blocks a rank's kernel may use: at most `wanted`, never more than the rank's SM budget, so that
/// every rank's kernel is resident at once (their spins depend on each other).
inline int blocks_for(const World& w, int wanted) { return std::max(1, std::min(wanted, w.sm_budget())); }

/// Launch check + stream synchronisation that turns a trapped spin into its diagnosis.
inline void finish(World& w, cudaStream_t stream, const char* what) {
    const cudaError_t launch = cudaGetLastError();
    WEFT_CHECK(launch == cudaSuccess, what << ": launch failed: " << cudaGetErrorName(launch));
    w.sync_and_check(stream);
}

}  // namespace weft::test
