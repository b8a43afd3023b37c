// SPDX-License-Identifier: MIT
// Baselines for the tensor-parallel benchmarks and examples: cuBLASLt GEMMs, weft-free collectives on the
// symmetric heap (a device barrier, a copy-engine all-gather is plain cudaMemcpyAsync, an SM sum kernel for
// reduce-scatter / all-reduce), and timing shared by rank threads (the slowest rank counts).
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "weft/device.cuh"
#include "weft/weft.hpp"

namespace weft::bench_tp {

using weft::DType;
using weft::World;
namespace tile = weft::device::tile;

#define BENCH_CUDA(call)                                                                                     \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
    } while (0)
#define BENCH_LT(call)                                                                                     \
    do {                                                                                                   \
        cublasStatus_t s_ = (call);                                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(#call) + ": status " +        \
                                                                  std::to_string(static_cast<int>(s_))); \
    } while (0)

// ---- baseline collectives (weft-free kernels on the symmetric heap) ---------------------------------------

/// Every rank adds 1 to its word on every rank, then waits for every word to reach the call count (kept in
/// device memory, so the kernel is graph-safe). One warp.
static __global__ void bench_barrier_kernel(weft::DeviceCtx ctx, uint64_t* counters, uint64_t* epoch) {
    const uint64_t e = *epoch + 1;
    for (int pe = static_cast<int>(threadIdx.x); pe < ctx.num_ranks; pe += 32) {
        tile::notify(weft::device::Thread{}, ctx, counters + ctx.rank, pe, 1ull, weft::device::SignalOp::kAdd);
    }
    tile::wait(weft::device::Warp{}, ctx, counters, ctx.num_ranks, weft::Cmp::kGe, e);
    __syncwarp();
    if (threadIdx.x == 0) *epoch = e;
}

template <class T>
__device__ __forceinline__ float to_f(T x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
    else return __half2float(x);
}
template <class T>
__device__ __forceinline__ T from_f(float x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
    else return __float2half_rn(x);
}

/// out[r, c0 + c] = sum over ranks s (in rank order) of src_s[row0 + r, c0 + c], 8 elements per thread.
/// srcs: `count` pointers (peers' symmetric buffers mapped here, or local slots), each [rows, ld].
template <class T>
__global__ void bench_sum_kernel(weft::DeviceCtx ctx, const T* symmetric_src, const T* local_slots, int64_t slot_elems,
                                 int count, int64_t row0, int64_t rows, int64_t c0, int64_t cols, int64_t ld,
                                 T* out, int64_t ldo) {
    const int64_t vecs_per_row = cols / 8;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * vecs_per_row;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / vecs_per_row, c = c0 + (i - r * vecs_per_row) * 8;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int s = 0; s < count; ++s) {
            const T* base = symmetric_src != nullptr ? tile::symm_at(ctx, const_cast<T*>(symmetric_src), s)
                                                     : local_slots + s * slot_elems;
            const uint4 v = weft::ptx::ld(reinterpret_cast<const uint4*>(base + (row0 + r) * ld + c));  // never .nc
            const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += to_f(e[j]);
        }
        alignas(16) T res[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) res[j] = from_f<T>(acc[j]);
        *reinterpret_cast<uint4*>(out + r * ldo + c) = *reinterpret_cast<const uint4*>(res);
    }
}

// ---- cuBLASLt ---------------------------------------------------------------------------------------------

/// D[m, n] (ldd) = A[m, k] (lda) * B[n, k]^T (ldb), row-major, with the first heuristic algorithm; plans cached.
class Lt {
public:
    Lt() {
        BENCH_LT(cublasLtCreate(&h_));
        BENCH_CUDA(cudaMalloc(&ws_, kWs));
    }
    ~Lt() {
        for (auto& [key, p] : plans_) {
            cublasLtMatmulDescDestroy(p.desc);
            cublasLtMatrixLayoutDestroy(p.la);
            cublasLtMatrixLayoutDestroy(p.lb);
            cublasLtMatrixLayoutDestroy(p.ld);
        }
        cudaFree(ws_);
        cublasLtDestroy(h_);
    }
    void gemm(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, void* d, int64_t ldd, int64_t m,
              int64_t n, int64_t k, cudaStream_t s) {
        const auto key = std::make_tuple(static_cast<int>(t), m, n, k, lda, ldb, ldd);
        auto it = plans_.find(key);
        if (it == plans_.end()) it = plans_.emplace(key, make_plan(t, m, n, k, lda, ldb, ldd)).first;
        const Plan& p = it->second;
        const float alpha = 1.f, beta = 0.f;
        BENCH_LT(cublasLtMatmul(h_, p.desc, &alpha, b, p.la, a, p.lb, &beta, d, p.ld, d, p.ld, &p.algo, ws_, kWs, s));
    }

private:
    struct Plan {
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t la, lb, ld;
        cublasLtMatmulAlgo_t algo;
    };
    static constexpr size_t kWs = 32u << 20;
    Plan make_plan(DType t, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldd) {
        const cudaDataType ct = t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
        Plan p{};
        BENCH_LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        BENCH_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        BENCH_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        // Column-major view: D^T [n, m] = B [n, k] (stored as k x n, transposed) * A^T [k, m].
        BENCH_LT(cublasLtMatrixLayoutCreate(&p.la, ct, static_cast<uint64_t>(k), static_cast<uint64_t>(n), ldb));
        BENCH_LT(cublasLtMatrixLayoutCreate(&p.lb, ct, static_cast<uint64_t>(k), static_cast<uint64_t>(m), lda));
        BENCH_LT(cublasLtMatrixLayoutCreate(&p.ld, ct, static_cast<uint64_t>(n), static_cast<uint64_t>(m), ldd));
        cublasLtMatmulPreference_t pref;
        BENCH_LT(cublasLtMatmulPreferenceCreate(&pref));
        size_t ws = kWs;
        BENCH_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        BENCH_LT(cublasLtMatmulAlgoGetHeuristic(h_, p.desc, p.la, p.lb, p.ld, p.ld, pref, 1, &result, &found));
        cublasLtMatmulPreferenceDestroy(pref);
        if (found == 0) throw std::runtime_error("cuBLASLt has no algorithm for this GEMM");
        p.algo = result.algo;
        return p;
    }
    cublasLtHandle_t h_ = nullptr;
    void* ws_ = nullptr;
    std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>, Plan> plans_;
};

