// SPDX-License-Identifier: MIT
// Example 11: the shape of a real job. One process per GPU (weftrun, torchrun or srun start it; World::from_env reads
// any of them), the world split into tensor-parallel teams of T consecutive ranks and data-parallel groups (the ranks
// with the same place in every TP team: a strided team). Each TP team runs a tensor-parallel MLP forward, AgGemm
// (column-parallel: gather the sequence shards, multiply by this rank's W1 rows) then GemmRs (row-parallel: multiply
// by this rank's W2 columns, reduce-scatter back to sequence shards), checked against cuBLAS; then each DP group
// all-reduces its members' outputs (weft::ops::all_reduce on the strided team), checked against the sum of the
// replicas' references. All TP teams run at the same time, and so do all DP groups.
//
//   weftrun -n 8 -- weft_example_11_tp_team [--tp T] [--m M] [--hidden H] [--ffn F] [--iters I]
//   python3 -m torch.distributed.run --standalone --nproc_per_node=8 --no-python weft_example_11_tp_team
//   srun -N1 -n8 weft_example_11_tp_team
//
// Defaults: T = the largest divisor of the world's size that is at most 4, M = 4096 tokens, H = 4096, F = 11008 (one
// MLP of a 7B-class layer). With fewer GPUs than ranks, ranks share GPUs (the times then show overhead, not speed).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "tp_example.cuh"
#include "weft/common/math.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/weft.hpp"

namespace {

using weft::DType;
using weft::TensorView;
using weft_example::cublas_gemm;
using weft_example::relative_error;

struct Problem {
    int tp = 0;     // ranks per TP team
    int64_t m = 0;  // tokens of one DP replica (rows of X), a multiple of tp
    int64_t h = 0;  // hidden size
    int64_t f = 0;  // FFN size, a multiple of 8 * tp
    int iters = 10;
};

// Element (row, col) of a [rows, ld] matrix that exists only as a formula: uniform in [-1, 1) from a hash of (seed,
// row * ld + col), scaled so that the layer's outputs stay near 1 (every rank can make any slice of any matrix).
__global__ void fill_slice(__nv_bfloat16* p, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t ld,
                           uint64_t seed, float scale) {
    const int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / cols, c = i % cols;
        uint64_t x = (seed ^ static_cast<uint64_t>((row0 + r) * ld + col0 + c)) * 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
        p[i] = __float2bfloat16_rn(scale * (static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f));
    }
}

constexpr uint64_t kSeedW1 = 11, kSeedW2 = 12, kSeedX = 1000;  // X of DP replica d: kSeedX + d

void fill(void* p, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t ld, uint64_t seed, float scale,
          cudaStream_t s) {
    fill_slice<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), rows, cols, row0, col0, ld, seed, scale);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

// Device memory of one rank, freed with it.
struct DeviceBuffer {
    void* ptr = nullptr;
    explicit DeviceBuffer(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 256))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

std::vector<float> to_host(const void* p, int64_t count, cudaStream_t s) {
    std::vector<__nv_bfloat16> h(static_cast<size_t>(count));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, h.size() * 2, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<float> out(h.size());
    for (size_t i = 0; i < h.size(); ++i) out[i] = __bfloat162float(h[i]);
    return out;
}

// The largest of every member's `v` (Team::all_gather: the team's members only, while other teams do the same).
double team_max(const weft::Team& team, const std::string& key, double v) {
    std::vector<uint8_t> bytes(sizeof(double));
    std::memcpy(bytes.data(), &v, sizeof(double));
    double out = v;
    for (const std::vector<uint8_t>& b : team.all_gather(key, bytes)) {
        double x = 0;
        std::memcpy(&x, b.data(), sizeof(double));
        out = std::max(out, x);
    }
    return out;
}

// Milliseconds per call of `body` on this rank: two untimed calls, a team barrier, then CUDA events around `iters`.
double time_ms(weft::World& w, const weft::Team& team, cudaStream_t s, int iters, const std::function<void()>& body) {
    body();
    body();
    w.sync_and_check(s);
    team.barrier();
    weft::Event start(true), stop(true);
    start.record(s);
    for (int i = 0; i < iters; ++i) body();
    stop.record(s);
    w.sync_and_check(s);
    return stop.elapsed_ms(start) / iters;
}

// One row of the table: a TP team's (or DP group's) slowest member and its worst error.
struct Row {
    double ag_ms = 0, rs_ms = 0, ar_ms = 0, tp_error = 0, dp_error = 0;
};

// "0, 4, 8, ..." : `count` ranks from `first`, `stride` apart (at most four shown).
std::string rank_list(int first, int stride, int count) {
    std::string out;
    for (int i = 0; i < std::min(count, 4); ++i) out += (i == 0 ? "" : ", ") + std::to_string(first + i * stride);
    return count > 4 ? out + ", ..." : out;
}

