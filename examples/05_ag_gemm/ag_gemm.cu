// SPDX-License-Identifier: MIT
// Example 05: AllGather+GEMM (a column-parallel linear layer) with weft's fused op, checked against cuBLAS
// after weft's standalone all-gather (weft::ops::all_gather, automatic algorithm) run back to back, and timed
// against it.
//
//   weft_example_05_ag_gemm [--world W] [--m M] [--n N] [--k K] [--iters I] [--baseline-coll weft|simple]
//
// Every rank holds A_r = rows [r*M/W, (r+1)*M/W) of the activations A[M, K] and the weight shard B_r [N/W, K];
// it needs C_r = A * B_r^T [M, N/W]. weft's op pulls the peers' rows with the copy engines while the GEMM
// computes the rows it already has, each tile waiting only for the rows it needs (README.md draws it).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tp_baselines.cuh"
#include "weft/ops/ag_gemm.hpp"

using namespace weft::bench_tp;

int main(int argc, char** argv) {
    ExampleArgs args;
    args.m = 8192;
    args.n = 11008;
    args.k = 4096;
    if (!parse_example_args(argc, argv, args)) return 2;
    int world = args.world;
    const int iters = args.iters;
    int64_t m = args.m, n = args.n, k = args.k;
    try {
        weft::prepare_cuda_environment();
        int gpus = 0;
        BENCH_CUDA(cudaGetDeviceCount(&gpus));
        if (world <= 0) world = std::max(2, gpus);
        m = m / world * world;
        const int64_t n_local = std::max<int64_t>(8, n / world / 8 * 8), rows = m / world;
        weft::WorldOptions wo;
        uint64_t heap = 2 * static_cast<uint64_t>(m * k * 2) + (64ull << 20);
        if (args.coll == BaselineColl::kWeft) heap += collective_workspace_heap_bytes(world);
        wo.heap_bytes = (heap + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
        Shared sh;
        sh.slot.assign(static_cast<size_t>(world), 0.0);
        double t_gemm = 0, t_coll = 0, t_base = 0, t_weft = 0, err = 0;
        std::string coll_algo;
        weft::run_local(world, [&](weft::World& w) {
            const int me = w.rank();
            const DType t = DType::kBF16;
            cudaStream_t s = nullptr;
            BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            prepare_baseline_collectives(w, args.coll);  // collective, once, before anything is timed
            {
                // weft: the op owns the gathered buffer; this rank writes its rows straight into it.
                weft::ops::AgGemm op(w, {m, n_local, k, t});
                // The baseline: its own gathered buffer on the symmetric heap, gathered in place by the same
                // baseline all-gather as weft_bench_tp's (a) (tp_baselines.cuh).
                auto* g = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * k * 2)));
                BaselineAllGather all_gather(w, args.coll, g, static_cast<uint64_t>(rows * k * 2));
                void *b = nullptr, *c_weft = nullptr, *c_base = nullptr;
                BENCH_CUDA(cudaMalloc(&b, static_cast<size_t>(n_local * k * 2)));
                BENCH_CUDA(cudaMalloc(&c_weft, static_cast<size_t>(m * n_local * 2)));
                BENCH_CUDA(cudaMalloc(&c_base, static_cast<size_t>(m * n_local * 2)));
                const weft::TensorView a_local = op.local_shard(m);
                fill_random(a_local.data, rows * k, t, 2024 + static_cast<uint64_t>(me), s);
                BENCH_CUDA(cudaMemcpyAsync(g + me * rows * k * 2, a_local.data, static_cast<size_t>(rows * k * 2),
                                           cudaMemcpyDeviceToDevice, s));
                fill_random(b, n_local * k, t, 4048 + static_cast<uint64_t>(me), s);
                w.barrier();
                Lt lt;
                auto gemm = [&] { lt.gemm(t, g, k, b, k, c_base, n_local, m, n_local, k, s); };
                const double tg = time_all(w, sh, s, 2, iters, gemm);
                const double tc = time_all(w, sh, s, 2, iters, [&] { all_gather(s); });
                const double tb = time_all(w, sh, s, 2, iters, [&] {
                    all_gather(s);
                    gemm();
                });
                const weft::TensorView bv(b, t, {n_local, k}), cv(c_weft, t, {m, n_local});
                const double tw = time_all(w, sh, s, 2, iters, [&] { op.run(a_local, bv, cv, s); });
                const double e = max_over_ranks(w, sh, rel_error(c_weft, n_local, c_base, n_local, m, n_local, t, s));
                if (me == 0) {  // every rank got the same (slowest-rank) figures
                    t_gemm = tg, t_coll = tc, t_base = tb, t_weft = tw, err = e;
                    coll_algo = all_gather.algo();
                }
                w.barrier();
                cudaFree(b);
                cudaFree(c_weft);
                cudaFree(c_base);
                all_gather.release();
                w.heap().free(g);
            }
            cudaStreamDestroy(s);
        }, wo);
        const double ideal = std::max(t_gemm, t_coll);
        std::printf("AllGather+GEMM, %d ranks on %d GPU(s)%s, bf16\n", world, gpus,
                    world > gpus ? " (ranks share a GPU: the figures show overhead, not overlap)" : "");
        std::printf("%-24s %14s %12s %9s %10s %8s\n", "shape MxNxK (layer)", "cuBLAS+AG", "weft", "speedup",
                    "overlap", "check");
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", m, n_local * world, k);
        std::printf("%-24s %11.3f ms %9.3f ms %8.2fx %9.0f%% %8s\n", shape, t_base, t_weft, t_base / t_weft,
                    100.0 * ideal / t_weft, err < 1e-2 ? "ok" : "FAILED");
        const std::string coll_desc = args.coll == BaselineColl::kWeft
                                          ? "weft::ops::all_gather (automatic algorithm: " + coll_algo + ")"
                                          : std::string("the simple all-gather (device barriers + copy-engine pulls)");
        std::printf("(baseline: %s, then cuBLAS; GEMM alone %.3f ms, all-gather alone %.3f ms; overlap = max of\n"
                    " those / weft; relative difference to the baseline %.1e)\n",
                    coll_desc.c_str(), t_gemm, t_coll, err);
        return err < 1e-2 ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
