// SPDX-License-Identifier: MIT
// Example 01: ranks in a ring pass messages with plain stores, tile::notify, tile::wait and consume_token.
//
//   weft_example_01_notify_wait [num_ranks=4] [rounds=1000]
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "args.hpp"
#include "weft/device.cuh"
#include "weft/weft.hpp"

using weft::Cmp;
using weft::DeviceCtx;
using weft::device::Block;
using weft::device::SignalOp;
using weft::device::Token;
namespace tile = weft::device::tile;

constexpr int kWords = 256;  // message size: 1 KiB

__host__ __device__ uint32_t message_word(int sender, uint64_t round, int i) {
    return static_cast<uint32_t>(sender) * 0x01000193u ^ static_cast<uint32_t>(round) * 0x9e3779b9u ^ static_cast<uint32_t>(i);
}

// One block per rank. `inbox` (kWords words) and the two signal words are symmetric: every rank has
// them at the same heap offset, so tile::symm_at finds the next rank's copy.
//   inbox_ready: raised by the previous rank when it has written this rank's inbox (one add per round)
//   inbox_free:  raised by the next rank when it has read the message this rank wrote there
// `epoch` (this rank's own device memory) counts rounds across launches: the kernel advances it, so
// nothing is reset between launches and a CUDA graph replay would keep counting too.
__global__ void ring_kernel(DeviceCtx ctx, uint32_t* inbox, uint64_t* inbox_ready, uint64_t* inbox_free,
                            uint64_t* epoch, int rounds, uint64_t* checksums) {
    const int me = tile::rank(ctx);
    const int n = tile::num_ranks(ctx);
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    const uint64_t first = *epoch + 1;
    __syncthreads();  // every thread has read the epoch before thread 0 updates it at the end
    for (int r = 0; r < rounds; ++r) {
        const uint64_t round = first + static_cast<uint64_t>(r);
        // 1. The next rank has read what we wrote in its inbox last round (round - 1 reads so far).
        tile::wait(Block{}, ctx, inbox_free, 1, Cmp::kGe, round - 1);
        // 2. Write the message straight into the next rank's inbox: plain stores through its address
        //    (symm_at_or_trap: a peer that is not load/store reachable, on another node, ends the kernel with a
        //    diagnostic naming it; tile::symm_at would return nullptr).
        uint32_t* remote = weft::device::symm_at_or_trap(ctx, inbox, next, __LINE__);
        for (int i = static_cast<int>(threadIdx.x); i < kWords; i += static_cast<int>(blockDim.x)) {
            remote[i] = message_word(me, round, i);
        }
        // 3. Announce it: a block barrier, then one thread's release-add on the next rank's signal. Every
        //    store above is visible to whoever observes the new value.
        tile::notify(Block{}, ctx, inbox_ready, next, 1, SignalOp::kAdd);
        // 4. Wait for our own inbox (the previous rank's message for this round). The Token proves the
        //    wait happened; consume_token makes the loads depend on it.
        const Token token = tile::wait(Block{}, ctx, inbox_ready, 1, Cmp::kGe, round);
        const uint32_t* message = tile::consume_token(static_cast<const uint32_t*>(inbox), token);
        uint64_t sum = 0;
        for (int i = static_cast<int>(threadIdx.x); i < kWords; i += static_cast<int>(blockDim.x)) {
            sum += message[i] == message_word(prev, round, i) ? message[i] : 0;
        }
        atomicAdd(reinterpret_cast<unsigned long long*>(&checksums[r]), static_cast<unsigned long long>(sum));
        // 5. Hand the inbox back: the previous rank may overwrite it (the barrier inside notify orders
        //    every thread's reads first).
        tile::notify(Block{}, ctx, inbox_free, prev, 1, SignalOp::kAdd);
    }
    if (threadIdx.x == 0) {
        *epoch = first + static_cast<uint64_t>(rounds) - 1;
    }
}

int main(int argc, char** argv) {
    const weft::examples::Args args(argc, argv, "[num_ranks>=1] [rounds>=1]");
    args.at_most(2);
    const int num_ranks = args.positional<int>(1, "num_ranks", 1, 1024, 4);
    const int rounds = args.positional<int>(2, "rounds", 1, 1000000, 1000);
    try {
        weft::run_local(num_ranks, [&](weft::World& world) {
            cudaStream_t stream;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
            weft::SymmetricHeap& heap = world.heap();
            auto* inbox = heap.alloc_array<uint32_t>(kWords);
            uint64_t* signals = heap.alloc_signals(2);  // zeroed on every rank before any rank continues
            uint64_t* epoch = nullptr;
            uint64_t* checksums = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&epoch, sizeof(uint64_t)));
            WEFT_CUDA_CHECK(cudaMemset(epoch, 0, sizeof(uint64_t)));
            WEFT_CUDA_CHECK(cudaMalloc(&checksums, rounds * sizeof(uint64_t)));
            const int me = world.rank();
            const int prev = (me + num_ranks - 1) % num_ranks;
            // Every rank is set up before any kernel spins (cudaMalloc may synchronise the device).
            world.barrier();
            for (int launch = 0; launch < 2; ++launch) {  // the second launch continues the epochs
                WEFT_CUDA_CHECK(cudaMemsetAsync(checksums, 0, rounds * sizeof(uint64_t), stream));
                ring_kernel<<<1, 128, 0, stream>>>(world.device_ctx(), inbox, &signals[0], &signals[1], epoch,
                                                   rounds, checksums);
                WEFT_CUDA_CHECK(cudaGetLastError());
                world.sync_and_check(stream);  // a timed-out wait becomes a weft::Error naming the signal
                std::vector<uint64_t> got(rounds);
                WEFT_CUDA_CHECK(cudaMemcpy(got.data(), checksums, rounds * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                for (int r = 0; r < rounds; ++r) {
                    const uint64_t round = static_cast<uint64_t>(launch) * rounds + r + 1;
                    uint64_t want = 0;
                    for (int i = 0; i < kWords; ++i) {
                        want += message_word(prev, round, i);
                    }
                    WEFT_CHECK(got[r] == want, "rank " << me << " round " << round << ": checksum " << got[r]
                                                       << ", expected " << want);
                }
            }
            world.barrier();
            if (me == 0) {
                std::printf("%d ranks passed %d messages each around the ring (2 launches, no reset): ok\n",
                            num_ranks, 2 * rounds);
            }
            cudaFree(checksums);
            cudaFree(epoch);
            heap.free(signals);
            heap.free(inbox);
            cudaStreamDestroy(stream);
        });
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