int run(weft::World& w, const Problem& p) {
    const int world = w.num_ranks(), me = w.rank();
    const int dp = world / p.tp;
    // TP team: ranks [t * T, (t+1) * T) (consecutive ranks: on one host, they share NVLink); DP group: the ranks at
    // the same place of every TP team (strided).
    const weft::Team tp = w.team().split_color(me / p.tp, me);
    const weft::Team dp_group = w.team().split_strided(me % p.tp, p.tp, dp);
    const int t = tp.rank(), d = dp_group.rank();  // this rank's TP shard and DP replica
    const int64_t rows = p.m / p.tp, f_local = p.f / p.tp;
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(p.h));

    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t blas = nullptr;
    WEFT_CHECK(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate failed");
    WEFT_CHECK(cublasSetStream(blas, s) == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed");
    Row row;
    {
        // This rank's inputs: its sequence shard of replica d's X, W1 rows [t*F/T, (t+1)*F/T) ([F/T, H]), W2 columns
        // [t*F/T, (t+1)*F/T) ([H, F/T]).
        DeviceBuffer x(static_cast<size_t>(rows * p.h * 2)), w1(static_cast<size_t>(f_local * p.h * 2)),
            w2(static_cast<size_t>(p.h * f_local * 2)), hidden(static_cast<size_t>(p.m * f_local * 2)),
            y(static_cast<size_t>(rows * p.h * 2)), y_sum(static_cast<size_t>(rows * p.h * 2)),
            y_mine(static_cast<size_t>(rows * p.h * 2));
        fill(x.ptr, rows, p.h, t * rows, 0, p.h, kSeedX + static_cast<uint64_t>(d), 1.0f, s);
        fill(w1.ptr, f_local, p.h, t * f_local, 0, p.h, kSeedW1, w_scale, s);
        fill(w2.ptr, p.h, f_local, 0, t * f_local, p.f, kSeedW2, 1.0f / std::sqrt(static_cast<float>(p.f)), s);

        // The reference, by cuBLAS on this rank alone: the whole layer on its rows, for every replica of its DP group
        // (the DP sum needs them all): y_e = (X_e[rows] * W1^T) * W2^T; y_mine = y_d, its own replica's.
        std::vector<std::vector<float>> y_ref(static_cast<size_t>(dp));
        {
            DeviceBuffer w1_full(static_cast<size_t>(p.f * p.h * 2)), w2_full(static_cast<size_t>(p.h * p.f * 2)),
                x_e(static_cast<size_t>(rows * p.h * 2)), h_e(static_cast<size_t>(rows * p.f * 2)),
                y_e(static_cast<size_t>(rows * p.h * 2));
            fill(w1_full.ptr, p.f, p.h, 0, 0, p.h, kSeedW1, w_scale, s);
            fill(w2_full.ptr, p.h, p.f, 0, 0, p.f, kSeedW2, 1.0f / std::sqrt(static_cast<float>(p.f)), s);
            for (int e = 0; e < dp; ++e) {
                fill(x_e.ptr, rows, p.h, t * rows, 0, p.h, kSeedX + static_cast<uint64_t>(e), 1.0f, s);
                cublas_gemm(blas, x_e.ptr, w1_full.ptr, h_e.ptr, rows, p.f, p.h);
                cublas_gemm(blas, h_e.ptr, w2_full.ptr, y_e.ptr, rows, p.h, p.f);
                y_ref[static_cast<size_t>(e)] = to_host(y_e.ptr, rows * p.h, s);
                if (e == d) {
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(y_mine.ptr, y_e.ptr, static_cast<size_t>(rows * p.h * 2),
                                                    cudaMemcpyDeviceToDevice, s));
                }
            }
        }
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));

        // The ops (collective over the TP team; every TP team makes its own at the same time), and the DP group's
        // collective workspace (collective over the strided team).
        weft::ops::AgGemm up(tp, {p.m, f_local, p.h, DType::kBF16});
        weft::ops::GemmRs down(tp, {p.m, p.h, f_local, DType::kBF16});
        weft::ops::prepare_collectives(dp_group);
        const TensorView xv(x.ptr, DType::kBF16, {rows, p.h}), w1v(w1.ptr, DType::kBF16, {f_local, p.h}),
            hv(hidden.ptr, DType::kBF16, {p.m, f_local}), w2v(w2.ptr, DType::kBF16, {p.h, f_local}),
            yv(y.ptr, DType::kBF16, {rows, p.h}), ysv(y_sum.ptr, DType::kBF16, {rows * p.h});
        const auto column_parallel = [&] { up.run(xv, w1v, hv, s); };
        const auto row_parallel = [&] { down.run(hv, w2v, yv, s); };
        const auto dp_all_reduce = [&] {
            weft::ops::all_reduce(dp_group, TensorView(y.ptr, DType::kBF16, {rows * p.h}), ysv, s);
        };

        row.ag_ms = team_max(tp, "ag_ms", time_ms(w, tp, s, p.iters, column_parallel));
        row.rs_ms = team_max(tp, "rs_ms", time_ms(w, tp, s, p.iters, row_parallel));
        column_parallel();
        row_parallel();  // y: this rank's rows of replica d's layer output
        w.sync_and_check(s);
        row.tp_error = team_max(tp, "tp_error", relative_error(y.ptr, y_mine.ptr, rows * p.h, s));

        row.ar_ms = team_max(dp_group, "ar_ms", time_ms(w, dp_group, s, p.iters, dp_all_reduce));
        const std::vector<float> got = to_host(y_sum.ptr, rows * p.h, s);  // the last all-reduce's result
        double num = 0, den = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            double want = 0;
            for (int e = 0; e < dp; ++e) want += y_ref[static_cast<size_t>(e)][i];
            num += (got[i] - want) * (got[i] - want);
            den += want * want;
        }
        const double dp_error = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : 1e30;
        row.dp_error = team_max(dp_group, "dp_error", dp_error);
        w.barrier();  // every team and group is done before the ops and buffers go
    }
    cublasDestroy(blas);
    cudaStreamDestroy(s);

    // The table: world rank 0 gathers one row per TP team (from its team rank 0) and per DP group.
    std::vector<uint8_t> mine(sizeof(Row));
    std::memcpy(mine.data(), &row, sizeof(Row));
    const std::vector<std::vector<uint8_t>> rows_of = w.team().all_gather("example11_rows", mine);
    bool ok = true;
    double worst = 0;
    for (const auto& r : rows_of) {
        Row x;
        std::memcpy(&x, r.data(), sizeof(Row));
        ok = ok && x.tp_error < 2e-2 && x.dp_error < 2e-2;
        worst = std::max({worst, x.tp_error, x.dp_error});
    }
    if (me == 0) {
        std::printf(
            "TP MLP forward on %d ranks%s: %d TP teams of %d ranks, %d DP groups of %d; M %ld, H %ld, F %ld, "
            "bf16\n",
            world, w.max_ranks_per_device() > 1 ? " (ranks share GPUs: the times show overhead)" : "", dp, p.tp, p.tp,
            dp, p.m, p.h, p.f);
        std::printf("%-9s %-20s %13s %13s %8s\n", "TP team", "world ranks", "AgGemm", "GemmRs", "check");
        for (int team = 0; team < dp; ++team) {
            Row x;
            std::memcpy(&x, rows_of[static_cast<size_t>(team * p.tp)].data(), sizeof(Row));
            std::printf("%-9d %-20s %10.3f ms %10.3f ms %8s\n", team, rank_list(team * p.tp, 1, p.tp).c_str(), x.ag_ms,
                        x.rs_ms, x.tp_error < 2e-2 ? "ok" : "FAILED");
        }
        std::printf("%-9s %-20s %13s %8s\n", "DP group", "world ranks", "all_reduce", "check");
        for (int group = 0; group < p.tp; ++group) {
            Row x;
            std::memcpy(&x, rows_of[static_cast<size_t>(group)].data(), sizeof(Row));
            std::printf("%-9d %-20s %10.3f ms %8s\n", group, rank_list(group, p.tp, dp).c_str(), x.ar_ms,
                        x.dp_error < 2e-2 ? "ok" : "FAILED");
        }
        std::printf(
            "(times: the slowest member's, per call; check: relative Frobenius error against cuBLAS < 2e-2, "
            "worst %.1e)\n",
            worst);
    }
    return ok ? 0 : 1;
}

