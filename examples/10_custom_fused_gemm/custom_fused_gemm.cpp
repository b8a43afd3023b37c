// SPDX-License-Identifier: MIT
// Example 10: a fused GEMM of your own (weft::ops::FusedGemm). The ranks form a chain of GEMMs, X_{r+1} = X_r * W_r^T:
// rank r's GEMM stores each finished tile straight into rank r+1's X and signals it there (device/chain_gemm.cuh's
// epilogue hook); rank r+1's GEMM loads a row of tiles as soon as it is signalled (its scheduler). All the ranks'
// GEMMs run at once, overlapped tile by tile. Each rank checks its GEMM against a CPU reference.
//
//   weft_example_10_custom_fused_gemm [world = max(2, GPUs)] [m = 1024] [k = 512] [calls = 3]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "args.hpp"
#include "chain_params.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/weft.hpp"

using weft::DType;
using weft::TensorView;
using bf16 = __nv_bfloat16;

int main(int argc, char** argv) try {
    const weft::examples::Args args(
        argc, argv, "[world >= 1, 0: max(2, GPUs)] [m >= 1] [k: a positive multiple of 8] [calls >= 1]");
    args.at_most(4);
    // m and k up to 2^20 fit the tile grid's int32 and keep m * k * 2 bytes within int64.
    int world = args.positional<int>(1, "world", 0, 1024, 0), gpus = 0;
    const int64_t m = args.positional<int64_t>(2, "m", 1, int64_t{1} << 20, 1024);
    const int64_t k = args.positional<int64_t>(3, "k", 8, int64_t{1} << 20, 512);
    const int calls = args.positional<int>(4, "calls", 1, 1000000, 3);
    if (k % 8 != 0) args.fail("argument 3 (k) must be a multiple of 8, got " + std::to_string(k));
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&gpus));
    if (world <= 0) world = std::max(2, gpus);
    // The JIT's extra include root: the source folder in a build tree (a kernel edit needs no rebuild), else the copy
    // CMake puts next to the binary.
    std::filesystem::path device_dir = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "device";
#ifdef WEFT_EXAMPLE_DEVICE_DIR
    std::error_code unreadable;  // a source folder this user may not read: the copy, not an exception
    if (std::filesystem::is_directory(WEFT_EXAMPLE_DEVICE_DIR, unreadable)) device_dir = WEFT_EXAMPLE_DEVICE_DIR;
