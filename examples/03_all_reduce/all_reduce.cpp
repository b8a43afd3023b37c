// SPDX-License-Identifier: MIT
// Example 03: all-reduce with weft::ops::all_reduce: what the automatic choice picks by size, forcing an algorithm
// (argument or WEFT_ALLREDUCE_ALGO), symmetric vs local buffers, in place, and a CUDA graph replay.
//
//   weft_example_03_all_reduce [num_ranks=4] [count=100000]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "args.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/weft.hpp"

using weft::DType;
using weft::TensorView;
using weft::ops::AllReduceAlgo;

namespace {

// Rank r contributes r + 1 + (i % 7) at element i: the sum over n ranks is n (n + 1) / 2 + n (i % 7), exact in f32.
std::vector<float> input_of(int rank, int64_t count) {
    std::vector<float> v(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = static_cast<float>(rank + 1 + i % 7);
    return v;
}

bool check(const float* got, int64_t count, int n) {
    for (int64_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(n * (n + 1) / 2 + n * static_cast<int>(i % 7));
        if (got[i] != want) {
            std::fprintf(stderr, "element %lld: got %g, expected %g\n", static_cast<long long>(i), got[i], want);
            return false;
        }
    }
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    const weft::examples::Args args(argc, argv, "[num_ranks >= 1] [count >= 1]");
    args.at_most(2);
    // The check's sums stay exact in f32 up to 1024 ranks; 2^30 floats are 4 GiB a buffer.
    const int num_ranks = args.positional<int>(1, "num_ranks", 1, 1024, 4);
    const int64_t count = args.positional<int64_t>(2, "count", 1, int64_t{1} << 30, 100000);
    try {
        weft::run_local(num_ranks, [&](weft::World& world) {
            cudaStream_t stream;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
            const size_t bytes = static_cast<size_t>(count) * sizeof(float);
            // The first collective call (or this one) makes the World's collective workspace, collectively.
            const weft::ops::CollectiveWorkspaceInfo& info = weft::ops::prepare_collectives(world);

            // Buffers: local device memory works; a symmetric input lets peers read it in place (no staging copy).
            // Stream-ordered allocation: cudaMalloc/cudaFree may synchronise the whole device, i.e. wait for a
            // peer's kernel that is waiting for this rank (ranks are threads sharing the device here).
            float* local_in = nullptr;
            float* local_out = nullptr;
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_in), bytes, stream));
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_out), bytes, stream));
            auto* sym_in = world.heap().alloc_array<float>(static_cast<uint64_t>(count));
            auto* sym_out = world.heap().alloc_array<float>(static_cast<uint64_t>(count));
            // Host buffers are pinned. Copies from or to pageable memory are staged by the driver, and with ranks
            // sharing a GPU they can hang: every rank's thread inside its copy, one rank's all-reduce on the device,
            // the peers' queued behind it (docs/runtime.md, "Shared GPUs and the runtime's own work").
            float* mine = nullptr;
            float* got = nullptr;
            WEFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&mine), bytes));
            WEFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&got), bytes));
            const std::vector<float> input = input_of(world.rank(), count);
            std::copy(input.begin(), input.end(), mine);
            world.barrier();

            const auto run = [&](const char* what, float* in, float* out, weft::ops::AllReduceOptions options) {
                WEFT_CUDA_CHECK(cudaMemcpyAsync(in, mine, bytes, cudaMemcpyHostToDevice, stream));
                // A separate output is poisoned (NaN): an element the run leaves unwritten fails the check.
                if (out != in) WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, bytes, stream));
                weft::ops::all_reduce(world, TensorView(in, DType::kF32, {count}),
                                      TensorView(out, DType::kF32, {count}), stream, options);
                WEFT_CUDA_CHECK(cudaMemcpyAsync(got, out, bytes, cudaMemcpyDeviceToHost, stream));
                world.sync_and_check(stream);  // turns a device timeout into a weft::Error with its diagnosis
                const bool ok = check(got, count, num_ranks);
                if (world.rank() == 0) std::printf("  %-40s %s\n", what, ok ? "ok" : "WRONG");
                WEFT_CHECK(ok, "rank " << world.rank() << ": " << what << " gave a wrong result");
            };

            if (world.rank() == 0) {
                std::printf("%d ranks, %lld floats; the automatic choice by message size:\n", num_ranks,
                            static_cast<long long>(count));
                for (uint64_t b : {8ull, 16ull << 10, 256ull << 10, 1ull << 20, 64ull << 20}) {
                    std::printf("  %10llu bytes -> %s\n", static_cast<unsigned long long>(b),
                                weft::ops::algo_name(weft::ops::select_all_reduce_algo(b, info.topology)));
                }
                std::printf("runs (results checked on every rank):\n");
            }
            run("auto, local buffers", local_in, local_out, {});
            for (AllReduceAlgo a : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
                std::string what = std::string("forced ") + weft::ops::algo_name(a) + ", symmetric buffers";
                run(what.c_str(), sym_in, sym_out, {.algo = a});
            }
            run("two_shot in place (symmetric)", sym_in, sym_in, {.algo = AllReduceAlgo::kTwoShot});
            run("ll in place (local)", local_in, local_in, {.algo = AllReduceAlgo::kLowLatency});

            // A captured all-reduce replays correctly: the kernels keep their epochs in device memory.
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            weft::ops::all_reduce(world, TensorView(local_in, DType::kF32, {count}),
                                  TensorView(local_out, DType::kF32, {count}), stream);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            // Every rank instantiates and uploads the graph before any rank replays: both may allocate device
            // memory or run work of their own, and on a GPU shared by ranks that can wait for a peer's replay
            // already spinning for this rank.
            WEFT_CUDA_CHECK(cudaGraphUpload(exec, stream));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
            world.barrier();
            for (int replay = 0; replay < 3; ++replay) {
                WEFT_CUDA_CHECK(cudaMemcpyAsync(local_in, mine, bytes, cudaMemcpyHostToDevice, stream));
                WEFT_CUDA_CHECK(cudaMemsetAsync(local_out, 0, bytes, stream));
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(got, local_out, bytes, cudaMemcpyDeviceToHost, stream));
                world.sync_and_check(stream);
                WEFT_CHECK(check(got, count, num_ranks),
                           "rank " << world.rank() << ": graph replay " << replay << " is wrong");
            }
            if (world.rank() == 0) std::printf("  %-40s ok\n", "graph, 3 replays");

            // Free only after every rank is done: a peer may still read this rank's buffers until then.
            world.barrier();
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            world.heap().free(sym_out);
            world.heap().free(sym_in);
            cudaFreeAsync(local_out, stream);
            cudaFreeAsync(local_in, stream);
            cudaStreamSynchronize(stream);
            cudaStreamDestroy(stream);
            cudaFreeHost(got);
            cudaFreeHost(mine);
        });
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
