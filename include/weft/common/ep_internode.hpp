// SPDX-License-Identifier: MIT
// Expert parallelism across nodes (normal mode): the record exchange's layout, the per-destination routing of a token,
// and the arguments of the pack and sum kernels, shared by the op (src/ops/ep_*.cpp) and kernels/ep/internode.cuh.
//
// A team of W ranks that spans nodes exchanges fixed-size blocks: block r of a rank's send buffer holds `capacity`
// (= max_tokens_per_rank) records for team rank r, the tokens that have a valid route to r in token order (record i
// is the token whose send_idx for r is i), then padding records whose routes are all -1. A record is the token's row
// (H bf16), its routes on r as r's local expert ids (the valid ones in slot order, then -1: `local_topk` ints) and
// their weights (`local_topk` floats), padded to 16 bytes. After the exchange, rank r's receive buffer is W such
// blocks in source-rank order: one-rank dispatch input whose token order is (source rank, source token), exactly the
// receive order of the one-node op. docs/multinode.md, "EP across nodes".
#pragma once

#include "weft/common/ep_workspace.hpp"

namespace weft::ep {

/// Where everything of one exchange lies (the same on every member: it depends on the Geometry alone).
struct InternodeLayout {
    int32_t num_ranks;       ///< W: blocks per exchange
    int32_t capacity;        ///< records per block: max_tokens_per_rank
    int32_t hidden;          ///< H
    int32_t local_topk;      ///< routes per record: min(k, experts per rank)
    int64_t ids_offset;      ///< bytes from a record's start to its int32 local expert ids
    int64_t weights_offset;  ///< bytes from a record's start to its fp32 weights
    int64_t record_bytes;    ///< bytes per record: a multiple of 16

    WEFT_HOST_DEVICE static constexpr InternodeLayout make(const Geometry& g) {
        InternodeLayout l{};
        l.num_ranks = g.num_ranks;
        l.capacity = g.max_tokens;
        l.hidden = g.hidden;
        l.local_topk = g.topk < g.local_experts() ? g.topk : g.local_experts();
        l.ids_offset = g.row_bytes();
        l.weights_offset = l.ids_offset + 4 * int64_t{l.local_topk};
        l.record_bytes = round_up(l.weights_offset + 4 * int64_t{l.local_topk}, 16);
        return l;
    }
    /// Records of one exchange: the rows of the one-rank dispatch on the receiving side.
    WEFT_HOST_DEVICE constexpr int64_t records() const { return int64_t{num_ranks} * capacity; }
    /// Bytes each rank sends (and receives) in a dispatch.
    WEFT_HOST_DEVICE constexpr int64_t dispatch_bytes() const { return records() * record_bytes; }
    /// Bytes each rank sends (and receives) in a combine: one bf16 partial row per record.
    WEFT_HOST_DEVICE constexpr int64_t combine_bytes() const { return records() * int64_t{hidden} * 2; }
    /// Record `index` of block `rank` (byte offset from the buffer's start).
    WEFT_HOST_DEVICE constexpr int64_t record_offset(int32_t rank, int32_t index) const {
        return (int64_t{rank} * capacity + index) * record_bytes;
    }
    /// Partial row of record `index` of block `rank` (element offset, bf16).
    WEFT_HOST_DEVICE constexpr int64_t partial_offset(int32_t rank, int32_t index) const {
        return (int64_t{rank} * capacity + index) * hidden;
    }
};

/// The routes of one token (`row`: k expert ids, `weights`: k weights) that rank `dst` owns, as `dst`'s local expert
/// ids in slot order, then -1 up to `local_topk`; weights beside them (0 for -1). A route is valid as on one node: an
/// id in [0, E) not repeated by an earlier slot. Returns the number of routes to `dst` (0: the token does not go
/// there). The pack kernel and the host tests share it.
WEFT_HOST_DEVICE inline int32_t routes_to_rank(const Geometry& g, int32_t local_topk, const int32_t* row,
                                               const float* weights, int32_t dst, int32_t* ids, float* out_weights) {
    const int32_t local = g.local_experts();
    int32_t n = 0;
    for (int32_t j = 0; j < g.topk; ++j) {
        const int32_t e = row[j];
        if (e < 0 || e >= g.num_experts || e / local != dst) continue;
        bool repeated = false;
        for (int32_t i = 0; i < j; ++i) repeated = repeated || row[i] == e;
        if (repeated || n >= local_topk) continue;  // n < local_topk always holds for distinct experts of dst
        ids[n] = e - dst * local;
        out_weights[n] = weights[j];
        ++n;
    }
    for (int32_t i = n; i < local_topk; ++i) {
        ids[i] = -1;
        out_weights[i] = 0.0f;
    }
    return n;
}

/// Arguments of kernels/ep/internode.cuh (one struct for both kernels; each reads its own fields).
struct InternodeArgs {
    Geometry geo;  ///< the team's geometry (W ranks)
    InternodeLayout net;
    int32_t num_tokens;  ///< T of this rank
    int32_t pad0;
    // pack
    const uint16_t* x;  ///< [T, H] bf16
    int64_t x_stride;
    const int32_t* topk_idx;  ///< [T, k]
    int64_t idx_stride;
    const float* topk_weights;  ///< [T, k]
    int64_t weight_stride;
    const int32_t* send_idx;         ///< [T, W] the layout kernel's: record index in block r, or -1
    const int32_t* tokens_per_rank;  ///< [W] the layout kernel's: records used in block r
    uint8_t* send;                   ///< [dispatch_bytes()] the exchange's send buffer
    // sum
    const uint16_t* partials;  ///< [W * capacity, H] bf16: block r = rank r's partials of this rank's tokens
    uint16_t* out;             ///< [T, H] bf16
    int64_t out_stride;
};

}  // namespace weft::ep
