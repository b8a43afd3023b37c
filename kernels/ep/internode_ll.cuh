// SPDX-License-Identifier: MIT
// Low-latency expert parallelism across nodes: the pack (this rank's tokens into one fixed record per (destination,
// token)), the layout and copy that place the received records into the masked layout of the one-node op, and the
// combine's pack (each received route's expert output row, back to its source) and sum (a token's rows in slot order).
// All local: the record exchanges between them are ops::all_to_all on the team (docs/multinode.md, "EP across nodes";
// record layouts: weft/common/ep_internode.hpp).
#pragma once

#include "ep/common.cuh"
#include "ep/low_latency.cuh"  // detail::quantize_e4m3x8: the one-node dispatch's quantiser, bit for bit
#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_internode.hpp"

namespace weft::kernels::ep {

/// Compile-time knobs of the low-latency kernels across nodes.
struct InternodeLowLatencyConfig {
    int threads = 512;  ///< threads per block, a multiple of 32 in 64..1024
    int unroll = 2;     ///< 16-byte granules each lane keeps in flight per row chunk
};

__host__ __device__ constexpr bool is_valid(const InternodeLowLatencyConfig& c) {
    return c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 && c.unroll >= 1 && c.unroll <= 8;
}

/// Any grid. One warp per (destination r, token slot t): record t of block r gets the token's local routes on r
/// (weft::ep::ll_record_routes) and, when it has any, the token's row; slots t >= T get no route. The warps of block r
/// = 0 report each token's invalid and repeated ids as the one-node dispatch does (kInvalidExpert, kDuplicateExpert,
/// the call number = state->dispatch_send_calls + 1). Local; graph-capturable.
template <InternodeLowLatencyConfig C>
__global__ void __launch_bounds__(C.threads)
    internode_ll_pack(weft::DeviceCtx ctx, weft::ep::LowLatencyInternodeArgs a) {
    static_assert(is_valid(C), "InternodeLowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const weft::ep::LowLatencyRecordLayout& l = a.net;
    const int granules = g.hidden / 8;
    const int lane = lane_id();
    const uint64_t call = a.state->dispatch_send_calls + 1;
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int64_t i = warp; i < l.records(); i += warps) {
        const int32_t r = static_cast<int32_t>(i / l.capacity);
        const int32_t t = static_cast<int32_t>(i % l.capacity);
        uint8_t* record = a.send + l.record_offset(r, t);
        auto* ids = reinterpret_cast<int32_t*>(record + l.ids_offset);
        if (lane == 0) *reinterpret_cast<uint32_t*>(record + l.signature_offset) = a.signature;
        if (t >= a.num_tokens) {
            if (lane < l.topk) ids[lane] = -1;
            continue;
        }
        const int32_t* row = a.topk_idx + static_cast<int64_t>(t) * a.idx_stride;
        if (r == 0 && lane < g.topk) {
            const int32_t raw = row[lane];
            if (raw != -1 && weft::ep::valid_route_expert(g, row, lane) < 0) {
                const bool in_range = raw >= 0 && raw < g.num_experts;
                report_status(a.status, in_range ? StatusCode::kDuplicateExpert : StatusCode::kInvalidExpert, g.rank,
                              g.rank, raw, g.num_experts, t, lane, call, KernelId::kLowLatencyDispatch);
            }
        }
        if (r == 0) {  // the combine compares its topk_idx with this
            const uint32_t digest = route_row_digest(row, lane, g.topk);
            if (lane == 0) a.handle.route_digest[t] = digest;
        }
        int n = 0;
        if (lane == 0) n = weft::ep::ll_record_routes(g, row, r, ids);
        n = __shfl_sync(0xffffffffu, n, 0);
        if (n > 0) {
            warp_copy_row<C.unroll>(reinterpret_cast<uint4*>(record),
                                    reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(t) * a.x_stride),
                                    granules);
        }
    }
}

