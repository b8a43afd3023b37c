// SPDX-License-Identifier: MIT
// Example 09: all_reduce, all_gather, reduce_scatter, all_to_all and the fused AllGather+GEMM and GEMM+ReduceScatter on
// a World that spans two nodes. The same calls as on one node: weft sees that the team spans nodes and runs its
// hierarchical algorithms (weft's kernels within each node, NCCL between the nodes, pipelined in chunks). Prints a
// small table: per op, the time per call and whether it was right.
//
// On one machine, as processes on two virtual nodes (peers on the other virtual node are reached through NCCL's
// network transport only):
//   WEFT_VIRTUAL_NODES=2 weftrun -n 4 -- weft_example_09_two_nodes [count=1000000]
// On a cluster, one process per GPU (docs/multinode.md):
//   srun -N 2 --ntasks-per-node=8 --gpus-per-node=8 weft_example_09_two_nodes
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

using weft::DType;
using weft::TensorView;

namespace {

// Rank r's element i: a small integer, so every sum is exact in f32.
float value(int rank, int64_t i) { return static_cast<float>((rank * 7 + i * 3) % 11 - 5); }

// The GEMMs' operands: -1, 0 or 1, so that every product sum below (at most K, and W x K summed over the ranks, in
// magnitude, K chosen to keep that within 256 for up to 32 ranks) is an integer that bf16 holds exactly.
float a_value(int rank, int64_t row, int64_t col) { return static_cast<float>((rank * 5 + row * 3 + col) % 3 - 1); }
float b_value(int rank, int64_t row, int64_t col) { return static_cast<float>((rank + row * 7 + col * 5) % 3 - 1); }

uint16_t to_bf16(float f) {  // exact for the small integers used here
    uint32_t u = 0;
    std::memcpy(&u, &f, sizeof(u));
    return static_cast<uint16_t>(u >> 16);
}

/// `f` rounded to the nearest bf16 (ties to even), as the GEMM's epilogue stores it.
float round_to_bf16(float f) {
    uint32_t u = 0;
    std::memcpy(&u, &f, sizeof(u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    float r = 0;
    std::memcpy(&r, &u, sizeof(r));
    return r;
}

float from_bf16(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f = 0;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

struct Result {
    const char* op;
    double us = 0;
    bool correct = false;
};

}  // namespace

int main(int argc, char** argv) {
    const weft::examples::Args args(argc, argv, "[count >= 1]");
    args.at_most(1);
    const int64_t count = args.positional<int64_t>(1, "count", 1, int64_t{1} << 30, 1000000);
    try {
        std::unique_ptr<weft::World> world = weft::World::from_env();
        weft::World& w = *world;
        const int n = w.num_ranks();
        if (w.num_nodes() < 2 && w.rank() == 0) {
            std::printf("note: this world is on one node; set WEFT_VIRTUAL_NODES=2 to split it in two\n");
        }
        if (w.num_nodes() > 1) {
            const std::string why = weft::net::nccl_unavailable_reason();
            if (!why.empty()) throw weft::Error("the world spans nodes and NCCL is unavailable: " + why);
        }
        cudaStream_t stream;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const auto total = static_cast<size_t>(count) * static_cast<size_t>(n);
        float *in = nullptr, *out = nullptr, *host = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&in), total * sizeof(float)));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out), total * sizeof(float)));
        WEFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), total * sizeof(float)));

        const auto upload = [&](int64_t elems, int64_t index_offset) {
            for (int64_t i = 0; i < elems; ++i) host[i] = value(w.rank(), index_offset + i);
            WEFT_CUDA_CHECK(
                cudaMemcpyAsync(in, host, static_cast<size_t>(elems) * sizeof(float), cudaMemcpyHostToDevice, stream));
        };
        const auto download = [&](int64_t elems) {
            WEFT_CUDA_CHECK(
                cudaMemcpyAsync(host, out, static_cast<size_t>(elems) * sizeof(float), cudaMemcpyDeviceToHost, stream));
            w.sync_and_check(stream);
        };
        // Times 5 calls after one that also makes the network backend (collectively, on first use).
        const auto time_us = [&](const std::function<void()>& call) {
            call();
            w.sync_and_check(stream);
            w.barrier();
            const auto start = std::chrono::steady_clock::now();
            for (int k = 0; k < 5; ++k) call();
            w.sync_and_check(stream);
            return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 5;
        };
        std::vector<Result> results;

        // all_reduce: count elements per rank.
        upload(count, 0);
        Result ar{"all_reduce"};
        ar.us = time_us([&] {
            weft::ops::all_reduce(w, TensorView(in, DType::kF32, {count}), TensorView(out, DType::kF32, {count}),
                                  stream);
        });
        download(count);
        ar.correct = true;
        for (int64_t i = 0; i < count && ar.correct; ++i) {
            float want = 0;
            for (int r = 0; r < n; ++r) want += value(r, i);
            ar.correct = host[i] == want;
        }
        results.push_back(ar);

        // all_gather: count elements from each rank.
        upload(count, 0);
        Result ag{"all_gather"};
        ag.us = time_us([&] {
            weft::ops::all_gather(w, TensorView(in, DType::kF32, {count}),
                                  TensorView(out, DType::kF32, {static_cast<int64_t>(total)}), stream);
        });
        download(static_cast<int64_t>(total));
        ag.correct = true;
        for (size_t k = 0; k < total && ag.correct; ++k) {
            ag.correct =
                host[k] == value(static_cast<int>(k / static_cast<size_t>(count)), static_cast<int64_t>(k) % count);
        }
        results.push_back(ag);

        // reduce_scatter: n x count elements in, count out.
        upload(static_cast<int64_t>(total), 0);
        Result rs{"reduce_scatter"};
        rs.us = time_us([&] {
            weft::ops::reduce_scatter(w, TensorView(in, DType::kF32, {static_cast<int64_t>(total)}),
                                      TensorView(out, DType::kF32, {count}), stream);
        });
        download(count);
        rs.correct = true;
        for (int64_t i = 0; i < count && rs.correct; ++i) {
            float want = 0;
            for (int r = 0; r < n; ++r) want += value(r, w.rank() * count + i);
            rs.correct = host[i] == want;
        }
        results.push_back(rs);

        // all_to_all: count elements per peer; chunk q of rank r goes to rank q.
        upload(static_cast<int64_t>(total), 0);
        Result a2a{"all_to_all"};
        a2a.us = time_us([&] {
            weft::ops::all_to_all(w, TensorView(in, DType::kF32, {static_cast<int64_t>(total)}),
                                  TensorView(out, DType::kF32, {static_cast<int64_t>(total)}), stream);
        });
        download(static_cast<int64_t>(total));
        a2a.correct = true;
        for (size_t k = 0; k < total && a2a.correct; ++k) {
            const int from = static_cast<int>(k / static_cast<size_t>(count));
            a2a.correct = host[k] == value(from, w.rank() * count + static_cast<int64_t>(k) % count);
        }
        results.push_back(a2a);

        // The fused ops, bf16: AllGather+GEMM (C [M, N] = AllGather(A) B^T, A sharded by rows) and GEMM+ReduceScatter
        // (C [M/W, N] = the rank's rows of sum_r A_r B_r^T, K sharded).
        // K: 32, less beyond 8 ranks (a multiple of 8, at least 8), so that GEMM+RS's sums (up to W x K) stay exact.
        const int64_t gk = std::clamp<int64_t>(256 / n / 8 * 8, 8, 32);
        const int64_t rows = 64, gn = 128, gm = rows * n;
        std::vector<uint16_t> a_host(static_cast<size_t>(gm * gk)), b_host(static_cast<size_t>(gn * gk)),
            c_host(static_cast<size_t>(gm * gn));
        uint16_t *a_dev = nullptr, *b_dev = nullptr, *c_dev = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a_dev), a_host.size() * 2));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b_dev), b_host.size() * 2));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&c_dev), c_host.size() * 2));
        const auto put = [&](uint16_t* dev, const std::vector<uint16_t>& h, int64_t elems) {
            WEFT_CUDA_CHECK(cudaMemcpy(dev, h.data(), static_cast<size_t>(elems) * 2, cudaMemcpyHostToDevice));
        };
        const auto get = [&](int64_t elems) {
            w.sync_and_check(stream);
            WEFT_CUDA_CHECK(cudaMemcpy(c_host.data(), c_dev, static_cast<size_t>(elems) * 2, cudaMemcpyDeviceToHost));
        };
        for (int64_t i = 0; i < gn; ++i) {
            for (int64_t j = 0; j < gk; ++j) b_host[static_cast<size_t>(i * gk + j)] = to_bf16(b_value(0, i, j));
        }
        put(b_dev, b_host, gn * gk);
        {
            for (int64_t i = 0; i < rows; ++i) {
                for (int64_t j = 0; j < gk; ++j) {
                    a_host[static_cast<size_t>(i * gk + j)] = to_bf16(a_value(w.rank(), i, j));
                }
            }
            put(a_dev, a_host, rows * gk);
            WEFT_CUDA_CHECK(cudaMemset(c_dev, 0xFF, static_cast<size_t>(gm * gn) * 2));  // poisoned
            weft::ops::AgGemm op(w, {.max_m = gm, .n = gn, .k = gk, .dtype = DType::kBF16});
            Result r{"ag_gemm"};
            r.us = time_us([&] {
                op.run(TensorView(a_dev, DType::kBF16, {rows, gk}), TensorView(b_dev, DType::kBF16, {gn, gk}),
                       TensorView(c_dev, DType::kBF16, {gm, gn}), stream);
            });
            get(gm * gn);
            r.correct = true;
            for (int64_t i = 0; i < gm && r.correct; ++i) {
                for (int64_t j = 0; j < gn && r.correct; ++j) {
                    float want = 0;
                    for (int64_t t = 0; t < gk; ++t) {
                        want += a_value(static_cast<int>(i / rows), i % rows, t) * b_value(0, j, t);
                    }
                    // Beyond 32 ranks the sum may exceed what bf16 holds exactly: compare with it rounded to bf16.
                    r.correct = from_bf16(c_host[static_cast<size_t>(i * gn + j)]) == round_to_bf16(want);
                }
            }
            results.push_back(r);
        }
        {
            for (int64_t i = 0; i < gm; ++i) {
                for (int64_t j = 0; j < gk; ++j) {
                    a_host[static_cast<size_t>(i * gk + j)] = to_bf16(a_value(w.rank(), i, j));
                }
            }
            put(a_dev, a_host, gm * gk);
            for (int64_t i = 0; i < gn; ++i) {
                for (int64_t j = 0; j < gk; ++j) b_host[static_cast<size_t>(i * gk + j)] = to_bf16(b_value(w.rank(), i, j));
            }
            put(b_dev, b_host, gn * gk);
            WEFT_CUDA_CHECK(cudaMemset(c_dev, 0xFF, static_cast<size_t>(rows * gn) * 2));  // poisoned
            weft::ops::GemmRs op(w, {.max_m = gm, .n = gn, .k = gk, .dtype = DType::kBF16});
            Result r{"gemm_rs"};
            r.us = time_us([&] {
                op.run(TensorView(a_dev, DType::kBF16, {gm, gk}), TensorView(b_dev, DType::kBF16, {gn, gk}),
                       TensorView(c_dev, DType::kBF16, {rows, gn}), stream);
            });
            get(rows * gn);
            r.correct = true;
            for (int64_t i = 0; i < rows && r.correct; ++i) {
                const int64_t row = w.rank() * rows + i;
                for (int64_t j = 0; j < gn && r.correct; ++j) {
                    float want = 0;
                    for (int q = 0; q < n; ++q) {
                        for (int64_t t = 0; t < gk; ++t) want += a_value(q, row, t) * b_value(q, j, t);
                    }
                    // Beyond 32 ranks the sum may exceed what bf16 holds exactly: compare with it rounded to bf16.
                    r.correct = from_bf16(c_host[static_cast<size_t>(i * gn + j)]) == round_to_bf16(want);
                }
            }
            results.push_back(r);
        }
        cudaFree(c_dev);
        cudaFree(b_dev);
        cudaFree(a_dev);

        // Every rank's verdict, then rank 0 prints.
        std::vector<uint8_t> mine;
        for (const Result& r : results) mine.push_back(r.correct ? 1 : 0);
        const auto verdicts = w.team().all_gather("example09", mine);
        bool all_correct = true;
        if (w.rank() == 0) {
            std::printf("%d ranks on %d node(s), %d per node; %lld f32 elements per rank\n", n, w.num_nodes(),
                        n / w.num_nodes(), static_cast<long long>(count));
            std::printf("%-16s %14s %10s\n", "op", "us per call", "correct");
        }
        for (size_t k = 0; k < results.size(); ++k) {
            bool ok = true;
            for (const auto& v : verdicts) ok = ok && v.size() == results.size() && v[k] == 1;
            all_correct = all_correct && ok;
            if (w.rank() == 0) std::printf("%-16s %14.1f %10s\n", results[k].op, results[k].us, ok ? "yes" : "NO");
        }
        cudaFreeHost(host);
        cudaFree(out);
        cudaFree(in);
        cudaStreamDestroy(stream);
        return all_correct ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weft_example_09_two_nodes: %s\n", e.what());
        return 1;
    }
}
