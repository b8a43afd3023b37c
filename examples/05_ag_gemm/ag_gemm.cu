// SPDX-License-Identifier: MIT
// Example 05: AllGather+GEMM (a column-parallel linear layer) with weft's fused op, checked against and timed
// against the unfused way: weft's standalone all-gather (weft::ops::all_gather, automatic algorithm), then cuBLAS.
//
//   weft_example_05_ag_gemm [--world W] [--m M] [--n N] [--k K] [--iters I]
//
// Every rank holds A_r = rows [r*M/W, (r+1)*M/W) of the activations A[M, K] and the weight shard B_r [N/W, K];
// it needs C_r = A * B_r^T [M, N/W]. weft's op pulls the peers' rows with the copy engines while the GEMM
// computes the rows it already has, each tile waiting only for the rows it needs (README.md draws it).
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
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/collectives.hpp"
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
    int64_t m, n_local, k;  // the layer is M x (N_local x W) x K
    int iters;
};

struct Result {
    double gemm_ms = 0, gather_ms = 0, baseline_ms = 0, weft_ms = 0, error = 0;
    std::string gather_algo;
};

// One rank's part (every rank runs it at once): the baseline and weft's op on the same inputs, timed and compared.
void run_rank(weft::World& w, const Problem& p, Slowest& slowest, Result* result) {
    const int me = w.rank(), world = w.num_ranks();
    const int64_t rows = p.m / world, slot_bytes = rows * p.k * 2;
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t blas = nullptr;
    WEFT_CHECK(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate failed");
    WEFT_CHECK(cublasSetStream(blas, s) == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed");
    const weft::ops::CollectiveWorkspaceInfo& info = weft::ops::prepare_collectives(w);  // collective, once
    {
        // weft: the op owns the gathered buffer; this rank writes its rows straight into its slot.
        weft::ops::AgGemm op(w, {p.m, p.n_local, p.k, DType::kBF16});
        const weft::TensorView a_local = op.local_shard(p.m);
        // The baseline: its own gathered buffer on the symmetric heap, all-gathered in place.
        auto* gathered = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(world * slot_bytes)));
        void *b = nullptr, *c_weft = nullptr, *c_base = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&b, static_cast<size_t>(p.n_local * p.k * 2)));
        WEFT_CUDA_CHECK(cudaMalloc(&c_weft, static_cast<size_t>(p.m * p.n_local * 2)));
        WEFT_CUDA_CHECK(cudaMalloc(&c_base, static_cast<size_t>(p.m * p.n_local * 2)));
        fill_random<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(a_local.data), rows * p.k, 2024 + me);
        fill_random<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(b), p.n_local * p.k, 4048 + me);
        WEFT_CUDA_CHECK(cudaGetLastError());
        WEFT_CUDA_CHECK(cudaMemcpyAsync(gathered + me * slot_bytes, a_local.data, static_cast<size_t>(slot_bytes),
                                        cudaMemcpyDeviceToDevice, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        w.barrier();  // every rank's shard is in place before anyone gathers

        // In place: this rank's slot is the input, the whole buffer the output (as bytes).
        const weft::TensorView my_slot(gathered + me * slot_bytes, DType::kU8, {slot_bytes});
        const weft::TensorView all_slots(gathered, DType::kU8, {world * slot_bytes});
        const auto all_gather = [&] { weft::ops::all_gather(w, my_slot, all_slots, s); };
        const auto gemm = [&] { cublas_gemm(blas, gathered, b, c_base, p.m, p.n_local, p.k); };
        const weft::TensorView bv(b, DType::kBF16, {p.n_local, p.k}), cv(c_weft, DType::kBF16, {p.m, p.n_local});

        Result r;
        all_gather();  // the GEMM alone reads gathered rows, not the heap's zeros (a GEMM on zeros runs faster)
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        r.gemm_ms = time_ms(w, slowest, s, p.iters, gemm);
        r.gather_ms = time_ms(w, slowest, s, p.iters, all_gather);
        r.baseline_ms = time_ms(w, slowest, s, p.iters, [&] {
            all_gather();
            gemm();
        });
        r.weft_ms = time_ms(w, slowest, s, p.iters, [&] { op.run(a_local, bv, cv, s); });
        r.error = slowest.max(w, relative_error(c_weft, c_base, p.m * p.n_local, s));
        r.gather_algo = world == 1 ? "none, one rank"
                                   : weft::ops::algo_name(weft::ops::resolve_all_gather_algo(
                                         weft::ops::AllGatherAlgo::kAuto, weft::env::get("WEFT_ALLGATHER_ALGO"),
                                         static_cast<uint64_t>(slot_bytes), info.topology, /*output_symmetric=*/true));
        if (me == 0) *result = r;  // every rank has the same (slowest-rank) figures
        w.barrier();               // every rank's kernels are done before any buffer is freed
        cudaFree(b);
        cudaFree(c_weft);
        cudaFree(c_base);
        w.heap().free(gathered);
    }
    cublasDestroy(blas);
    cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
    int world = 0, iters = 10;
    int64_t m = 8192, n = 11008, k = 4096;
    const weft::examples::Args args(argc, argv, "[--world W] [--m M] [--n N] [--k K] [--iters I]   (values >= 1)");
    constexpr int64_t kMaxExtent = int64_t{1} << 20;  // keeps the byte counts (2 * M * K * 2 and the like) within int64
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
        const Problem p{std::max<int64_t>(world, m / world * world), std::max<int64_t>(8, n / world / 8 * 8), k, iters};
        // The symmetric heap holds weft's gathered A, the baseline's, and the collectives' workspace (about 100 MiB;
        // weft::ops::prepare_collectives says what it takes).
        weft::WorldOptions options;
        options.heap_bytes = static_cast<uint64_t>(weft::round_up(2 * p.m * p.k * 2 + (256ll << 20), 2ll << 20));
        Slowest slowest;
        slowest.value.assign(static_cast<size_t>(world), 0.0);
        Result r;
        weft::run_local(
            world, [&](weft::World& w) { run_rank(w, p, slowest, &r); }, options);

        const double overlap = std::max(r.gemm_ms, r.gather_ms) / r.weft_ms;
        const bool ok = r.error < 1e-2;
        std::printf("AllGather+GEMM, %d ranks on %d GPU(s)%s, bf16\n", world, gpus,
                    world > gpus ? " (ranks share a GPU: the figures show overhead, not overlap)" : "");
        std::printf("%-24s %14s %12s %9s %10s %8s\n", "shape MxNxK (layer)", "cuBLAS+AG", "weft", "speedup", "overlap",
                    "check");
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", p.m, p.n_local * world, p.k);
        std::printf("%-24s %11.3f ms %9.3f ms %8.2fx %9.0f%% %8s\n", shape, r.baseline_ms, r.weft_ms,
                    r.baseline_ms / r.weft_ms, 100.0 * overlap, ok ? "ok" : "FAILED");
        std::printf(
            "(baseline: weft::ops::all_gather (automatic algorithm: %s), then cuBLAS; GEMM alone %.3f ms,\n"
            " all-gather alone %.3f ms; overlap = max of those / weft; relative difference to the baseline "
            "%.1e)\n",
            r.gather_algo.c_str(), r.gemm_ms, r.gather_ms, r.error);
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
