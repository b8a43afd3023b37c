// SPDX-License-Identifier: MIT
// Baselines for the tensor-parallel benchmark: the baseline collectives (weft's standalone ops with their automatic
// algorithm choice by default, or simple weft-free kernels on the symmetric heap for comparison), on top of
// bench/common's cuBLASLt GEMMs, random inputs and timing shared by rank threads (the slowest rank counts).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "common/cublaslt.hpp"
#include "common/data.hpp"
#include "common/ranks.hpp"
#include "common/timing.hpp"
#include "weft/device.cuh"
#include "weft/net/host_backend.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::bench_tp {

using weft::DType;
using weft::World;
namespace tile = weft::device::tile;

// ---- simple baseline collectives (weft-free kernels on the symmetric heap: --baseline-coll simple) --------------

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
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(x);
    else
        return __half2float(x);
}
template <class T>
__device__ __forceinline__ T from_f(float x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16_rn(x);
    else
        return __float2half_rn(x);
}

/// out[r, c0 + c] = sum over ranks s (in rank order) of src_s[row0 + r, c0 + c], 8 elements per thread.
/// srcs: `count` pointers (peers' symmetric buffers mapped here, or local slots), each [rows, ld].
template <class T>
__global__ void bench_sum_kernel(weft::DeviceCtx ctx, const T* symmetric_src, const T* local_slots, int64_t slot_elems,
                                 int count, int64_t row0, int64_t rows, int64_t c0, int64_t cols, int64_t ld, T* out,
                                 int64_t ldo) {
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

// ---- cuBLASLt, inputs, timing (bench/common) -------------------------------------------------------------------

/// D[m, n] (ldd) = A[m, k] (lda) * B[n, k]^T (ldb), row-major, on the fastest of cuBLASLt's heuristic algorithms
/// (timed on a shape's first call).
using Lt = weft::bench::CublasLt;
/// The slowest rank's figures: one per World, shared by its rank threads.
using Shared = weft::bench::SlowestRank;
using weft::bench::fill_random;

/// Times `body` (enqueues one iteration on `s`) on every rank at once; returns the slowest rank's mean ms.
inline double time_all(World& w, Shared& sh, cudaStream_t s, int warmup, int iters, const std::function<void()>& body) {
    return weft::bench::time_batch_on_ranks_ms(w, sh, s, warmup, iters, [&](int) { body(); });
}

/// Times `a` and `b` alternately (a, b, a, b, ...), each call between its own events, so that both see the same
/// clocks: a run of long GEMMs heats the GPU and lowers the clocks of whatever is timed last (seen as +-10%
/// between two timings of one kernel). Returns each one's mean ms, the slowest rank's.
inline std::pair<double, double> time_pair(World& w, Shared& sh, cudaStream_t s, int warmup, int iters,
                                           const std::function<void()>& a, const std::function<void()>& b) {
    const auto ms = weft::bench::time_rounds_on_ranks_mean_ms(
        w, sh, s, warmup, iters, [&](int) { a(); }, [&](int) { b(); });
    return {ms[0], ms[1]};
}

inline double max_over_ranks(World& w, Shared& sh, double v) { return sh.max(w, v); }

/// ||x - y||_F / ||y||_F of two device matrices (bench/common's relative_error).
inline double rel_error(const void* x, int64_t lx, const void* y, int64_t ly, int64_t rows, int64_t cols, DType t,
                        cudaStream_t s) {
    return weft::bench::relative_error(x, lx, y, ly, rows, cols, t, s);
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
    if (t == DType::kBF16)
        launch(static_cast<__nv_bfloat16*>(nullptr));
    else
        launch(static_cast<__half*>(nullptr));
}

inline constexpr int kSumBlocks = 64;
inline constexpr int kSumThreads = 256;

// ---- the baseline collectives: weft's standalone ops (default) or the simple kernels above ----------------

/// Which collective the baselines run: weft's standalone ops (weft::ops::all_gather / reduce_scatter /
/// all_reduce, automatic algorithm choice; WEFT_*_ALGO overrides it as for any caller) or the simple weft-free
/// kernels of this file (device barrier + copy-engine pulls or an SM sum kernel), kept for comparison; they load and
/// store every peer's symmetric buffers, so they need a World on one node.
enum class BaselineColl { kWeft, kSimple };

inline const char* baseline_coll_name(BaselineColl c) { return c == BaselineColl::kWeft ? "weft" : "simple"; }

/// Symmetric-heap bytes weft::ops::prepare_collectives takes for `num_ranks` ranks, with room to spare: three
/// staging regions (WEFT_COLLECTIVE_STAGING_BYTES, default 32 MiB each), the LL receive buffers (2 parities x
/// num_ranks senders x 512 KiB) and a few KiB of signal words. Add it to WorldOptions::heap_bytes.
inline uint64_t collective_workspace_heap_bytes(int num_ranks) {
    uint64_t region = weft::env::get_bytes("WEFT_COLLECTIVE_STAGING_BYTES").value_or(32ull << 20);
    region = std::max<uint64_t>((region + 255) / 256 * 256, 64ull << 10);
    return 3 * region + static_cast<uint64_t>(num_ranks) * (1ull << 20) + (4ull << 20);
}

/// Collective, once per World, before anything is timed: with the weft baselines, creates the collective workspace
/// (heap buffers, the agreed SM budget, every collective kernel compiled and loaded; it ends with a host barrier) of
/// the team the baseline collectives run their kernels on, so no timed call pays for it: the World's team on one
/// node. Across nodes weft's hierarchical collectives run weft's kernels over the node team of the World team's
/// network backend (NCCL across nodes): that backend is made here (its column communicators: collective) and its node
/// team's workspace (none for a node of one rank). Checks that the heap estimate above covered it. Simple: nothing.
inline void prepare_baseline_collectives(World& w, BaselineColl c) {
    if (c != BaselineColl::kWeft) return;
    const bool spans = w.num_nodes() > 1;
    const weft::Team& team = spans ? weft::net::HostBackend::get(w.team()).node_team() : w.team();
    if (spans && team.num_ranks() == 1) return;
    const weft::ops::CollectiveWorkspaceInfo& info = weft::ops::prepare_collectives(team);
    if (info.heap_bytes > collective_workspace_heap_bytes(team.num_ranks())) {
        throw std::runtime_error("the collective workspace took " + std::to_string(info.heap_bytes) +
                                 " heap bytes, more than collective_workspace_heap_bytes() reserves (" +
                                 std::to_string(collective_workspace_heap_bytes(team.num_ranks())) + ")");
    }
}

/// (a)'s all-gather, in place on `gathered`: a symmetric buffer of num_ranks slots of `slot_bytes` (the same
/// allocation on every rank) whose slot `rank` holds this rank's shard; after a call (in stream order) every slot
/// holds its rank's shard, and the slots may be read until the next call.
///  weft:   ops::all_gather(input = own slot, output = gathered), automatic algorithm (symmetric output: LL,
///          sm_push or ce_push by size). Its entry barrier orders every rank's previous reads of `gathered`
///          before any peer writes into it. Across nodes the op is weft's hierarchical all_gather
///          (docs/multinode.md: NCCL over the column, weft's all_gather over the node, into the slots on this
///          rank's stream), which writes no peer's memory and rewrites a chunk of this rank's own slot only after
///          the network has sent it: in place stays correct.
///  simple: device barrier (every shard in place), copy-engine pulls of every peer's slot, device barrier
///          (every rank has read every shard).
/// Construction and release() are collective (heap allocations); call prepare_baseline_collectives first.
class BaselineAllGather {
public:
    BaselineAllGather(World& w, BaselineColl kind, void* gathered, uint64_t slot_bytes)
        : w_(&w), kind_(kind), gathered_(static_cast<uint8_t*>(gathered)), slot_bytes_(slot_bytes) {
        const int nr = w.num_ranks();
        if (kind_ == BaselineColl::kSimple) {
            bar_.make(w);
            algo_ = "simple";
        } else if (nr == 1) {
            algo_ = "none";  // one rank: the op is a no-op in place
        } else if (w.num_nodes() > 1) {
            algo_ = "hierarchical";
        } else {
            algo_ = weft::ops::algo_name(weft::ops::resolve_all_gather_algo(
                weft::ops::AllGatherAlgo::kAuto, weft::env::get("WEFT_ALLGATHER_ALGO"), slot_bytes,
                weft::ops::prepare_collectives(w).topology, /*output_symmetric=*/true));
        }
    }
    void operator()(cudaStream_t s) {
        const int nr = w_->num_ranks(), me = w_->rank();
        if (kind_ == BaselineColl::kWeft) {
            const auto slot = static_cast<int64_t>(slot_bytes_);
            weft::ops::all_gather(*w_, weft::TensorView(gathered_ + me * slot, DType::kU8, {slot}),
                                  weft::TensorView(gathered_, DType::kU8, {nr * slot}), s);
            return;
        }
        bar_(s);
        for (int i = 1; i < nr; ++i) {
            uint8_t* dst = gathered_ + static_cast<uint64_t>((me + i) % nr) * slot_bytes_;
            BENCH_CUDA(cudaMemcpyAsync(dst, w_->heap().symm_at(dst, (me + i) % nr), slot_bytes_, cudaMemcpyDefault, s));
        }
        bar_(s);
    }
    /// The algorithm a call runs: weft's choice ("ll", "sm_push", "ce_push", ...) or "simple".
    const std::string& algo() const { return algo_; }
    void release() {
        if (bar_.words != nullptr) w_->heap().free(bar_.words);
        bar_.words = nullptr;
    }

private:
    World* w_;
    BaselineColl kind_;
    uint8_t* gathered_;
    uint64_t slot_bytes_;
    DeviceBarrier bar_;
    std::string algo_;
};

/// (a)'s reduce-scatter: `partial` is a symmetric [num_ranks * rows, n] buffer of dtype `t` (slice r = rows
/// [r * rows, (r + 1) * rows), the same allocation on every rank); `out` [rows, n] (any device memory) gets the sum
/// over the ranks of slice `rank`, added in rank order in fp32 and rounded once. After a call (in stream order)
/// every peer has finished reading this rank's `partial`, so it may be rewritten.
///  weft:   ops::reduce_scatter(partial, out), automatic algorithm (sm_pull: peers read the symmetric input in
///          place between an entry and an exit barrier); across nodes the hierarchical reduce_scatter.
///  simple: device barrier, bench_sum_kernel reading slice `rank` of every peer's partial, device barrier.
/// `n` must be a multiple of 8 (the simple kernel's vectors). Construction and release() are collective.
class BaselineReduceScatter {
public:
    BaselineReduceScatter(World& w, BaselineColl kind, DType t, void* partial, void* out, int64_t rows, int64_t n)
        : w_(&w), kind_(kind), t_(t), partial_(partial), out_(out), rows_(rows), n_(n) {
        if (n % 8 != 0) {
            throw std::runtime_error("BaselineReduceScatter: n must be a multiple of 8, got " + std::to_string(n));
        }
        if (kind_ == BaselineColl::kSimple) {
            bar_.make(w);
            algo_ = "simple";
        } else if (w.num_ranks() == 1) {
            algo_ = "copy";
        } else if (w.num_nodes() > 1) {
            algo_ = "hierarchical";
        } else {
            const uint64_t out_bytes = static_cast<uint64_t>(rows * n) * static_cast<uint64_t>(weft::dtype_bytes(t));
            algo_ = weft::ops::algo_name(weft::ops::resolve_reduce_scatter_algo(
                weft::ops::ReduceScatterAlgo::kAuto, weft::env::get("WEFT_REDUCESCATTER_ALGO"), out_bytes,
                weft::ops::prepare_collectives(w).topology));
        }
    }
    void operator()(cudaStream_t s) {
        const int nr = w_->num_ranks(), me = w_->rank();
        if (kind_ == BaselineColl::kWeft) {
            weft::ops::reduce_scatter(*w_, weft::TensorView(partial_, t_, {nr * rows_ * n_}),
                                      weft::TensorView(out_, t_, {rows_ * n_}), s);
            return;
        }
        const weft::DeviceCtx ctx = w_->device_ctx();
        bar_(s);  // every partial is complete
        sum_launch(t_, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            bench_sum_kernel<T><<<kSumBlocks, kSumThreads, 0, s>>>(ctx, static_cast<const T*>(partial_), nullptr, 0, nr,
                                                                   me * rows_, rows_, 0, n_, n_, static_cast<T*>(out_),
                                                                   n_);
        });
        BENCH_CUDA(cudaGetLastError());
        bar_(s);  // every rank has read its rows: the partials may be rewritten
    }
    const std::string& algo() const { return algo_; }
    void release() {
        if (bar_.words != nullptr) w_->heap().free(bar_.words);
        bar_.words = nullptr;
    }

private:
    World* w_;
    BaselineColl kind_;
    DType t_;
    void* partial_;
    void* out_;
    int64_t rows_, n_;
    DeviceBarrier bar_;
    std::string algo_;
};

