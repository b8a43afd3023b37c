// SPDX-License-Identifier: MIT
// GPU tests of the collective building blocks of the device layer: LL lines (data and flag in one 8-byte word,
// buffers reused without clearing) and block_barrier (block b of every rank meets block b of every other).
#include <gtest/gtest.h>

#include <vector>

#include "gpu/device_test_util.cuh"
#include "weft/device.cuh"
#include "weft/runtime/driver.hpp"

namespace weft {
namespace {

using device::Block;

constexpr int kLines = 3000;  // per sender, per round
constexpr int kRounds = 40;

// Round k (flag = low_latency_flag(k)): every rank writes its lines into slot `me` of every peer's buffer (parity
// k % 2), then waits for every peer's lines in its own buffer and checks them. Buffers are never cleared.
__global__ void ll_rounds_kernel(DeviceCtx ctx, uint8_t* buffer, uint64_t slot_bytes, uint64_t seed,
                                 unsigned long long* bad) {
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    unsigned long long wrong = 0;
    for (int k = 0; k < kRounds; ++k) {
        const uint32_t flag = low_latency_flag(static_cast<uint64_t>(k));
        uint8_t* parity = buffer + static_cast<uint64_t>(k % 2) * static_cast<uint64_t>(n) * slot_bytes;
        for (int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); j < kLines; j += gridDim.x * blockDim.x) {
            const uint64_t h = test::mix64(seed ^ (static_cast<uint64_t>(k) << 40) ^ (static_cast<uint64_t>(me) << 32) ^ j);
            const uint2 payload = make_uint2(static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32));
            for (int q = 0; q < n; ++q) {
                uint8_t* line = device::symm_at_or_trap(ctx, parity + static_cast<uint64_t>(me) * slot_bytes, q, __LINE__) +
                                static_cast<uint64_t>(j) * device::ll::kLineBytes;
                test::random_delay(seed, h ^ q, 200);
                device::ll::store_line(line, payload, flag);
            }
        }
        for (int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); j < kLines; j += gridDim.x * blockDim.x) {
            for (int q = 0; q < n; ++q) {
                const uint8_t* line = parity + static_cast<uint64_t>(q) * slot_bytes + static_cast<uint64_t>(j) * device::ll::kLineBytes;
                const uint2 got = device::ll::wait_line(ctx, line, flag);
                const uint64_t h = test::mix64(seed ^ (static_cast<uint64_t>(k) << 40) ^ (static_cast<uint64_t>(q) << 32) ^ j);
                wrong += got.x != static_cast<uint32_t>(h) || got.y != static_cast<uint32_t>(h >> 32);
            }
        }
        // Round k + 2 reuses this parity. A peer writes round k + 2 only after it has read this rank's round k + 1
        // lines, which this block writes only after all its threads have read round k (this barrier).
        __syncthreads();
    }
    if (wrong != 0) atomicAdd(bad, wrong);
}

TEST(DeviceCollectivePrimitives, LowLatencyLinesCarryDataAndFlagWithoutClearing) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test::fresh_seed();
    for (int n : {2, 3, 4}) {
        test::run_world(n, [&](World& w) {
            test::RankStream stream;
            const uint64_t slot_bytes = kLines * device::ll::kLineBytes;
            // Two parities x n senders, zeroed once; one block per rank (see the kernel for the pacing).
            auto* buffer = reinterpret_cast<uint8_t*>(w.heap().alloc_signals(2 * n * slot_bytes / 8));
            test::DeviceArray<unsigned long long> bad(1, stream);
            w.barrier();
            ll_rounds_kernel<<<1, 256, 0, stream>>>(w.device_ctx(), buffer, slot_bytes, seed, bad.get());
            test::finish(w, stream, "ll_rounds_kernel");
            EXPECT_EQ(bad.to_host()[0], 0u) << "rank " << w.rank() << " of " << n << " read a wrong LL payload";
            w.barrier();
            w.heap().free(buffer);
        });
    }
}

// Every block, every round: write a round-stamped value into slot [me][block] of every peer, meet, then read
// every peer's slot [q][block] here and check it carries this round's stamp (a barrier that let a block through
// before a peer's block arrived would show the previous round's stamp). `completed` is kept per block in
// device memory between launches, as the collectives do.
__global__ void block_barrier_kernel(DeviceCtx ctx, uint64_t* flags, uint64_t* completed, uint64_t* slots, int rounds,
                                     uint64_t base_round, uint64_t seed, unsigned long long* bad) {
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    __shared__ uint64_t done;
    if (threadIdx.x == 0) done = completed[blockIdx.x];
    __syncthreads();
    uint64_t count = done;
    unsigned long long wrong = 0;
    for (int k = 0; k < rounds; ++k) {
        const uint64_t round = base_round + static_cast<uint64_t>(k);
        for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
            test::random_delay(seed, round * 131 + blockIdx.x * 7 + q, 500);
            uint64_t* slot = slots + (static_cast<uint64_t>(me) * gridDim.x + blockIdx.x) * 2 + (round & 1);
            ptx::st<ptx::Sem::kWeak>(device::symm_at_or_trap(ctx, slot, q, __LINE__), round * 1000 + me);
        }
        count = device::block_barrier(Block{}, ctx, flags, blockIdx.x, count);
        for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
            const uint64_t v = ptx::ld<ptx::Sem::kWeak>(slots + (static_cast<uint64_t>(q) * gridDim.x + blockIdx.x) * 2 + (round & 1));
            wrong += v != round * 1000 + static_cast<uint64_t>(q);
        }
        // Nobody writes the next round before every peer has read this one.
        count = device::block_barrier(Block{}, ctx, flags, blockIdx.x, count);
    }
    if (threadIdx.x == 0) completed[blockIdx.x] = count;
    if (wrong != 0) atomicAdd(bad, wrong);
}

TEST(DeviceCollectivePrimitives, BlockBarrierPairsSameIndexBlocksAcrossLaunches) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test::fresh_seed();
    for (int n : {2, 3, 5}) {
        test::run_world(n, [&](World& w) {
            test::RankStream stream;
            const int blocks = test::blocks_for(w, 6);
            uint64_t* flags = w.heap().alloc_signals(static_cast<uint64_t>(kMaxCollectiveBlocks) * n);
            uint64_t* slots = w.heap().alloc_signals(static_cast<uint64_t>(n) * blocks * 2);
            test::DeviceArray<uint64_t> completed(static_cast<size_t>(blocks), stream);
            test::DeviceArray<unsigned long long> bad(1, stream);
            w.barrier();
            // Several launches with fewer blocks in between: block b's count must stay in step on every rank.
            for (int launch = 0; launch < 6; ++launch) {
                const int g = launch % 3 == 2 ? std::max(1, blocks / 2) : blocks;
                block_barrier_kernel<<<g, 64, 0, stream>>>(w.device_ctx(), flags, completed.get(), slots, 25,
                                                           static_cast<uint64_t>(launch) * 100, seed, bad.get());
            }
            test::finish(w, stream, "block_barrier_kernel");
            EXPECT_EQ(bad.to_host()[0], 0u) << "rank " << w.rank() << " of " << n << " saw a stale or early value";
            w.barrier();
            w.heap().free(slots);
            w.heap().free(flags);
        });
    }
}

}  // namespace
}  // namespace weft