/// Any grid; each block takes local experts blockIdx.x, blockIdx.x + gridDim.x, ... After the dispatch exchange
/// (a.recv: block s = source s's records). For local expert e, the received records that route to it, in (source,
/// token) order (the one-node receive order), get consecutive rows of e's masked area: route_row[record][j] (j: the
/// slot naming e), recv_src_info = record index = source * capacity + token, recv_src_slot = j; expert_counts[e] =
/// their number. A received record whose signature differs from a.signature: nothing is placed (every count 0,
/// handle.mismatch = 1, kCallMismatch reported by block 0). Local; graph-capturable.
template <InternodeLowLatencyConfig C>
__global__ void __launch_bounds__(C.threads)
    internode_ll_layout(weft::DeviceCtx ctx, weft::ep::LowLatencyInternodeArgs a) {
    static_assert(is_valid(C), "InternodeLowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    __shared__ int32_t flags[C.threads];
    const Geometry g = a.geo;
    const weft::ep::LowLatencyRecordLayout& l = a.net;
    const int tid = static_cast<int>(threadIdx.x);
    const int64_t rows_per_expert = g.ll_rows_per_expert();
    // A source whose call differs from this rank's (fp8 against bf16): every block of every rank receives nothing
    // (each rank sees some differing source), the copy places nothing and the combine gives zeros.
    bool differs = false;
    for (int64_t rec = tid; rec < l.records(); rec += C.threads) {
        const uint32_t theirs = *reinterpret_cast<const uint32_t*>(a.recv + rec * l.record_bytes + l.signature_offset);
        if (theirs != a.signature && !differs) {
            differs = true;
            if (blockIdx.x == 0) {
                report_status(a.status, StatusCode::kCallMismatch, g.rank, static_cast<int32_t>(rec / l.capacity),
                              a.signature, theirs, -1, -1, a.state->dispatch_send_calls + 1,
                              KernelId::kLowLatencyDispatch);
            }
        }
    }
    const bool mismatch = __syncthreads_or(differs) != 0;
    if (blockIdx.x == 0 && tid == 0) a.handle.mismatch[0] = mismatch ? 1 : 0;
    for (int le = static_cast<int>(blockIdx.x); le < g.local_experts(); le += static_cast<int>(gridDim.x)) {
        if (mismatch) {
            if (tid == 0) a.handle.expert_counts[le] = 0;
            continue;
        }
        int32_t base = 0;
        for (int64_t c0 = 0; c0 < l.records(); c0 += C.threads) {
            const int64_t rec = c0 + tid;
            int32_t slot = -1;
            if (rec < l.records()) {
                const auto* ids = reinterpret_cast<const int32_t*>(a.recv + rec * l.record_bytes + l.ids_offset);
                for (int32_t j = 0; j < l.topk; ++j) slot = slot < 0 && ids[j] == le ? j : slot;
            }
            flags[tid] = slot >= 0 ? 1 : 0;
            const int32_t total = block_exclusive_scan(flags, C.threads);
            if (slot >= 0) {
                const int64_t out_row = le * rows_per_expert + base + flags[tid];
                a.route_row[rec * l.topk + slot] = static_cast<int32_t>(out_row);
                a.handle.recv_src_info[out_row] = static_cast<int32_t>(rec);
                a.handle.recv_src_slot[out_row] = slot;
            }
            base += total;
            __syncthreads();  // flags are rewritten by the next chunk
        }
        if (tid == 0) a.handle.expert_counts[le] = base;
    }
}

/// Any grid. After internode_ll_layout (same stream). One warp per received record with routes: its row, loaded once
/// (and quantised once when a.fp8: e4m3 codes with one fp32 scale per 128 channels, the one-node quantiser), stored
/// into the output row of each of its routes (route_row); nothing after a mismatch. Block 0 then advances the
/// dispatch's call number (read by this call's pack and layout). Local; graph-capturable.
template <InternodeLowLatencyConfig C>
__global__ void __launch_bounds__(C.threads)
    internode_ll_copy(weft::DeviceCtx ctx, weft::ep::LowLatencyInternodeArgs a) {
    static_assert(is_valid(C), "InternodeLowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry g = a.geo;
    const weft::ep::LowLatencyRecordLayout& l = a.net;
    const int granules = g.hidden / 8;
    const int num_scales = static_cast<int>(g.ll_fp8_scales());
    const int lane = lane_id();
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    if (blockIdx.x == 0 && threadIdx.x == 0) a.state->dispatch_send_calls += 1;
    const int64_t records = a.handle.mismatch[0] == 0 ? l.records() : 0;
    for (int64_t rec = warp; rec < records; rec += warps) {
        const uint8_t* record = a.recv + rec * l.record_bytes;
        const auto* ids = reinterpret_cast<const int32_t*>(record + l.ids_offset);
        const int32_t out_row = lane < l.topk && ids[lane] >= 0 ? a.route_row[rec * l.topk + lane] : -1;
        const uint32_t routes = __ballot_sync(0xffffffffu, out_row >= 0);
        if (routes == 0) continue;
        const auto* src = reinterpret_cast<const uint4*>(record);
        for (int c0 = 0; c0 < granules; c0 += 32 * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                v[u] = gi < granules ? ptx::ld(src + gi) : uint4{0, 0, 0, 0};
            }
            if (a.fp8) {
                uint2 codes[U];
                float scales[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    float f[8];
                    bf16x8_to_f32(v[u], f);
                    codes[u] = detail::quantize_e4m3x8(f, scales[u]);
                }
                uint32_t left = routes;
                while (left != 0) {
                    const int j = __ffs(left) - 1;
                    left &= left - 1;
                    const int64_t row = __shfl_sync(0xffffffffu, out_row, j);
                    uint8_t* d = a.handle.recv_x + row * g.hidden;
                    float* sc = a.handle.recv_scales + row * num_scales;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int gi = c0 + u * 32 + lane;
                        if (gi < granules) {
                            ptx::st(reinterpret_cast<uint2*>(d) + gi, codes[u]);
                            if ((lane & 15) == 0) sc[gi / 16] = scales[u];
                        }
                    }
                }
            } else {
                uint32_t left = routes;
                while (left != 0) {
                    const int j = __ffs(left) - 1;
                    left &= left - 1;
                    const int64_t row = __shfl_sync(0xffffffffu, out_row, j);
                    auto* d = reinterpret_cast<uint4*>(a.handle.recv_x + row * g.row_bytes());
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int gi = c0 + u * 32 + lane;
                        if (gi < granules) ptx::st(d + gi, v[u]);
                    }
                }
            }
        }
    }
}

