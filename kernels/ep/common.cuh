// SPDX-License-Identifier: MIT
// Device helpers shared by the expert-parallel kernels: status reports, last-block election, bf16 packing, scans,
// routes.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_workspace.hpp"
#include "weft/device/record.cuh"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::ep {

using ptx::Scope;
using ptx::Sem;
using weft::ep::Geometry;
using weft::ep::KernelId;
using weft::ep::Status;
using weft::ep::StatusCode;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31u); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ uint32_t lanemask_lt() { return (1u << lane_id()) - 1u; }

/// Records an error in this rank's status word (host-mapped) with device::write_record_once: the first error wins,
/// and the host reads `claimed == 2` only after every field. The kernel goes on after a report (no trap of its own
/// follows), so the writer does not wait for the record to read back (wait_record_complete). __noinline__: one copy
/// of the error path per kernel. Any thread.
__device__ __noinline__ inline void report_status(Status* status, StatusCode code, int32_t rank, int32_t culprit,
                                                  int64_t value, int64_t limit, int64_t token, int64_t slot,
                                                  uint64_t call, KernelId kernel) {
    if (status == nullptr) {
        return;
    }
    device::write_record_once(&status->claimed, [&] {
        status->code = code;
        status->rank = rank;
        status->culprit_rank = culprit;
        status->value = value;
        status->limit = limit;
        status->token = token;
        status->slot = slot;
        status->call = call;
        status->kernel = static_cast<uint32_t>(kernel);
    });
}

/// Every block calls this once, after all of its work, with the same counter. Returns true (to every
/// thread of the block) in exactly one block: the last to arrive. That block has acquired every other
/// block's writes (each arrival is a gpu-scope acq_rel atomic after a block barrier), so it may publish
/// them to other ranks with one system-scope release per peer, and it may update state that every
/// block read at its start. The counter is back at 0 when the kernel ends.
__device__ __forceinline__ bool last_block_arrive(uint32_t* arrivals) {
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t old = ptx::atom_add<Sem::kAcqRel, Scope::kGpu>(arrivals, 1u);
        is_last = old == gridDim.x - 1 ? 1 : 0;
        if (is_last) {
            ptx::st<Sem::kRelaxed, Scope::kGpu>(arrivals, 0u);
        }
    }
    __syncthreads();
    return is_last != 0;
}

/// The 8 floats of 8 packed bf16 (exact).
__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

/// 8 floats to 8 packed bf16 (round to nearest even).
__device__ __forceinline__ uint4 f32_to_bf16x8(const float (&f)[8]) {
    return uint4{ptx::cvt_rn_bf16x2(f[0], f[1]), ptx::cvt_rn_bf16x2(f[2], f[3]), ptx::cvt_rn_bf16x2(f[4], f[5]),
                 ptx::cvt_rn_bf16x2(f[6], f[7])};
}

/// Lane `lane_id()`'s U granules of the row chunk starting at granule `c0`: v[u] = src[c0 + 32 u + lane], or
/// zero at and beyond granule `end`. Every load is issued before any value is used (weak accesses).
// NOTE: a conversion right after each load makes ptxas reuse one set of registers and wait for each load in
// turn (one load in flight per lane); the loads go first, into their own registers, for that reason.
template <int U>
__device__ __forceinline__ void warp_load_chunk(uint4 (&v)[U], const uint4* src, int c0, int end) {
    const int lane = lane_id();
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int i = c0 + u * 32 + lane;
        v[u] = i < end ? ptx::ld(src + i) : uint4{0, 0, 0, 0};
    }
}

/// Takes the lowest one or two set bits of `mask` (warp-uniform, non-zero): their positions in j0 and j1
/// (j1 = j0 when only one was set); returns whether there were two. The combines' reductions fetch two rows'
/// loads together this way, in bit order.
__device__ __forceinline__ bool take_two_lanes(uint32_t& mask, int& j0, int& j1) {
    j0 = __ffs(mask) - 1;
    mask &= mask - 1;
    const bool two = mask != 0;
    j1 = two ? __ffs(mask) - 1 : j0;
    if (two) mask &= mask - 1;
    return two;
}

/// acc[u][q] = fma(w, the q-th bf16 of v[u], acc[u][q]) (fp32, one rounding), for every u and q.
template <int U>
__device__ __forceinline__ void fma_bf16x8(float (&acc)[U][8], float w, const uint4 (&v)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            acc[u][q] = __fmaf_rn(w, f[q], acc[u][q]);
        }
    }
}

/// acc[u][q] += the q-th bf16 of v[u] (fp32, round to nearest even), for every u and q.
template <int U>
__device__ __forceinline__ void add_bf16x8(float (&acc)[U][8], const uint4 (&v)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            acc[u][q] = __fadd_rn(acc[u][q], f[q]);
        }
    }
}