int largest_divisor_at_most(int n, int cap) {
    for (int t = std::min(n, cap); t > 1; --t) {
        if (n % t == 0) return t;
    }
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    Problem p;
    p.m = 4096;
    p.h = 4096;
    p.f = 11008;
    const weft::examples::Args args(argc, argv, "[--tp T] [--m M] [--hidden H] [--ffn F] [--iters I]   (values >= 1)");
    constexpr int64_t kMaxExtent = int64_t{1} << 20;  // keeps the byte counts (6 * M * F and the like) within int64
    args.read_flags({{"--tp", &p.tp, 1, 1024},
                     {"--m", &p.m, 1, kMaxExtent},
                     {"--hidden", &p.h, 1, kMaxExtent},
                     {"--ffn", &p.f, 1, kMaxExtent},
                     {"--iters", &p.iters, 1, 1000000}});
    try {
        weft::prepare_cuda_environment();  // before the first CUDA call
        // The symmetric heap holds the ops' buffers (the gathered X and the partials, each at most M x max(H, F/T))
        // and the DP group's collective workspace (about 100 MiB).
        weft::WorldOptions options;
        const int64_t biggest = std::max(p.m * p.h, p.m * p.f) * 2;
        options.heap_bytes = static_cast<uint64_t>(weft::round_up(3 * biggest + (256ll << 20), 2ll << 20));
        const std::unique_ptr<weft::World> w = weft::World::from_env(options);
        const int world = w->num_ranks();
        if (p.tp == 0) p.tp = largest_divisor_at_most(world, 4);
        WEFT_CHECK(p.tp <= world && world % p.tp == 0,
                   "--tp must divide the number of ranks " << world << ", got " << p.tp);
        p.m = std::max<int64_t>(p.tp, p.m / p.tp * p.tp);
        p.h = std::max<int64_t>(8, p.h / 8 * 8);
        p.f = std::max<int64_t>(8 * p.tp, p.f / (8 * p.tp) * (8 * p.tp));
        return run(*w, p);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
