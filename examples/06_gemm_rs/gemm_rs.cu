// SPDX-License-Identifier: MIT
// Example 06: GEMM+ReduceScatter (a row-parallel linear layer) with weft's fused op, checked against and timed
// against the unfused way: cuBLAS, then weft's standalone reduce-scatter (weft::ops::reduce_scatter, automatic
// algorithm).
//
//   weft_example_06_gemm_rs [--world W] [--m M] [--n N] [--k K] [--iters I]
//
// Every rank holds A_r [M, K/W] (its share of the layer's inputs) and B_r [N, K/W]; the layer's output is
// sum_r A_r * B_r^T [M, N], and rank r keeps rows [r*M/W, (r+1)*M/W) of it. weft's GEMM computes the rows
// the next rank owns first and hands each finished tile to its owner, which sums the ranks' partials of its rows
// as they arrive (README.md draws it).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "args.hpp"
#include "tp_example.cuh"
#include "weft/common/math.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/env.hpp"
#include "weft/weft.hpp"

namespace {

using weft::DType;

using weft_example::cublas_gemm;
using weft_example::fill_random;
using weft_example::relative_error;
using weft_example::Slowest;
using weft_example::time_ms;

struct Problem {
    int64_t m, n, k_local;  // the layer is M x N x (K_local x W)
    int iters;
};

struct Result {
    double gemm_ms = 0, scatter_ms = 0, baseline_ms = 0, weft_ms = 0, error = 0;
    std::string scatter_algo;
};

// One rank's part (every rank runs it at once): the baseline and weft's op on the same inputs, timed and compared.
void run_rank(weft::World& w, const Problem& p, Slowest& slowest, Result* result) {
    const int me = w.rank(), world = w.num_ranks();
    const int64_t rows = p.m / world;
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t blas = nullptr;
    WEFT_CHECK(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate failed");
    WEFT_CHECK(cublasSetStream(blas, s) == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed");
    const weft::ops::CollectiveWorkspaceInfo& info = weft::ops::prepare_collectives(w);  // collective, once
    {
        weft::ops::GemmRs op(w, {p.m, p.n, p.k_local, DType::kBF16});
        // The baseline: cuBLAS into a symmetric partial [M, N] (peers read their rows of it), then the
        // reduce-scatter into a symmetric output [M/W, N].
        auto* partial = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(p.m * p.n * 2)));
        void* c_base = w.heap().alloc(static_cast<uint64_t>(rows * p.n * 2));
        void *a = nullptr, *b = nullptr, *c_weft = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&a, static_cast<size_t>(p.m * p.k_local * 2)));
        WEFT_CUDA_CHECK(cudaMalloc(&b, static_cast<size_t>(p.n * p.k_local * 2)));
        WEFT_CUDA_CHECK(cudaMalloc(&c_weft, static_cast<size_t>(rows * p.n * 2)));
        fill_random<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(a), p.m * p.k_local, 77 + me);
        fill_random<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(b), p.n * p.k_local, 99 + me);
        WEFT_CUDA_CHECK(cudaGetLastError());
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        w.barrier();

        const weft::TensorView all_rows(partial, DType::kBF16, {p.m * p.n}),
            my_rows(c_base, DType::kBF16, {rows * p.n});
        const auto gemm = [&] { cublas_gemm(blas, a, b, partial, p.m, p.n, p.k_local); };
        const auto reduce_scatter = [&] { weft::ops::reduce_scatter(w, all_rows, my_rows, s); };
        const weft::TensorView av(a, DType::kBF16, {p.m, p.k_local}), bv(b, DType::kBF16, {p.n, p.k_local});
        const weft::TensorView cv(c_weft, DType::kBF16, {rows, p.n});

        Result r;
        r.gemm_ms = time_ms(w, slowest, s, p.iters, gemm);
        r.scatter_ms = time_ms(w, slowest, s, p.iters, reduce_scatter);
        r.baseline_ms = time_ms(w, slowest, s, p.iters, [&] {
            gemm();
            reduce_scatter();
        });
        r.weft_ms = time_ms(w, slowest, s, p.iters, [&] { op.run(av, bv, cv, s); });
        r.error = slowest.max(w, relative_error(c_weft, c_base, rows * p.n, s));
        r.scatter_algo = world == 1
                             ? "copy, one rank"
                             : weft::ops::algo_name(weft::ops::resolve_reduce_scatter_algo(
                                   weft::ops::ReduceScatterAlgo::kAuto, weft::env::get("WEFT_REDUCESCATTER_ALGO"),
                                   static_cast<uint64_t>(rows * p.n * 2), info.topology));
        if (me == 0) *result = r;  // every rank has the same (slowest-rank) figures
        w.barrier();               // every rank's kernels are done before any buffer is freed
        cudaFree(a);
        cudaFree(b);
        cudaFree(c_weft);
        w.heap().free(c_base);
        w.heap().free(partial);
    }
    cublasDestroy(blas);
    cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
    int world = 0, iters = 10;
    int64_t m = 8192, n = 4096, k = 11008;
    const weft::examples::Args args(argc, argv, "[--world W] [--m M] [--n N] [--k K] [--iters I]   (values >= 1)");
    constexpr int64_t kMaxExtent = int64_t{1} << 20;  // keeps the byte counts (4 * M * N and the like) within int64
    args.read_flags({{"--world", &world, 1, 1024},
                     {"--m", &m, 1, kMaxExtent},
                     {"--n", &n, 1, kMaxExtent},
                     {"--k", &k, 1, kMaxExtent},
                     {"--iters", &iters, 1, 1000000}});
    try {
        weft::prepare_cuda_environment();  // before the first CUDA call
        int gpus = 0;
        WEFT_CUDA_CHECK(cudaGetDeviceCount(&gpus));
        if (world <= 0) world = std::max(2, gpus);
        const Problem p{std::max<int64_t>(world, m / world * world), std::max<int64_t>(8, n / 8 * 8),
                        std::max<int64_t>(8, k / world / 8 * 8), iters};
        // The symmetric heap holds weft's buffers (up to three times the partial), the baseline's partial and
        // output, and the collectives' workspace (about 100 MiB; weft::ops::prepare_collectives says what it takes).
        weft::WorldOptions options;
        options.heap_bytes = static_cast<uint64_t>(weft::round_up(4 * p.m * p.n * 2 + (256ll << 20), 2ll << 20));
        Slowest slowest;
        slowest.value.assign(static_cast<size_t>(world), 0.0);
        Result r;
        weft::run_local(
            world, [&](weft::World& w) { run_rank(w, p, slowest, &r); }, options);

        const double overlap = std::max(r.gemm_ms, r.scatter_ms) / r.weft_ms;
        const bool ok = r.error < 2e-2;
        std::printf("GEMM+ReduceScatter, %d ranks on %d GPU(s)%s, bf16\n", world, gpus,
                    world > gpus ? " (ranks share a GPU: the figures show overhead, not overlap)" : "");
        std::printf("%-24s %14s %12s %9s %10s %8s\n", "shape MxNxK (layer)", "cuBLAS+RS", "weft", "speedup", "overlap",
                    "check");
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", p.m, p.n, p.k_local * world);
        std::printf("%-24s %11.3f ms %9.3f ms %8.2fx %9.0f%% %8s\n", shape, r.baseline_ms, r.weft_ms,
                    r.baseline_ms / r.weft_ms, 100.0 * overlap, ok ? "ok" : "FAILED");
        std::printf(
            "(baseline: cuBLAS, then weft::ops::reduce_scatter (automatic algorithm: %s); GEMM alone %.3f ms,\n"
            " reduce-scatter alone %.3f ms; overlap = max of those / weft; relative difference to the baseline "
            "%.1e)\n",
            r.scatter_algo.c_str(), r.gemm_ms, r.scatter_ms, r.error);
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