/// The weighted sum of a token's rows, the reduction both combines share (normal: a received token's rows on this
/// rank; low latency: all of its slots). The calling warp reduces the rows of the set bits j of `lanes`
/// (warp-uniform), lane j holding row j's `weight`: `rows.index(j)` (warp-uniform j; it may shuffle from lane j)
/// names row j and `rows.at(index)` gives its 16-byte granules. For each chunk of 32 * U granules in [begin, end):
/// acc = fma(w_j, row_j, acc) in fp32 over the rows in bit (top-k slot) order, from 0, then `store(granule,
/// bf16x8)` for each granule < end: one rounding. Two rows' loads are in flight before the first is accumulated
/// (warp_load_chunk), which leaves the sums those of one row at a time, bit for bit.
// NOTE: both rows are named (index, which may shuffle) before the weights are shuffled, and addressed (at) only where
// they are loaded: in other orders ptxas gives the normal combine one more register and about 70 more instructions.
template <int U, class Rows, class Store>
__device__ __forceinline__ void warp_weighted_sum(uint32_t lanes, float weight, const Rows& rows, int begin, int end,
                                                  const Store& store) {
    const int lane = lane_id();
    for (int c0 = begin; c0 < end; c0 += 32 * U) {
        float acc[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                acc[u][q] = 0.0f;
            }
        }
        uint32_t left = lanes;
        while (left != 0) {
            int j0 = 0, j1 = 0;
            const bool two = take_two_lanes(left, j0, j1);  // warp-uniform
            const auto row0 = rows.index(j0);
            const auto row1 = rows.index(j1);
            const float w0 = __shfl_sync(0xffffffffu, weight, j0);
            const float w1 = __shfl_sync(0xffffffffu, weight, j1);
            uint4 v0[U];
            uint4 v1[U];
            warp_load_chunk<U>(v0, rows.at(row0), c0, end);
            warp_load_chunk<U>(v1, rows.at(row1), c0, two ? end : 0);  // end 0: no loads
            fma_bf16x8<U>(acc, w0, v0);
            if (two) {
                fma_bf16x8<U>(acc, w1, v1);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int gi = c0 + u * 32 + lane;
            if (gi < end) {
                store(gi, f32_to_bf16x8(acc[u]));
            }
        }
    }
}

/// The calling warp copies one row of `granules` 16-byte granules (local to local; weak accesses).
template <int U>
__device__ __forceinline__ void warp_copy_row(uint4* dst, const uint4* src, int granules) {
    const int lane = lane_id();
    for (int c0 = 0; c0 < granules; c0 += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = c0 + u * 32 + lane;
            if (i < granules) {
                v[u] = ptx::ld(src + i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = c0 + u * 32 + lane;
            if (i < granules) {
                ptx::st(dst + i, v[u]);
            }
        }
    }
}

/// In-place exclusive prefix sum of `data[0, n)` (shared memory); returns the total to every thread.
/// Every thread of the block calls it.
__device__ inline int32_t block_exclusive_scan(int32_t* data, int n) {
    __shared__ int32_t warp_totals[32];
    const int threads = static_cast<int>(blockDim.x);
    const int per_thread = (n + threads - 1) / threads;
    const int begin = min(n, static_cast<int>(threadIdx.x) * per_thread);
    const int end = min(n, begin + per_thread);
    int32_t own = 0;
    for (int i = begin; i < end; ++i) {
        own += data[i];
    }
    int32_t inclusive = own;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane_id() >= d) {
            inclusive += up;
        }
    }
    __syncthreads();  // NOTE: warp_totals of a previous call have been read
    if (lane_id() == 31) {
        warp_totals[warp_id()] = inclusive;
    }
    __syncthreads();
    if (warp_id() == 0) {
        const int warps = threads / 32;
        int32_t t = lane_id() < warps ? warp_totals[lane_id()] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int32_t up = __shfl_up_sync(0xffffffffu, t, d);
            if (lane_id() >= d) {
                t += up;
            }
        }
        warp_totals[lane_id()] = t;  // inclusive over warps
    }
    __syncthreads();
    int32_t run = (warp_id() > 0 ? warp_totals[warp_id() - 1] : 0) + inclusive - own;
    for (int i = begin; i < end; ++i) {
        const int32_t v = data[i];
        data[i] = run;
        run += v;
    }
    const int32_t total = warp_totals[threads / 32 - 1];
    __syncthreads();
    return total;
}

