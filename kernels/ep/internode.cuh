// SPDX-License-Identifier: MIT
// Normal-mode expert parallelism across nodes: the pack kernel (this rank's tokens into the exchange's records, one
// block of records per destination rank) and the sum kernel (the partials that came back, summed per token in rank
// order). Both are local: the exchange between them runs on the network backend (docs/multinode.md, "EP across
// nodes"; record layout: weft/common/ep_internode.hpp).
#pragma once

#include "ep/common.cuh"
#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_internode.hpp"

namespace weft::kernels::ep {

/// Compile-time knobs of the pack and sum kernels.
struct InternodeConfig {
    int threads = 512;  ///< threads per block, a multiple of 32 in 64..1024
    int unroll = 4;     ///< 16-byte granules each lane keeps in flight per row chunk
};

__host__ __device__ constexpr bool is_valid(const InternodeConfig& c) {
    return c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 && c.unroll >= 1 && c.unroll <= 8;
}

/// Any grid. After the layout kernel (same stream: its send_idx and tokens_per_rank). One warp per token writes the
/// token's record into every block whose send_idx it has (row, local routes, weights); then every thread fills the
/// routes of the unused records (index >= tokens_per_rank[r]) with -1, so that the receiver's one-rank dispatch
/// drops them. Rows of unused records are not written (never read). Local; graph-capturable.
template <InternodeConfig C>
__global__ void __launch_bounds__(C.threads) internode_pack(weft::DeviceCtx ctx, weft::ep::InternodeArgs a) {
    static_assert(is_valid(C), "InternodeConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const weft::ep::InternodeLayout& l = a.net;
    const int num_ranks = g.num_ranks;
    const int granules = g.hidden / 8;
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int t = warp; t < a.num_tokens; t += warps) {
        const auto* src = reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(t) * a.x_stride);
        const int32_t* row = a.topk_idx + static_cast<int64_t>(t) * a.idx_stride;
        const float* weights = a.topk_weights + static_cast<int64_t>(t) * a.weight_stride;
        for (int r = 0; r < num_ranks; ++r) {
            const int32_t idx = a.send_idx[static_cast<int64_t>(t) * num_ranks + r];  // warp-uniform
            if (idx < 0) continue;
            uint8_t* record = a.send + l.record_offset(r, idx);
            warp_copy_row<C.unroll>(reinterpret_cast<uint4*>(record), src, granules);
            if (lane_id() == 0) {
                weft::ep::routes_to_rank(g, l.local_topk, row, weights, r,
                                         reinterpret_cast<int32_t*>(record + l.ids_offset),
                                         reinterpret_cast<float*>(record + l.weights_offset));
            }
        }
    }
    // Unused records: no route.
    const int64_t threads = static_cast<int64_t>(gridDim.x) * C.threads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * C.threads + threadIdx.x; i < l.records(); i += threads) {
        const int32_t r = static_cast<int32_t>(i / l.capacity);
        const int32_t idx = static_cast<int32_t>(i % l.capacity);
        if (idx < a.tokens_per_rank[r]) continue;
        uint8_t* record = a.send + l.record_offset(r, idx);
        auto* ids = reinterpret_cast<int32_t*>(record + l.ids_offset);
        auto* w = reinterpret_cast<float*>(record + l.weights_offset);
        for (int j = 0; j < l.local_topk; ++j) {
            ids[j] = -1;
            w[j] = 0.0f;
        }
    }
}

/// Any grid. After the exchange of the combine's partials (same stream). One warp per token t of this rank:
/// out[t] = bf16(sum over the ranks r with send_idx[t][r] >= 0, ascending, of float(partials[block r, record
/// send_idx[t][r]])), in fp32 from 0 (the one-node combine's arithmetic, bit for bit); a token with no route is 0.
/// Local; graph-capturable.
template <InternodeConfig C>
__global__ void __launch_bounds__(C.threads) internode_sum(weft::DeviceCtx ctx, weft::ep::InternodeArgs a) {
    static_assert(is_valid(C), "InternodeConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry g = a.geo;
    const weft::ep::InternodeLayout& l = a.net;
    const int num_ranks = g.num_ranks;
    const int granules = g.hidden / 8;
    const int lane = lane_id();
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int t = warp; t < a.num_tokens; t += warps) {
        const int32_t* idx = a.send_idx + static_cast<int64_t>(t) * num_ranks;
        auto* dst = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(t) * a.out_stride);
        for (int c0 = 0; c0 < granules; c0 += 32 * U) {
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
            }
            for (int r = 0; r < num_ranks; ++r) {
                const int32_t i = idx[r];  // warp-uniform
                if (i < 0) continue;
                uint4 v[U];
                warp_load_chunk<U>(v, reinterpret_cast<const uint4*>(a.partials + l.partial_offset(r, i)), c0,
                                   granules);
                add_bf16x8<U>(acc, v);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                if (gi < granules) ptx::st(dst + gi, f32_to_bf16x8(acc[u]));
            }
        }
    }
}

}  // namespace weft::kernels::ep