// ---- per-rank timing, shared by the rank threads ------------------------------------------------------------

struct Shared {
    std::mutex mutex;
    std::vector<double> slot;  // per rank
};

/// Times `body` (enqueues one iteration on `s`) on every rank at once; returns the slowest rank's mean ms.
inline double time_all(World& w, Shared& sh, cudaStream_t s, int warmup, int iters, const std::function<void()>& body) {
    for (int i = 0; i < warmup; ++i) body();
    w.sync_and_check(s);
    w.barrier();
    weft::Event start(true), stop(true);
    start.record(s);
    for (int i = 0; i < iters; ++i) body();
    stop.record(s);
    w.sync_and_check(s);
    const double ms = stop.elapsed_ms(start) / iters;
    {
        std::lock_guard<std::mutex> lock(sh.mutex);
        sh.slot[static_cast<size_t>(w.rank())] = ms;
    }
    w.barrier();
    double worst = 0;
    for (double v : sh.slot) worst = std::max(worst, v);
    w.barrier();  // nobody overwrites a slot before everyone has read it
    return worst;
}

/// Uniform values in [-1, 1) from a hash of (seed, index), written on the device (fast for GB-sized operands;
/// never zeros: a GEMM on zeros runs faster than on data).
template <class T>
__global__ void bench_fill_kernel(T* p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        uint64_t x = seed ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        x ^= x >> 33;
        const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        p[i] = from_f<T>(u);
    }
}

inline void fill_random(void* p, int64_t elems, DType t, uint64_t seed, cudaStream_t s) {
    if (t == DType::kBF16) {
        bench_fill_kernel<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), elems, seed);
    } else {
        bench_fill_kernel<<<1024, 256, 0, s>>>(static_cast<__half*>(p), elems, seed);
    }
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(s));
}

inline double rel_error(const void* x, int64_t lx, const void* y, int64_t ly, int64_t rows, int64_t cols, DType t,
                 cudaStream_t s) {
    std::vector<uint16_t> hx(static_cast<size_t>(rows * lx)), hy(static_cast<size_t>(rows * ly));
    BENCH_CUDA(cudaMemcpyAsync(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost, s));
    BENCH_CUDA(cudaMemcpyAsync(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost, s));
    BENCH_CUDA(cudaStreamSynchronize(s));
    auto f = [&](uint16_t b) {
        if (t == DType::kBF16) {
            __nv_bfloat16 v;
            std::memcpy(&v, &b, 2);
            return static_cast<double>(__bfloat162float(v));
        }
        __half v;
        std::memcpy(&v, &b, 2);
        return static_cast<double>(__half2float(v));
    };
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
            const double a = f(hx[static_cast<size_t>(r * lx + c)]), b = f(hy[static_cast<size_t>(r * ly + c)]);
            num += (a - b) * (a - b);
            den += b * b;
        }
    return std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : 1e30;
}

inline double max_over_ranks(World& w, Shared& sh, double v) {
    {
        std::lock_guard<std::mutex> lock(sh.mutex);
        sh.slot[static_cast<size_t>(w.rank())] = v;
    }
    w.barrier();
    double worst = -1;
    for (double x : sh.slot) worst = std::max(worst, x);
    w.barrier();
    return worst;
}

/// A small device barrier on the symmetric heap (counters + a local call count).
struct DeviceBarrier {
    uint64_t* words = nullptr;  // [W] counters, then the epoch
    weft::DeviceCtx ctx{};
    void make(World& w) {
        words = w.heap().alloc_signals(static_cast<uint64_t>(w.num_ranks() + 1));
        ctx = w.device_ctx();
    }
    void operator()(cudaStream_t s) const {
        bench_barrier_kernel<<<1, 32, 0, s>>>(ctx, words, words + ctx.num_ranks);
        BENCH_CUDA(cudaGetLastError());
    }
};

template <class F>
void sum_launch(DType t, F&& launch) {
    if (t == DType::kBF16) launch(static_cast<__nv_bfloat16*>(nullptr));
    else launch(static_cast<__half*>(nullptr));
}

inline constexpr int kSumBlocks = 64;
inline constexpr int kSumThreads = 256;

/// The command line both TP examples share: `[--world W] [--m M] [--n N] [--k K] [--iters I]`. Fields keep
/// the caller's defaults when absent; returns false (after printing the usage) on an unknown flag.
struct ExampleArgs {
    int world = 0;
    int iters = 10;
    int64_t m = 0, n = 0, k = 0;
};

inline bool parse_example_args(int argc, char** argv, ExampleArgs& args) {
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        const int64_t v = std::atoll(argv[i + 1]);
        if (a == "--world") args.world = static_cast<int>(v);
        else if (a == "--m") args.m = v;
        else if (a == "--n") args.n = v;
        else if (a == "--k") args.k = v;
        else if (a == "--iters") args.iters = static_cast<int>(v);
        else {
            std::fprintf(stderr, "usage: %s [--world W] [--m M] [--n N] [--k K] [--iters I]\n", argv[0]);
            return false;
        }
    }
    return true;
}

}  // namespace weft::bench_tp
