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

/// The network hop of the two-hop dispatch: t(n, l) (node n's member with local index l) sends one block per node m to
/// its column peer t(m, l). Record t of block m is token t (fixed slots: `capacity` of them), written when the token
/// has a valid route on node m: its row, its k expert ids and weights as given, and for each member j of node m the
/// token's send_idx for that rank (-1: not sent there). A token without a route on node m leaves its row unwritten and
/// every send_idx -1. A last record (index `capacity`) is the block's header: in its send_idx field, the number of this
/// rank's tokens going to each member j of node m (the layout kernel's tokens_per_rank).
struct NodeRecordLayout {
    int32_t num_nodes;        ///< N: blocks per exchange
    int32_t ranks_per_node;   ///< L: send_idx values per record
    int32_t capacity;         ///< token records per block: max_tokens_per_rank (then the header record)
    int32_t topk;             ///< k
    int64_t ids_offset;       ///< bytes from a record's start to its k int32 expert ids (team-wide ids)
    int64_t weights_offset;   ///< to its k fp32 weights
    int64_t send_idx_offset;  ///< to its L int32 send indices (the header's counts)
    int64_t record_bytes;     ///< a multiple of 16

    WEFT_HOST_DEVICE static constexpr NodeRecordLayout make(const Geometry& g, int32_t num_nodes,
                                                            int32_t ranks_per_node) {
        NodeRecordLayout l{};
        l.num_nodes = num_nodes;
        l.ranks_per_node = ranks_per_node;
        l.capacity = g.max_tokens;
        l.topk = g.topk;
        l.ids_offset = g.row_bytes();
        l.weights_offset = l.ids_offset + 4 * int64_t{g.topk};
        l.send_idx_offset = l.weights_offset + 4 * int64_t{g.topk};
        l.record_bytes = round_up(l.send_idx_offset + 4 * int64_t{ranks_per_node}, 16);
        return l;
    }
    WEFT_HOST_DEVICE constexpr int64_t block_bytes() const { return (int64_t{capacity} + 1) * record_bytes; }
    /// Bytes of one exchange (N blocks), sent and received alike.
    WEFT_HOST_DEVICE constexpr int64_t bytes() const { return int64_t{num_nodes} * block_bytes(); }
    WEFT_HOST_DEVICE constexpr int64_t record_offset(int32_t node, int32_t index) const {
        return int64_t{node} * block_bytes() + int64_t{index} * record_bytes;
    }
};

/// Writes the metadata of token record (block m, token t): k ids and weights as given (`row`, `weights`), and the
/// send_idx of each member of node m (`members`: their team ranks, L of them; `send_idx`: the token's [W] send
/// indices). Returns whether the token goes to node m at all (some send_idx >= 0); the row is the caller's to copy.
WEFT_HOST_DEVICE inline bool fill_node_record(const NodeRecordLayout& l, const int32_t* row, const float* weights,
                                              const int32_t* send_idx, const int32_t* members, uint8_t* record) {
    auto* ids = reinterpret_cast<int32_t*>(record + l.ids_offset);
    auto* w = reinterpret_cast<float*>(record + l.weights_offset);
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    bool any = false;
    for (int32_t j = 0; j < l.ranks_per_node; ++j) {
        idx[j] = send_idx[members[j]];
        any = any || idx[j] >= 0;
    }
    for (int32_t j = 0; j < l.topk; ++j) {
        ids[j] = row[j];
        w[j] = weights[j];
    }
    return any;
}

/// A token record that goes nowhere on its node (every send_idx -1; ids and weights untouched, never read).
WEFT_HOST_DEVICE inline void clear_node_record(const NodeRecordLayout& l, uint8_t* record) {
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    for (int32_t j = 0; j < l.ranks_per_node; ++j) idx[j] = -1;
}

/// The header record of block m: tokens going to each member of node m (`tokens_per_rank`: [W], `members`: L).
WEFT_HOST_DEVICE inline void fill_node_header(const NodeRecordLayout& l, const int32_t* tokens_per_rank,
                                              const int32_t* members, uint8_t* record) {
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    for (int32_t j = 0; j < l.ranks_per_node; ++j) idx[j] = tokens_per_rank[members[j]];
}

/// Arguments of kernels/ep/internode.cuh (one struct for every kernel there; each reads its own fields).
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
    // two-hop dispatch (node_pack: x, topk_idx, topk_weights, send_idx, tokens_per_rank as for pack)
    NodeRecordLayout hop;
    const int32_t* team_ranks_by_node;  ///< [N][L] device copy of HostBackend::team_ranks_by_node()
    int32_t node_index;                 ///< n: this rank's node among the team's
    int32_t pad1;
    uint8_t* node_send;        ///< [hop.bytes()] node_pack's output: block m for the column peer on node m
    const uint8_t* node_recv;  ///< [hop.bytes()] block m = what the column peer on node m sent to this node
    uint8_t* forward;          ///< [L][N][capacity] final records: block j for node member j, by source node
};

}  // namespace weft::ep
