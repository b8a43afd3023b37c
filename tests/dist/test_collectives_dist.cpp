// SPDX-License-Identifier: MIT
// The collectives with one process per rank (weftrun): peers' heaps mapped through file descriptors, flags and
// copies crossing processes. Processes sharing a GPU are time-sliced, so sizes and call counts stay small: this
// checks correctness, not speed.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "dist/dist_world.hpp"
#include "gpu/collectives_test_kernels.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

using ops::AllGatherAlgo;
using ops::AllReduceAlgo;

constexpr uint64_t kCapacity = 4ull << 20;  // bytes per buffer

// One test's buffers on this process's rank (collective: made and freed by every rank). The dist World's heap
// is small, so the workspace's staging is shrunk before the first collective call makes it.
struct DistBuffers {
    World& w;
    cudaStream_t stream = nullptr;
    uint8_t* local_in = nullptr;
    uint8_t* local_out = nullptr;
    uint8_t* sym_in = nullptr;
    uint8_t* sym_out = nullptr;

    explicit DistBuffers(World& world) : w(world) {
        ::setenv("WEFT_COLLECTIVE_STAGING_BYTES", "1M", 1);  // every process does the same
        ops::prepare_collectives(w);
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_in), kCapacity, stream));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_out), kCapacity, stream));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        sym_in = static_cast<uint8_t*>(w.heap().alloc(kCapacity));
        sym_out = static_cast<uint8_t*>(w.heap().alloc(kCapacity));
        w.barrier();
    }
    ~DistBuffers() {
        try {
            w.sync_and_check(stream);
            w.barrier();
            w.heap().free(sym_out);
            w.heap().free(sym_in);
        } catch (const std::exception& e) {
            ADD_FAILURE() << e.what();
        }
        cudaFreeAsync(local_out, stream);
        cudaFreeAsync(local_in, stream);
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
    }
};

// Writes rank `rank`'s pattern (elements [0, count)) to `dst`.
void upload_pattern(cudaStream_t s, void* dst, DType t, uint64_t count, uint64_t seed, int rank) {
    const int es = dtype_bytes(t);
    std::vector<uint8_t> h(count * static_cast<uint64_t>(es));
    for (uint64_t i = 0; i < count; ++i) {
        const uint32_t b = int_bits(pattern_value(seed, rank, i), t);
        std::memcpy(h.data() + i * static_cast<uint64_t>(es), &b, static_cast<size_t>(es));
    }
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.data(), h.size(), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::vector<uint32_t> download_bits(cudaStream_t s, const void* src, DType t, uint64_t count) {
    const int es = dtype_bytes(t);
    std::vector<uint8_t> h(count * static_cast<uint64_t>(es));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), src, h.size(), cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint32_t> bits(count, 0);
    for (uint64_t i = 0; i < count; ++i)
        std::memcpy(&bits[i], h.data() + i * static_cast<uint64_t>(es), static_cast<size_t>(es));
    return bits;
}

TEST(DistCollectives, AllReduceEveryAlgorithm) {
    DistBuffers b(dist_world());
    World& w = b.w;
    const int n = w.num_ranks();
    for (DType t : {DType::kBF16, DType::kF32}) {
        for (AllReduceAlgo a :
             {AllReduceAlgo::kAuto, AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
            for (uint64_t count : {1ull, 1001ull, 70001ull}) {
                for (bool symmetric : {false, true}) {
                    const uint64_t seed = count * 7 + static_cast<uint64_t>(a);
                    uint8_t* in = symmetric ? b.sym_in : b.local_in;
                    uint8_t* out = symmetric ? b.sym_out : b.local_out;
                    WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, count * dtype_bytes(t), b.stream));
                    upload_pattern(b.stream, in, t, count, seed, w.rank());
                    ops::all_reduce(w, TensorView(in, t, {static_cast<int64_t>(count)}),
                                    TensorView(out, t, {static_cast<int64_t>(count)}), b.stream, {.algo = a});
                    w.sync_and_check(b.stream);
                    const std::vector<uint32_t> got = download_bits(b.stream, out, t, count);
                    uint64_t bad = 0;
                    for (uint64_t i = 0; i < count; ++i) {
                        int32_t sum = 0;
                        for (int r = 0; r < n; ++r) sum += pattern_value(seed, r, i);
                        bad += got[i] != int_bits(sum, t);
                    }
                    EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_reduce " << ops::algo_name(a) << " "
                                       << dtype_name(t) << " count " << count << (symmetric ? " symmetric" : " local");
                }
            }
        }
    }
}

TEST(DistCollectives, AllGatherEveryAlgorithm) {
    DistBuffers b(dist_world());
    World& w = b.w;
    const int n = w.num_ranks();
    for (AllGatherAlgo a : {AllGatherAlgo::kAuto, AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush,
                            AllGatherAlgo::kCopyEnginePull, AllGatherAlgo::kCopyEnginePush}) {
        for (uint64_t count : {7ull, 50001ull}) {
            const DType t = DType::kBF16;
            const uint64_t seed = count * 13 + static_cast<uint64_t>(a);
            const uint64_t total = count * static_cast<uint64_t>(n);
            WEFT_CUDA_CHECK(cudaMemsetAsync(b.sym_out, 0xFF, total * 2, b.stream));
            upload_pattern(b.stream, b.local_in, t, count, seed, w.rank());
            ops::all_gather(w, TensorView(b.local_in, t, {static_cast<int64_t>(count)}),
                            TensorView(b.sym_out, t, {static_cast<int64_t>(total)}), b.stream, {.algo = a});
            w.sync_and_check(b.stream);
            const std::vector<uint32_t> got = download_bits(b.stream, b.sym_out, t, total);
            uint64_t bad = 0;
            for (uint64_t k = 0; k < total; ++k)
                bad += got[k] != int_bits(pattern_value(seed, static_cast<int>(k / count), k % count), t);
            EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_gather " << ops::algo_name(a) << " count " << count;
        }
    }
}

TEST(DistCollectives, ReduceScatter) {
    DistBuffers b(dist_world());
    World& w = b.w;
    const int n = w.num_ranks();
    for (uint64_t count : {1ull, 999ull, 40000ull}) {
        for (bool symmetric : {false, true}) {
            const DType t = DType::kF16;
            const uint64_t seed = count * 17 + (symmetric ? 1 : 0);
            const uint64_t total = count * static_cast<uint64_t>(n);
            uint8_t* in = symmetric ? b.sym_in : b.local_in;
            uint8_t* out = symmetric ? b.sym_out : b.local_out;
            WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, count * 2, b.stream));
            upload_pattern(b.stream, in, t, total, seed, w.rank());
            ops::reduce_scatter(w, TensorView(in, t, {static_cast<int64_t>(total)}),
                                TensorView(out, t, {static_cast<int64_t>(count)}), b.stream);
            w.sync_and_check(b.stream);
            const std::vector<uint32_t> got = download_bits(b.stream, out, t, count);
            uint64_t bad = 0;
            for (uint64_t i = 0; i < count; ++i) {
                int32_t sum = 0;
                for (int r = 0; r < n; ++r) sum += pattern_value(seed, r, static_cast<uint64_t>(w.rank()) * count + i);
                bad += got[i] != int_bits(sum, t);
            }
            EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": reduce_scatter count " << count
                               << (symmetric ? " symmetric" : " local");
        }
    }
}

}  // namespace
}  // namespace weft::test
