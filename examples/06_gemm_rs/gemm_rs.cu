// SPDX-License-Identifier: MIT
// Example 06: GEMM+ReduceScatter (a row-parallel linear layer) with weft's fused op, checked against cuBLAS
// followed by weft's standalone reduce-scatter (weft::ops::reduce_scatter, automatic algorithm) run back to back,
// and timed against it.
//
//   weft_example_06_gemm_rs [--world W] [--m M] [--n N] [--k K] [--iters I] [--baseline-coll weft|simple]
//
// Every rank holds A_r [M, K/W] (its share of the layer's inputs) and B_r [N, K/W]; the layer's output is
// sum_r A_r * B_r^T [M, N], and rank r keeps rows [r*M/W, (r+1)*M/W) of it. weft's GEMM computes the rows
// the next rank owns first and signals each finished tile; a reduction on a few SMs sums the ranks'
// partials of this rank's rows as they complete (README.md draws it).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tp_baselines.cuh"
#include "weft/ops/gemm_rs.hpp"

using namespace weft::bench_tp;

int main(int argc, char** argv) {
    ExampleArgs args;
    args.m = 8192;
    args.n = 4096;
    args.k = 11008;
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
        n = std::max<int64_t>(8, n / 8 * 8);
        const int64_t k_local = std::max<int64_t>(8, k / world / 8 * 8), rows = m / world;
        weft::WorldOptions wo;
        uint64_t heap = 4 * static_cast<uint64_t>(m * n * 2) + (64ull << 20);
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
                weft::ops::GemmRs op(w, {m, n, k_local, t});
                // The baseline: cuBLAS into a symmetric partial, then the same baseline reduce-scatter as
                // weft_bench_tp's (a) (tp_baselines.cuh) into a symmetric output.
                auto* partial = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * n * 2)));
                void* c_base = w.heap().alloc(static_cast<uint64_t>(rows * n * 2));
                BaselineReduceScatter reduce_scatter(w, args.coll, t, partial, c_base, rows, n);
                void *a = nullptr, *b = nullptr, *c_weft = nullptr;
                BENCH_CUDA(cudaMalloc(&a, static_cast<size_t>(m * k_local * 2)));
                BENCH_CUDA(cudaMalloc(&b, static_cast<size_t>(n * k_local * 2)));
                BENCH_CUDA(cudaMalloc(&c_weft, static_cast<size_t>(rows * n * 2)));
                fill_random(a, m * k_local, t, 77 + static_cast<uint64_t>(me), s);
                fill_random(b, n * k_local, t, 99 + static_cast<uint64_t>(me), s);
                w.barrier();
                Lt lt;
                auto gemm = [&] { lt.gemm(t, a, k_local, b, k_local, partial, n, m, n, k_local, s); };
                const double tg = time_all(w, sh, s, 2, iters, gemm);
                const double tc = time_all(w, sh, s, 2, iters, [&] { reduce_scatter(s); });
                const double tb = time_all(w, sh, s, 2, iters, [&] {
                    gemm();
                    reduce_scatter(s);
                });
                const weft::TensorView av(a, t, {m, k_local}), bv(b, t, {n, k_local}), cv(c_weft, t, {rows, n});
                const double tw = time_all(w, sh, s, 2, iters, [&] { op.run(av, bv, cv, s); });
                const double e = max_over_ranks(w, sh, rel_error(c_weft, n, c_base, n, rows, n, t, s));
                if (me == 0) {
                    t_gemm = tg, t_coll = tc, t_base = tb, t_weft = tw, err = e;
                    coll_algo = reduce_scatter.algo();
                }
                w.barrier();
                cudaFree(a);
                cudaFree(b);
                cudaFree(c_weft);
                reduce_scatter.release();
                w.heap().free(c_base);
                w.heap().free(partial);
            }
            cudaStreamDestroy(s);
        }, wo);
        const double ideal = std::max(t_gemm, t_coll);
        std::printf("GEMM+ReduceScatter, %d ranks on %d GPU(s)%s, bf16\n", world, gpus,
                    world > gpus ? " (ranks share a GPU: the figures show overhead, not overlap)" : "");
        std::printf("%-24s %14s %12s %9s %10s %8s\n", "shape MxNxK (layer)", "cuBLAS+RS", "weft", "speedup",
                    "overlap", "check");
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", m, n, k_local * world);
        std::printf("%-24s %11.3f ms %9.3f ms %8.2fx %9.0f%% %8s\n", shape, t_base, t_weft, t_base / t_weft,
                    100.0 * ideal / t_weft, err < 2e-2 ? "ok" : "FAILED");
        const std::string coll_desc = args.coll == BaselineColl::kWeft
                                          ? "weft::ops::reduce_scatter (automatic algorithm: " + coll_algo + ")"
                                          : std::string("the simple reduce-scatter (device barriers + SM sum kernel)");
        std::printf("(baseline: cuBLAS, then %s; GEMM alone %.3f ms, reduce-scatter alone %.3f ms;\n"
                    " overlap = max of those / weft; relative difference to the baseline %.1e)\n",
                    coll_desc.c_str(), t_gemm, t_coll, err);
        return err < 2e-2 ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