/// Any grid. After the dispatch (the handle's counts, sources and slots; a.recv still holds its records). One warp per
/// valid row i of local expert e: y[e][i] goes to combine_send at (source, token, position of its slot among the
/// token's routes on this rank). Rows of positions no route uses are not written (never read). Local; graph-capturable.
template <InternodeLowLatencyConfig C>
__global__ void __launch_bounds__(C.threads)
    internode_ll_combine_pack(weft::DeviceCtx ctx, weft::ep::LowLatencyInternodeArgs a) {
    static_assert(is_valid(C), "InternodeLowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    __shared__ int32_t prefix[weft::ep::kMaxExperts + 1];
    const Geometry g = a.geo;
    const weft::ep::LowLatencyRecordLayout& l = a.net;
    const int tid = static_cast<int>(threadIdx.x);
    const int local_experts = g.local_experts();
    const int64_t rows_per_expert = g.ll_rows_per_expert();
    const int granules = g.hidden / 8;
    for (int le = tid; le < local_experts; le += C.threads) prefix[le] = a.handle.expert_counts[le];
    __syncthreads();
    const int32_t total = block_exclusive_scan(prefix, local_experts);
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int f = warp; f < total; f += warps) {
        const int le = upper_bound_index(prefix, local_experts, f);
        const int i = f - prefix[le];
        const int64_t row = le * rows_per_expert + i;
        const int32_t rec = a.handle.recv_src_info[row];
        const int32_t j = a.handle.recv_src_slot[row];
        const auto* ids = reinterpret_cast<const int32_t*>(a.recv + int64_t{rec} * l.record_bytes + l.ids_offset);
        const int32_t p = weft::ep::ll_record_position(ids, j);
        const auto* src = reinterpret_cast<const uint4*>(a.y + le * a.y_expert_stride + i * a.y_row_stride);
        auto* dst = reinterpret_cast<uint4*>(a.combine_send + (int64_t{rec} * l.local_topk + p) * g.hidden);
        warp_copy_row<C.unroll>(dst, src, granules);
    }
}

namespace detail {

/// A token's returned rows, for warp_weighted_sum: lane j holds the address of slot j's row.
struct ReturnedRows {
    const uint16_t* mine;  ///< this lane's slot's row (null when the slot is not a route)
    __device__ __forceinline__ const uint16_t* index(int j) const {
        return reinterpret_cast<const uint16_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(mine), j));
    }
    __device__ __forceinline__ const uint4* at(const uint16_t* row) const {
        return reinterpret_cast<const uint4*>(row);
    }
};

}  // namespace detail

/// Any grid. After the combine exchange (combine_recv: block r = expert rank r's rows for this rank's tokens). One warp
/// per token t: out[t] = bf16(fma over the valid slots j in slot order of (w_j, row of (t, j)) in fp32 from 0), the
/// one-node combine's arithmetic bit for bit; a token with no valid slot is 0, every token 0 after a dispatch whose
/// calls differed. Local; graph-capturable.
template <InternodeLowLatencyConfig C>
__global__ void __launch_bounds__(C.threads)
    internode_ll_combine_sum(weft::DeviceCtx ctx, weft::ep::LowLatencyInternodeArgs a) {
    static_assert(is_valid(C), "InternodeLowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const weft::ep::LowLatencyRecordLayout& l = a.net;
    const int granules = g.hidden / 8;
    const int lane = lane_id();
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    // After a dispatch whose calls differed (kCallMismatch, seen by every rank) nothing came back: zeros.
    const bool received = a.handle.mismatch[0] == 0;
    for (int t = warp; t < a.num_tokens; t += warps) {
        const int32_t* idx_row = a.topk_idx + static_cast<int64_t>(t) * a.idx_stride;
        // The report carries its dispatch's call number (this kernel keeps no count of its own).
        const bool same_row = combine_row_matches_dispatch(idx_row, lane, g.topk, a.handle.route_digest[t], true,
                                                           a.status, g.rank, t, a.state->dispatch_send_calls);
        const int32_t e = received && same_row && lane < g.topk ? weft::ep::valid_route_expert(g, idx_row, lane) : -1;
        const uint16_t* mine = nullptr;
        if (e >= 0) {
            const int32_t p = weft::ep::ll_route_position(g, idx_row, lane);
            mine = a.combine_recv + l.combine_row_offset(e / g.local_experts(), t, p);
        }
        const float weight = e >= 0 ? a.topk_weights[static_cast<int64_t>(t) * a.weight_stride + lane] : 0.0f;
        const uint32_t slots = __ballot_sync(0xffffffffu, e >= 0);
        auto* dst = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(t) * a.out_stride);
        warp_weighted_sum<C.unroll>(slots, weight, detail::ReturnedRows{mine}, 0, granules,
                                    [dst](int gi, uint4 v) { ptx::st(dst + gi, v); });
    }
}

}  // namespace weft::kernels::ep