/// Index of the last element <= v in the non-decreasing `prefix[0, n)` (prefix[0] <= v assumed).
__device__ __forceinline__ int upper_bound_index(const int32_t* prefix, int n, int32_t v) {
    int lo = 0;
    int hi = n;  // prefix[lo] <= v < prefix[hi] (prefix[n] = +inf)
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (prefix[mid] <= v) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/// The expert of route (token row, slot j) when the route is valid, else -1. Valid: an id in
/// [0, num_experts) not already used by an earlier slot of the same token (a repeat is dropped).
__device__ __forceinline__ int32_t route_expert(const int32_t* row, int j, int num_experts) {
    const int32_t e = row[j];
    if (e < 0 || e >= num_experts) {
        return -1;
    }
    for (int i = 0; i < j; ++i) {
        if (row[i] == e) {
            return -1;
        }
    }
    return e;
}

/// A digest of one token's topk_idx row (its `k` raw ids, slot order included), the same in every lane; the whole warp
/// calls it. A low-latency dispatch keeps it per token in its handle and the combine compares it with the row it is
/// given (kCombineRoutingMismatch): each slot's term is a bijection of its id, so rows that differ in one slot always
/// differ here.
__device__ __forceinline__ uint32_t route_row_digest(const int32_t* row, int lane, int k) {
    uint32_t h = 0;
    if (lane < k) {
        h = (static_cast<uint32_t>(row[lane]) + 0x9e3779b9u * static_cast<uint32_t>(lane + 1)) * 0x85ebca6bu;
        h ^= h >> 15;
    }
    return __reduce_xor_sync(0xffffffffu, h);
}

/// Whether token `t`'s topk_idx row (the whole warp calls it) is the row its low-latency dispatch sent, whose digest
/// the handle keeps (`dispatched`). The rows in the combine's landing are those of that row: another one here would sum
/// the wrong rows, so the caller writes the token's row of `out` as zeros and, where `report` holds in lane 0, this
/// records kCombineRoutingMismatch naming the token and the call.
__device__ __forceinline__ bool combine_row_matches_dispatch(const int32_t* row, int lane, int k, uint32_t dispatched,
                                                             bool report, Status* status, int32_t rank, int t,
                                                             uint64_t call) {
    const uint32_t digest = route_row_digest(row, lane, k);
    if (digest != dispatched && report && lane == 0) {
        report_status(status, StatusCode::kCombineRoutingMismatch, rank, rank, digest, dispatched, t, -1, call,
                      KernelId::kLowLatencyCombine);
    }
    return digest == dispatched;
}

/// Where compute_routes writes. Pointers may be generic addresses of shared or global memory.
struct RouteOut {
    int32_t* route_pos;  ///< [T, k]: index among this rank's valid routes to the expert (token, then slot order), or -1
    int32_t* expert_count;   ///< [E]: valid routes per expert
    uint8_t* token_in_rank;  ///< [T, W] or nullptr: 1 when the token has a valid route to the rank
    int32_t* send_idx;       ///< [T, W] or nullptr: index among this rank's tokens going to the rank, or -1
    int32_t* rank_count;     ///< [W] or nullptr: tokens going to each rank
};

/// The routing of this rank's tokens, in a stable order (token index, then top-k slot), computed by
/// one block: every thread calls it. `hist` is shared scratch of (warps * E) ints, `rank_hist` of
/// (warps * W) ints (only when out.send_idx is set). Invalid and repeated expert ids are reported to
/// `status` when `report` is set. Ends with a block barrier.
///
/// Each warp owns a contiguous range of tokens: pass 1 counts its routes per expert (and tokens per
/// rank), pass 2 turns the per-warp counts into per-warp starting offsets, pass 3 walks the warp's
/// routes 32 at a time in order (ranks within a step from __match_any_sync), pass 4 its tokens 32 at a
/// time (ranks from one ballot per destination).
__device__ inline void compute_routes(const Geometry& g, const int32_t* topk_idx, int64_t idx_stride, int num_tokens,
                                      int32_t* hist, int32_t* rank_hist, RouteOut out, Status* status, bool report,
                                      uint64_t call, KernelId kernel) {
    const int warps = static_cast<int>(blockDim.x) / 32;
    const int warp = warp_id();
    const int lane = lane_id();
    const int num_experts = g.num_experts;
    const int num_ranks = g.num_ranks;
    const int k = g.topk;
    const int local_experts = g.local_experts();
    const bool ranks_wanted = out.send_idx != nullptr;
    for (int i = static_cast<int>(threadIdx.x); i < warps * num_experts; i += static_cast<int>(blockDim.x)) {
        hist[i] = 0;
    }
    if (ranks_wanted) {
        for (int i = static_cast<int>(threadIdx.x); i < warps * num_ranks; i += static_cast<int>(blockDim.x)) {
            rank_hist[i] = 0;
        }
    }
    __syncthreads();
    const int per_warp = (num_tokens + warps - 1) / warps;
    const int t_begin = min(num_tokens, warp * per_warp);
    const int t_end = min(num_tokens, t_begin + per_warp);
    int32_t* my_hist = hist + warp * num_experts;
    int32_t* my_rank_hist = ranks_wanted ? rank_hist + warp * num_ranks : nullptr;

    // Pass 1: counts (one lane per token).
    for (int t = t_begin + lane; t < t_end; t += 32) {
        const int32_t* row = topk_idx + static_cast<int64_t>(t) * idx_stride;
        uint64_t ranks = 0;
        for (int j = 0; j < k; ++j) {
            const int32_t raw = row[j];
            const int32_t e = route_expert(row, j, num_experts);
            if (e < 0) {
                if (report && raw != -1) {
                    const bool in_range = raw >= 0 && raw < num_experts;
                    report_status(status, in_range ? StatusCode::kDuplicateExpert : StatusCode::kInvalidExpert, g.rank,
                                  g.rank, raw, num_experts, t, j, call, kernel);
                }
                continue;
            }
            atomicAdd(&my_hist[e], 1);
            ranks |= 1ull << (e / local_experts);
        }
        if (ranks_wanted) {
            for (int r = 0; r < num_ranks; ++r) {
                if ((ranks >> r) & 1ull) {
                    atomicAdd(&my_rank_hist[r], 1);
                }
            }
        }
    }
    __syncthreads();

    // Pass 2: per-warp starting offsets and totals.
    for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += static_cast<int>(blockDim.x)) {
        int32_t run = 0;
        for (int w = 0; w < warps; ++w) {
            const int32_t v = hist[w * num_experts + e];
            hist[w * num_experts + e] = run;
            run += v;
        }
        out.expert_count[e] = run;
    }
    if (ranks_wanted) {
        for (int r = static_cast<int>(threadIdx.x); r < num_ranks; r += static_cast<int>(blockDim.x)) {
            int32_t run = 0;
            for (int w = 0; w < warps; ++w) {
                const int32_t v = rank_hist[w * num_ranks + r];
                rank_hist[w * num_ranks + r] = run;
                run += v;
            }
            out.rank_count[r] = run;
        }
    }
    __syncthreads();

    // Pass 3: route positions, 32 routes of the warp's range per step, in (token, slot) order.
    const int64_t r_begin = static_cast<int64_t>(t_begin) * k;
    const int64_t r_end = static_cast<int64_t>(t_end) * k;
    for (int64_t step = r_begin; step < r_end; step += 32) {
        const int64_t r = step + lane;
        int key = num_experts + lane;  // unique: matches no other lane
        int32_t e = -1;
        int t = 0;
        int j = 0;
        if (r < r_end) {
            t = static_cast<int>(r / k);
            j = static_cast<int>(r % k);
            e = route_expert(topk_idx + static_cast<int64_t>(t) * idx_stride, j, num_experts);
            if (e >= 0) {
                key = e;
            }
        }
        const uint32_t peers = __match_any_sync(0xffffffffu, key);
        int32_t pos = -1;
        if (e >= 0) {
            pos = my_hist[e] + __popc(peers & lanemask_lt());
        }
        __syncwarp();
        if (e >= 0 && (peers >> lane) == 1u) {  // the group's highest lane advances the counter
            my_hist[e] += __popc(peers);
        }
        __syncwarp();
        if (r < r_end) {
            out.route_pos[static_cast<int64_t>(t) * k + j] = pos;
        }
    }

    // Pass 4: per-destination token indices, 32 tokens per step.
    if (ranks_wanted) {
        for (int step = t_begin; step < t_end; step += 32) {
            const int t = step + lane;
            uint64_t ranks = 0;
            if (t < t_end) {
                const int32_t* row = topk_idx + static_cast<int64_t>(t) * idx_stride;
                for (int j = 0; j < k; ++j) {
                    const int32_t e = route_expert(row, j, num_experts);
                    if (e >= 0) {
                        ranks |= 1ull << (e / local_experts);
                    }
                }
            }
            for (int r = 0; r < num_ranks; ++r) {
                const bool in = ((ranks >> r) & 1ull) != 0;
                const uint32_t ballot = __ballot_sync(0xffffffffu, in);
                if (t < t_end) {
                    const int64_t at = static_cast<int64_t>(t) * num_ranks + r;
                    out.send_idx[at] = in ? my_rank_hist[r] + __popc(ballot & lanemask_lt()) : -1;
                    out.token_in_rank[at] = in ? 1 : 0;
                }
                __syncwarp();
                if (lane == 0) {
                    my_rank_hist[r] += __popc(ballot);
                }
                __syncwarp();
            }
        }
    }
    __syncthreads();
}

}  // namespace weft::kernels::ep
