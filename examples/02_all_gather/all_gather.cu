// SPDX-License-Identifier: MIT
// Example 02: an SM-driven all-gather from public primitives: a tile map, putmem_signal and tile::wait.
//
//   weft_example_02_all_gather [num_ranks=4] [rows_per_rank=1000] [cols=512] [chunk_rows=64]
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <vector>

#include "args.hpp"
#include "weft/device.cuh"
#include "weft/weft.hpp"

using weft::AllGatherTileMap;
using weft::ChunkInfo;
using weft::Cmp;
using weft::DeviceCtx;
using weft::device::Block;
using weft::device::SignalOp;
namespace shmem = weft::device::shmem;
namespace tile = weft::device::tile;

// Rank r owns rows [r * rows_per_rank, (r + 1) * rows_per_rank) of a [num_ranks * rows_per_rank, cols]
// matrix of uint32; afterwards every rank holds all of it in `gathered` (symmetric). The map splits
// each shard into chunks with one signal each (signal = owner * chunks_per_rank + chunk).
//
// Push: block b sends chunks b, b + gridDim, ... of this rank's shard to every rank (itself included,
// starting with itself, then rank + 1, ...): putmem_signal writes the rows, then raises that chunk's
// signal on the destination with a release-add, so a rank that sees the signal sees the rows.
// Wait: block b waits for signals b, b + gridDim, ... in the map's arrival order. The kernel ends when
// every chunk has arrived. Signals are never reset: call k waits for `>= k`, with k kept per block in
// `calls` (device memory, advanced here; the grid must stay the same from call to call).
__global__ void all_gather_kernel(DeviceCtx ctx, AllGatherTileMap map, const uint32_t* input, uint32_t* gathered,
                                  uint64_t cols, uint64_t* signals, uint64_t* calls) {
    const int me = tile::rank(ctx);
    const int n = tile::num_ranks(ctx);
    const uint64_t epoch = calls[blockIdx.x] + 1;
    for (int c = static_cast<int>(blockIdx.x); c < map.chunks_per_rank(); c += static_cast<int>(gridDim.x)) {
        const ChunkInfo chunk = map.chunk(map.signal_index(me, c));
        const uint32_t* src = input + (chunk.row_begin - me * map.rows_per_rank) * cols;
        uint32_t* dst = gathered + chunk.row_begin * cols;  // same offset on every rank: symmetric
        for (int k = 0; k < n; ++k) {
            shmem::putmem_signal(Block{}, ctx, dst, src, chunk.num_rows * cols * sizeof(uint32_t),
                                 &signals[chunk.signal_idx], 1, SignalOp::kAdd, (me + k) % n);
        }
    }
    for (int i = static_cast<int>(blockIdx.x); i < map.num_signals(); i += static_cast<int>(gridDim.x)) {
        const int s = map.chunk_at(me, i).signal_idx;
        tile::wait(Block{}, ctx, &signals[s], 1, Cmp::kGe, epoch);
    }
    if (threadIdx.x == 0) {
        calls[blockIdx.x] = epoch;
    }
}

int main(int argc, char** argv) {
    const weft::examples::Args args(argc, argv, "[num_ranks] [rows_per_rank] [cols] [chunk_rows]");
    args.at_most(4);
    // Bounds keep total_elems * sizeof(uint32_t) within uint64; the map checks the rows further.
    const int num_ranks = args.positional<int>(1, "num_ranks", 1, 1024, 4);
    const int64_t rows_per_rank = args.positional<int64_t>(2, "rows_per_rank", 1, int64_t{1} << 30, 1000);
    const uint64_t cols = args.positional<uint64_t>(3, "cols", 1, int64_t{1} << 20, 512);
    const int64_t chunk_rows = args.positional<int64_t>(4, "chunk_rows", 1, int64_t{1} << 30, 64);
    const AllGatherTileMap map{rows_per_rank, num_ranks, chunk_rows, /*tile_m=*/128};
    if (!map.is_valid()) args.fail(map.invalid_reason());
    const uint64_t shard_elems = static_cast<uint64_t>(rows_per_rank) * cols;
    const uint64_t total_elems = shard_elems * static_cast<uint64_t>(num_ranks);
    try {
        weft::WorldOptions options;
        options.heap_bytes = (total_elems * sizeof(uint32_t) + (64ull << 20)) / (2ull << 20) * (2ull << 20) + (2ull << 20);
        weft::run_local(num_ranks, [&](weft::World& world) {
            cudaStream_t stream;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
            weft::SymmetricHeap& heap = world.heap();
            auto* gathered = heap.alloc_array<uint32_t>(total_elems);
            uint64_t* signals = heap.alloc_signals(static_cast<uint64_t>(map.num_signals()));
            const int blocks = std::min(world.sm_budget(), 8);  // every rank's kernel stays resident
            uint32_t* input = nullptr;
            uint64_t* calls = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&input, shard_elems * sizeof(uint32_t)));
            WEFT_CUDA_CHECK(cudaMalloc(&calls, blocks * sizeof(uint64_t)));
            WEFT_CUDA_CHECK(cudaMemset(calls, 0, blocks * sizeof(uint64_t)));
            for (int call = 0; call < 3; ++call) {
                // Fresh data each call; every rank can compute every rank's shard (same seed).
                const auto shard = [&](int r) {
                    std::mt19937 rng(static_cast<uint32_t>(call * 1000 + r));
                    std::vector<uint32_t> v(shard_elems);
                    for (auto& x : v) x = rng();
                    return v;
                };
                const std::vector<uint32_t> mine = shard(world.rank());
                // On the kernel's stream and finished before the barrier (the legacy stream's copies would not be
                // ordered before the peers' kernels, which write into `gathered` at once).
                WEFT_CUDA_CHECK(cudaMemcpyAsync(input, mine.data(), shard_elems * sizeof(uint32_t),
                                                cudaMemcpyHostToDevice, stream));
                WEFT_CUDA_CHECK(cudaMemsetAsync(gathered, 0xFF, total_elems * sizeof(uint32_t), stream));  // poison
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                world.barrier();  // nobody writes into a rank still reading the previous result
                all_gather_kernel<<<blocks, 256, 0, stream>>>(world.device_ctx(), map, input, gathered, cols, signals,
                                                             calls);
                WEFT_CUDA_CHECK(cudaGetLastError());
                world.sync_and_check(stream);
                std::vector<uint32_t> got(total_elems);
                WEFT_CUDA_CHECK(cudaMemcpy(got.data(), gathered, total_elems * sizeof(uint32_t), cudaMemcpyDeviceToHost));
                for (int r = 0; r < num_ranks; ++r) {
                    const std::vector<uint32_t> want = shard(r);
                    for (uint64_t i = 0; i < shard_elems; ++i) {
                        WEFT_CHECK(got[static_cast<uint64_t>(r) * shard_elems + i] == want[i],
                                   "rank " << world.rank() << " call " << call << ": element " << i << " of rank " << r
                                           << "'s shard is wrong");
                    }
                }
            }
            world.barrier();
            if (world.rank() == 0) {
                std::printf("all-gather of %d x %lld x %llu uint32 over %d ranks, 3 calls, verified: ok\n", num_ranks,
                            static_cast<long long>(rows_per_rank), static_cast<unsigned long long>(cols), num_ranks);
            }
            cudaFree(calls);
            cudaFree(input);
            heap.free(signals);
            heap.free(gathered);
            cudaStreamDestroy(stream);
        }, options);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