#endif
    std::vector<long long> wrong(static_cast<size_t>(world), 0);

    weft::run_local(world, [&](weft::World& w) {
        const int r = w.rank(), nr = w.num_ranks();
        // Every rank must pick the same tiles (rank r + 1 counts rank r's): plan with the budget all ranks share.
        const weft::GemmConfig cfg = weft::ops::fused_gemm_config({.m = m, .n = k, .k = k}, w.shared_sm_budget());
        const weft::ops::FusedGemm gemm(w, {.header = "chain_gemm.cuh", .scheduler = "example::WaitForRows",
                                            .hook = "example::NotifyNextRank", .include_root = device_dir}, cfg);
        const weft::GemmTileGrid tiles(cfg, static_cast<int32_t>(m), static_cast<int32_t>(k));
        // Symmetric: X (this rank's input, written by the previous rank) and one signal per row of tiles.
        auto* x = static_cast<bf16*>(w.heap().alloc(static_cast<uint64_t>(m * k * 2)));
        uint64_t* rows_ready = w.heap().alloc_signals(static_cast<uint64_t>(tiles.num_m_tiles));
        std::vector<bf16> h_x(static_cast<size_t>(m * k)), h_w(static_cast<size_t>(k * k));
        std::mt19937 rng(2024u + static_cast<unsigned>(r));
        std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
        for (bf16& v : h_x) v = __float2bfloat16(uni(rng));
        for (bf16& v : h_w) v = __float2bfloat16(uni(rng) * std::sqrt(3.0f / static_cast<float>(k)));  // |X| stays ~1
        bf16 *wt = nullptr, *y = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&wt, h_w.size() * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&y, h_x.size() * 2));
        WEFT_CUDA_CHECK(cudaMemcpy(wt, h_w.data(), h_w.size() * 2, cudaMemcpyHostToDevice));
        // Rank r's D is rank r+1's X (its symmetric buffer, mapped here); the last rank's is its own y.
        bf16* d = r + 1 < nr ? w.heap().symm_at(x, r + 1) : y;
        WEFT_CHECK(d != nullptr, "rank " << r + 1 << "'s heap is not load/store reachable from rank " << r);
        const weft::ops::FusedGemmCall call = gemm.prepare(TensorView(x, DType::kBF16, {m, k}),
                                                           TensorView(wt, DType::kBF16, {k, k}),
                                                           TensorView(d, DType::kBF16, {m, k}));
        cudaStream_t s = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        for (int c = 1; c <= calls; ++c) {
            // Rank 0's X is the chain's input; the others' is poisoned (bf16 NaN): a row read too early shows.
            if (r == 0) WEFT_CUDA_CHECK(cudaMemcpyAsync(x, h_x.data(), h_x.size() * 2, cudaMemcpyHostToDevice, s));
            if (r > 0) WEFT_CUDA_CHECK(cudaMemsetAsync(x, 0xff, h_x.size() * 2, s));
            w.sync_and_check(s);
            w.barrier();  // every X in place and every rank's kernel loaded before anyone stores or waits
            // The signals only grow: call c waits for c rows' worth of tiles (a host value: README, "Graphs").
            const uint64_t expected = static_cast<uint64_t>(c) * static_cast<uint64_t>(tiles.num_n_tiles);
            gemm.launch(call, example::ChainWait{w.device_ctx(), rows_ready, expected, r > 0},
                        example::ChainNotify{w.device_ctx(), rows_ready, r + 1 < nr ? r + 1 : -1}, s);
            w.sync_and_check(s);
        }
        w.barrier();  // every rank's last call is over: X and D hold their final values
        // This rank's GEMM on what arrived: X as the previous rank left it, D where this rank stored it.
        std::vector<bf16> got_x(h_x.size()), got_d(h_x.size());
        WEFT_CUDA_CHECK(cudaMemcpy(got_x.data(), x, got_x.size() * 2, cudaMemcpyDefault));
        WEFT_CUDA_CHECK(cudaMemcpy(got_d.data(), d, got_d.size() * 2, cudaMemcpyDefault));
        for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < k; ++j) {
                float ref = 0;
                for (int64_t l = 0; l < k; ++l) {
                    ref += __bfloat162float(got_x[static_cast<size_t>(i * k + l)]) *
                           __bfloat162float(h_w[static_cast<size_t>(j * k + l)]);
                }
                const float got = __bfloat162float(got_d[static_cast<size_t>(i * k + j)]);
                if (!(std::fabs(got - ref) <= 2e-2f * (std::fabs(ref) + 0.1f))) ++wrong[static_cast<size_t>(r)];
            }
        }
        w.barrier();  // no peer reads this rank's buffers any more
        WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        WEFT_CUDA_CHECK(cudaFree(wt));
        WEFT_CUDA_CHECK(cudaFree(y));
        w.heap().free(rows_ready);
        w.heap().free(x);
    });

    long long total = 0;
    for (int r = 0; r < world; ++r) {
        const long long n = wrong[static_cast<size_t>(r)];
        if (n != 0) std::printf("rank %d: %lld wrong elements\n", r, n);
        total += n;
    }
    std::printf("chain of %d fused GEMMs (%lldx%lldx%lld each, bf16) on %d GPU(s), %d calls: %s\n", world,
                static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(k), gpus, calls,
                total == 0 ? "matches the CPU reference" : "MISMATCH");
    return total == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
}