/// (a)'s all-reduce: `partial` is a symmetric [m, n] buffer of dtype `t` (the same allocation on every rank);
/// `out` [m, n] (any device memory, not overlapping it) gets the element-wise sum over the ranks (rank order,
/// fp32, rounded once). After a call (in stream order) `partial` may be rewritten.
///  weft:   ops::all_reduce(partial, out), automatic algorithm (LL, one-shot or two-shot by size; across nodes
///          the hierarchical all_reduce).
///  simple: device barrier, bench_sum_kernel reading every peer's partial, device barrier.
/// `n` must be a multiple of 8 (the simple kernel's vectors). Construction and release() are collective.
class BaselineAllReduce {
public:
    BaselineAllReduce(World& w, BaselineColl kind, DType t, void* partial, void* out, int64_t m, int64_t n)
        : w_(&w), kind_(kind), t_(t), partial_(partial), out_(out), m_(m), n_(n) {
        if (n % 8 != 0) {
            throw std::runtime_error("BaselineAllReduce: n must be a multiple of 8, got " + std::to_string(n));
        }
        if (kind_ == BaselineColl::kSimple) {
            bar_.make(w);
            algo_ = "simple";
        } else {
            algo_ = weft_algo(w, static_cast<uint64_t>(m * n) * static_cast<uint64_t>(weft::dtype_bytes(t)));
        }
    }
    /// weft's choice for an all-reduce of `bytes` bytes per rank on `w` ("copy" on one rank).
    static std::string weft_algo(World& w, uint64_t bytes) {
        if (w.num_ranks() == 1) return "copy";
        if (w.num_nodes() > 1) return "hierarchical";
        return weft::ops::algo_name(weft::ops::resolve_all_reduce_algo(weft::ops::AllReduceAlgo::kAuto,
                                                                       weft::env::get("WEFT_ALLREDUCE_ALGO"), bytes,
                                                                       weft::ops::prepare_collectives(w).topology));
    }
    void operator()(cudaStream_t s) {
        if (kind_ == BaselineColl::kWeft) {
            weft::ops::all_reduce(*w_, weft::TensorView(partial_, t_, {m_ * n_}), weft::TensorView(out_, t_, {m_ * n_}),
                                  s);
            return;
        }
        const weft::DeviceCtx ctx = w_->device_ctx();
        bar_(s);  // every partial is complete
        sum_launch(t_, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            bench_sum_kernel<T><<<kSumBlocks, kSumThreads, 0, s>>>(ctx, static_cast<const T*>(partial_), nullptr, 0,
                                                                   ctx.num_ranks, 0, m_, 0, n_, n_,
                                                                   static_cast<T*>(out_), n_);
        });
        BENCH_CUDA(cudaGetLastError());
        bar_(s);  // every rank has read every partial: they may be rewritten
    }
    const std::string& algo() const { return algo_; }
    void release() {
        if (bar_.words != nullptr) w_->heap().free(bar_.words);
        bar_.words = nullptr;
    }

private:
    World* w_;
    BaselineColl kind_;
    DType t_;
    void* partial_;
    void* out_;
    int64_t m_, n_;
    DeviceBarrier bar_;
    std::string algo_;
};

}  // namespace weft::bench_tp
