// SPDX-License-Identifier: MIT
// Helpers of the expert-parallel GPU tests: stream-ordered device arrays, routing scenarios, self-describing payloads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "support/ep_reference.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
class World;
}

namespace weft::test::ep {

/// A fresh random seed, printed so that a failure can be replayed.
inline uint32_t fresh_seed() {
    const uint32_t seed = std::random_device{}();
    std::printf("[ seed     ] %u\n", seed);
    return seed;
}

/// A stream of the rank's own (non-blocking: never ordered behind another rank's work).
struct RankStream {
    cudaStream_t s = nullptr;
    RankStream() { WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~RankStream() { cudaStreamDestroy(s); }
    RankStream(const RankStream&) = delete;
    RankStream& operator=(const RankStream&) = delete;
};

/// A device array allocated and freed in stream order on `stream` (never a device-wide synchronisation,
/// which would wait for other ranks' spinning kernels).
template <class T>
class DeviceArray {
public:
    DeviceArray(size_t count, cudaStream_t stream) : count_(count), stream_(stream) {
        if (count_ > 0) {
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T), stream_));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        }
    }
    ~DeviceArray() {
        if (ptr_ != nullptr) {
            cudaFreeAsync(ptr_, stream_);
            cudaStreamSynchronize(stream_);
        }
    }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    T* get() const { return ptr_; }
    size_t size() const { return count_; }
    void upload(const std::vector<T>& host) const { upload(host.data(), host.size()); }
    void upload(const T* host, size_t n) const {
        WEFT_CHECK(n <= count_, "DeviceArray::upload: " << n << " elements into " << count_);
        if (n == 0) return;
        WEFT_CUDA_CHECK(cudaMemcpyAsync(ptr_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    /// Fills every byte with `byte` (poison before a kernel writes).
    void poison(int byte) const {
        if (count_ == 0) return;
        WEFT_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, count_ * sizeof(T), stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }

private:
    T* ptr_ = nullptr;
    size_t count_;
    cudaStream_t stream_;
};

/// Copies `n` elements at device address `src` to the host (ordered on `stream`).
template <class T>
std::vector<T> download(const T* src, size_t n, cudaStream_t stream) {
    std::vector<T> host(n);
    if (n == 0) return host;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(host.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return host;
}

/// Runs `check` on this rank, then agrees with every rank (through the store): when any rank's check
/// failed, every rank throws weft::Error naming the first failing rank and its message. So no rank goes
/// on to a collective kernel that a failed rank will never join (which would spin until the timeout).
void collective_check(World& world, const std::function<void()>& check);

/// How tokens are routed in a test case.
enum class Scenario {
    kUniform,      ///< k distinct experts uniformly at random; T varies per rank
    kSkewed,       ///< every token's slot 0 is one hot expert (it receives the worst case)
    kSparse,       ///< only experts of ranks 0 and 1 (every other one on rank 1): ranks and experts with nothing
    kOneRank,      ///< all k experts of a token on one rank
    kAllDropped,   ///< every slot -1
    kSomeDropped,  ///< uniform with about 30% of the slots -1
    kNoTokens,     ///< T = 0 on every rank
    kOneToken,     ///< T = 1 on every rank
    kMixedCounts,  ///< T = 0, 1 and max on different ranks
    kMaxTokens,    ///< T = max on every rank, uniform
};
const char* scenario_name(Scenario s);
std::vector<Scenario> all_scenarios();

/// Every rank's routing for a scenario (the same on every rank for the same seed). Weights in [0.05, 1].
std::vector<Routing> make_routing(Scenario s, const Params& p, int max_tokens, uint32_t seed);

/// Rows of token payloads: channel 0 = source rank + 1, 1 = token / 64, 2 = token % 64 (exact small
/// integers, so a misplaced row names its origin), the rest pseudo-random multiples of 1/64 in [-4, 4).
/// `fp8_friendly` adds all-zero 128-channel groups and varied magnitudes.
uint16_t payload(int rank, int token, int channel, uint32_t seed, bool fp8_friendly);
std::vector<uint16_t> payload_rows(int rank, int num_tokens, int hidden, uint32_t seed, bool fp8_friendly);
/// "origin rank r token t" decoded from a row (for messages).
std::string describe_row(const uint16_t* row);

/// Everything the tests know about one low-latency call, on every rank: each rank's routing and payload rows
/// (payload_rows), the rows each rank's experts receive in the one-node order (reference_low_latency_rows), and where
/// each route lands.
struct LowLatencyCall {
    std::vector<Routing> all;
    std::vector<std::vector<uint16_t>> x_all;
    std::vector<std::vector<std::vector<RowSource>>> rows;  ///< [receiving rank][local expert] in order
    std::vector<std::vector<int32_t>> row_of;  ///< [source][t * k + j]: route (t, j)'s row in its expert's list, or -1
};
LowLatencyCall low_latency_call(const Params& p, std::vector<Routing> all, uint32_t seed, bool fp8_friendly);

/// The per-expert computation the tests apply: y = bf16(x * (1 + (expert % 5) / 4)).
uint16_t expert_output(uint16_t x, int expert);

}  // namespace weft::test::ep
