// SPDX-License-Identifier: MIT
// Normal-mode expert parallelism across nodes: the pack kernel (this rank's tokens into the exchange's records, one
// block of records per destination rank), the two-hop dispatch's node pack (one block per destination node, for the
// column peer there) and forward (what arrived from the network into the records of each member of this node), and
// the sum kernel (the partials that came back, summed per token in rank order). All local: the exchanges between
// them run on the network backend and the node's load/store all_to_all (docs/multinode.md, "EP across nodes"; record
// layouts: weft/common/ep_internode.hpp).
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

/// Two-hop dispatch, the network hop's records. Any grid. After the layout kernel (same stream). One warp per (node m,
/// token slot t): record t of block m (weft::ep::NodeRecordLayout) gets the token's row, ids, weights and its send_idx
/// for each member of node m when the token goes to node m, else only send_idx -1 (slots t >= T too); then each
/// block's header record gets the token counts of node m's members. Local; graph-capturable.
template <InternodeConfig C>
__global__ void __launch_bounds__(C.threads) internode_node_pack(weft::DeviceCtx ctx, weft::ep::InternodeArgs a) {
    static_assert(is_valid(C), "InternodeConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const weft::ep::NodeRecordLayout& hop = a.hop;
    const int num_ranks = g.num_ranks;
    const int granules = g.hidden / 8;
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    const int64_t items = int64_t{hop.num_nodes} * hop.capacity;
    for (int64_t i = warp; i < items; i += warps) {
        const int32_t m = static_cast<int32_t>(i / hop.capacity);
        const int32_t t = static_cast<int32_t>(i % hop.capacity);
        uint8_t* record = a.node_send + hop.record_offset(m, t);
        const int32_t* members = a.team_ranks_by_node + static_cast<int64_t>(m) * hop.ranks_per_node;
        if (t >= a.num_tokens) {
            if (lane_id() == 0) weft::ep::clear_node_record(hop, record);
            continue;
        }
        int goes = 0;
        if (lane_id() == 0) {
            goes = weft::ep::fill_node_record(hop, a.topk_idx + static_cast<int64_t>(t) * a.idx_stride,
                                              a.topk_weights + static_cast<int64_t>(t) * a.weight_stride,
                                              a.send_idx + static_cast<int64_t>(t) * num_ranks, members, record)
                       ? 1
                       : 0;
        }
        goes = __shfl_sync(0xffffffffu, goes, 0);
        if (goes != 0) {
            warp_copy_row<C.unroll>(reinterpret_cast<uint4*>(record),
                                    reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(t) * a.x_stride),
                                    granules);
        }
    }
    const int64_t threads = static_cast<int64_t>(gridDim.x) * C.threads;
    for (int64_t m = static_cast<int64_t>(blockIdx.x) * C.threads + threadIdx.x; m < hop.num_nodes; m += threads) {
        weft::ep::fill_node_header(hop, a.tokens_per_rank, a.team_ranks_by_node + m * hop.ranks_per_node,
                                   a.node_send + hop.record_offset(static_cast<int32_t>(m), hop.capacity));
    }
}

/// Two-hop dispatch, the forward inside the node. Any grid. After the network hop (a.node_recv: block m from the
/// column peer on node m, this node's own block included). One warp per (source node m, token slot t): for each member
/// j of this node that the token goes to, the final record (weft::ep::InternodeLayout: row, j's local routes) at index
/// send_idx of sub-block m of block j of a.forward ([L][N][capacity]); then every thread gives the unused final
/// records (index >= the header's count) no route. Local; graph-capturable.
template <InternodeConfig C>
__global__ void __launch_bounds__(C.threads) internode_forward(weft::DeviceCtx ctx, weft::ep::InternodeArgs a) {
    static_assert(is_valid(C), "InternodeConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    (void)ctx;
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const weft::ep::NodeRecordLayout& hop = a.hop;
    const weft::ep::InternodeLayout& l = a.net;
    const int32_t num_nodes = hop.num_nodes;
    const int32_t per_node = hop.ranks_per_node;
    const int granules = g.hidden / 8;
    const int32_t* members = a.team_ranks_by_node + static_cast<int64_t>(a.node_index) * per_node;
    const int warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    const int64_t items = int64_t{num_nodes} * hop.capacity;
    for (int64_t i = warp; i < items; i += warps) {
        const int32_t m = static_cast<int32_t>(i / hop.capacity);
        const int32_t t = static_cast<int32_t>(i % hop.capacity);
        const uint8_t* record = a.node_recv + hop.record_offset(m, t);
        const auto* idx = reinterpret_cast<const int32_t*>(record + hop.send_idx_offset);
        for (int32_t j = 0; j < per_node; ++j) {
            const int32_t at = idx[j];  // warp-uniform
            if (at < 0) continue;
            uint8_t* dst = a.forward + ((int64_t{j} * num_nodes + m) * l.capacity + at) * l.record_bytes;
            warp_copy_row<C.unroll>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(record), granules);
            if (lane_id() == 0) {
                weft::ep::routes_to_rank(g, l.local_topk, reinterpret_cast<const int32_t*>(record + hop.ids_offset),
                                         reinterpret_cast<const float*>(record + hop.weights_offset), members[j],
                                         reinterpret_cast<int32_t*>(dst + l.ids_offset),
                                         reinterpret_cast<float*>(dst + l.weights_offset));
            }
        }
    }
    const int64_t finals = int64_t{per_node} * num_nodes * l.capacity;
    const int64_t threads = static_cast<int64_t>(gridDim.x) * C.threads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * C.threads + threadIdx.x; i < finals; i += threads) {
        const int32_t j = static_cast<int32_t>(i / (int64_t{num_nodes} * l.capacity));
        const int32_t m = static_cast<int32_t>((i / l.capacity) % num_nodes);
        const int32_t p = static_cast<int32_t>(i % l.capacity);
        const auto* header =
            reinterpret_cast<const int32_t*>(a.node_recv + hop.record_offset(m, hop.capacity) + hop.send_idx_offset);
        if (p < header[j]) continue;
        uint8_t* dst = a.forward + i * l.record_bytes;
        auto* ids = reinterpret_cast<int32_t*>(dst + l.ids_offset);
        auto* w = reinterpret_cast<float*>(dst + l.weights_offset);
        for (int k = 0; k < l.local_topk; ++k) {
            ids[k] = -1;
            w[k] = 0.0f;
        }
    }
}

}  // namespace weft::kernels::ep
